"""The nbval harness compares outputs for real, under the settings in tests/notebook.env.

Each test runs `make nbval` (the same target `make test` uses) on a small notebook whose
stored outputs are written here, so a harness that compared nothing would fail them.
"""

import re
import subprocess
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def notebook_settings() -> dict[str, str]:
    lines = (ROOT / "tests" / "notebook.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def probe_cells() -> list:
    """Code cells with stored outputs: the settings the kernel got, an object address
    (hidden by the sanitize rule), a right sum, and a wrong one (7 for sum(range(4)))."""
    settings = notebook_settings()
    cells = [
        ("import os\nprint(os.environ['OMP_NUM_THREADS'], os.environ['PYTHONHASHSEED'])",
         f"{settings['OMP_NUM_THREADS']} {settings['PYTHONHASHSEED']}\n"),
        ("print(object())", "<object object at 0x7f00deadbeef>\n"),
        ("print(sum(range(4)))", "6\n"),
        ("print(sum(range(4)))", "7\n"),
    ]
    made = []
    for source, text in cells:
        cell = new_code_cell(source)
        cell.outputs = [new_output("stream", name="stdout", text=text)]
        made.append(cell)
    return made


def run_nbval(*notebooks: Path) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """`make nbval` on ``notebooks`` in one run; with each notebook's verdicts, e.g.
    {"probe.ipynb": "PPF"} (P passed, F failed, a letter a code cell)."""
    done = subprocess.run(["make", "--no-print-directory", "nbval",
                           f"NOTEBOOKS={' '.join(map(str, notebooks))}",
                           "NBVAL_FLAGS=--nbval --nbval-current-env --nbval-sanitize-with "
                           "tests/nbval_sanitize.cfg -v"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    # -v prints "::Cell 0 PASSED" (no file name for a notebook outside the repository),
    # in the order of the command line: each notebook's cells in turn.
    outcomes = [match[0] for match in re.findall(r"^::Cell \d+ (PASSED|FAILED)", done.stdout,
                                                  re.MULTILINE)]
    verdicts = {}
    for path in notebooks:
        cells = sum(cell.cell_type == "code" for cell in nbformat.read(path, 4).cells)
        verdicts[path.name], outcomes = "".join(outcomes[:cells]), outcomes[cells:]
    assert not outcomes, done.stdout
    return done, verdicts


def make_notebooks_execution(path: Path) -> str:
    """The command with which `make notebooks` executes ``path``, as `make -n` prints it.
    Its other command rewrites the chapters' navigation lines (seconds, and nothing here
    reads them), so only this one is run."""
    dry_run = subprocess.run(["make", "--no-print-directory", "-n", "notebooks",
                              f"NOTEBOOKS={path}"], cwd=ROOT, capture_output=True, text=True,
                             check=True)
    (command,) = [line for line in dry_run.stdout.splitlines()
                  if "chapters.py execute" in line and str(path) in line]
    return command


def execute(path: Path, *sources: str) -> tuple[subprocess.CompletedProcess, list]:
    """Write a notebook of ``sources``, execute it as `make notebooks` does (a fresh kernel,
    notebook settings), and return the run and each cell's stored outputs."""
    notebook = new_notebook(metadata={"kernelspec": {"name": "python3", "language": "python",
                                                     "display_name": "Python 3"}})
    notebook.cells = [new_code_cell(source) for source in sources]
    nbformat.write(notebook, path)
    executed = subprocess.run(make_notebooks_execution(path), shell=True, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
    assert executed.returncode == 0, executed.stdout + executed.stderr
    return executed, [cell.outputs for cell in nbformat.read(path, as_version=4).cells]


# A widget bar drawn in the kernel, then a text bar drawn by a forked rank: one execution
# runs both in one kernel (each start of a kernel costs seconds).
WIDGET_BAR = ("import time\nfrom tqdm.auto import tqdm\n"
              "for _ in tqdm(range(20), desc='work', unit='step'):\n    time.sleep(0.02)\n"
              "print('done')")
RANK_BAR = ("from mgpu_helpers import launch\n"
            "from mgpu_helpers.runtime.progress import progress_bar"
            "\n\ndef work():\n    for _ in progress_bar(range(3), desc='rank work', "
            "unit='step'):\n        pass\n\n"
            "launch(work, nprocs=1, start_method='fork')\nprint('done')")


@pytest.fixture(scope="module")
def bars(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bars")
    executed, (widget, rank) = execute(folder / "bars.ipynb", WIDGET_BAR, RANK_BAR)
    return folder / "bars.ipynb", executed, widget, rank


@pytest.fixture(scope="module")
def compared(bars):
    """One `make nbval` run on one notebook (one kernel): the widget bar's cell as executed
    above, then the probe cells (the rank's bar, whose rate changes, is checked above)."""
    notebook = nbformat.read(bars[0], as_version=4)
    notebook.cells = [notebook.cells[0], *probe_cells()]
    for count, cell in enumerate(notebook.cells, start=1):
        cell.execution_count = count
    path = bars[0].with_name("compared.ipynb")
    nbformat.write(notebook, path)
    return run_nbval(path)


def test_nbval_compares_outputs_under_notebook_settings(compared):
    done, verdicts = compared
    # Settings reached the kernel, the sanitize rule hid the object address, a matching
    # output passed; a changed output (the wrong sum, last) fails its cell, and the run.
    assert verdicts["compared.ipynb"][1:] == "PPPF", done.stdout + done.stderr
    assert done.returncode != 0


def test_a_widget_progress_bar_in_the_kernel_survives_nbval(bars, compared):
    """tqdm.auto draws a widget bar in a kernel; its stored text form repeats exactly.

    The bar runs long enough for its rate to differ between runs: only the text at
    creation (0%) is stored beside the widget reference, so nbval compares the cell.
    """
    _, _, outputs, _ = bars
    bar = outputs[0]["data"]
    assert "application/vnd.jupyter.widget-view+json" in bar  # a widget, not a text bar
    assert bar["text/plain"].startswith("work:   0%")
    assert outputs[-1]["text"] == "done\n"
    done, verdicts = compared
    assert verdicts["compared.ipynb"][0] == "P", done.stdout + done.stderr


def test_a_rank_forked_from_the_kernel_shows_a_text_bar(bars):
    """A widget drawn by a forked rank would never reach the page (its messages are
    dropped, and the kernel logs "attempted to send message from fork"). progress_bar
    draws text inside a rank, which the launcher relays with the rank's prefix."""
    _, executed, _, outputs = bars
    assert "send message from fork" not in executed.stderr
    assert all(output["output_type"] == "stream" for output in outputs), outputs
    text = "".join(output["text"] for output in outputs)
    assert "[rank 0] rank work: 100%" in text
    assert text.endswith("done\n")
