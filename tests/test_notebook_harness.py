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

ROOT = Path(__file__).resolve().parent.parent


def notebook_settings() -> dict[str, str]:
    lines = (ROOT / "tests" / "notebook.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def write_notebook(path: Path, sum_output: str) -> Path:
    settings = notebook_settings()
    cells = [
        ("import os\nprint(os.environ['OMP_NUM_THREADS'], os.environ['PYTHONHASHSEED'])",
         f"{settings['OMP_NUM_THREADS']} {settings['PYTHONHASHSEED']}\n"),
        ("print(object())", "<object object at 0x7f00deadbeef>\n"),
        ("print(sum(range(4)))", sum_output),
    ]
    nb = new_notebook(metadata={"kernelspec": {"name": "python3", "language": "python",
                                               "display_name": "Python 3"}})
    for count, (source, text) in enumerate(cells, start=1):
        cell = new_code_cell(source, execution_count=count)
        cell.outputs = [new_output("stream", name="stdout", text=text)]
        nb.cells.append(cell)
    nbformat.write(nb, path)
    return path


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


def execute(*notebooks: tuple[Path, str]) -> tuple[subprocess.CompletedProcess, list]:
    """Write one-cell notebooks (path, source), execute them with `make notebooks` (a fresh
    kernel each, notebook settings), and return the run and each cell's stored outputs."""
    for path, source in notebooks:
        notebook = new_notebook(metadata={"kernelspec": {"name": "python3",
                                                         "language": "python",
                                                         "display_name": "Python 3"}})
        notebook.cells.append(new_code_cell(source))
        nbformat.write(notebook, path)
    paths = " ".join(str(path) for path, _ in notebooks)
    executed = subprocess.run(["make", "--no-print-directory", "notebooks",
                               f"NOTEBOOKS={paths}"], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
    assert executed.returncode == 0, executed.stdout + executed.stderr
    return executed, [nbformat.read(path, as_version=4).cells[0].outputs
                      for path, _ in notebooks]


# A widget bar drawn in the kernel, and a text bar drawn by a forked rank: one run of
# `make notebooks` executes both (each start of the runner and its kernel costs seconds).
WIDGET_BAR = ("import time\nfrom tqdm.auto import tqdm\n"
              "for _ in tqdm(range(20), desc='work', unit='step'):\n    time.sleep(0.02)\n"
              "print('done')")
RANK_BAR = ("from mgpu_helpers import launch\nfrom mgpu_helpers.progress import progress_bar"
            "\n\ndef work():\n    for _ in progress_bar(range(3), desc='rank work', "
            "unit='step'):\n        pass\n\n"
            "launch(work, nprocs=1, start_method='fork')\nprint('done')")


@pytest.fixture(scope="module")
def bars(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bars")
    executed, (widget, rank) = execute((folder / "bar.ipynb", WIDGET_BAR),
                                       (folder / "rank_bar.ipynb", RANK_BAR))
    return folder / "bar.ipynb", executed, widget, rank


@pytest.fixture(scope="module")
def compared(tmp_path_factory, bars):
    """One `make nbval` run: a probe whose stored outputs match, the same probe with a
    wrong stored sum, and the widget bar's notebook as executed above."""
    folder = tmp_path_factory.mktemp("probes")
    return run_nbval(write_notebook(folder / "matching.ipynb", "6\n"),
                     write_notebook(folder / "wrong_sum.ipynb", "7\n"), bars[0])


def test_nbval_compares_outputs_under_notebook_settings(compared):
    done, verdicts = compared
    # Settings reached the kernel, and the sanitize rule hid the object address.
    assert verdicts["matching.ipynb"] == "PPP", done.stdout + done.stderr
    # A changed output fails its cell, and the run.
    assert verdicts["wrong_sum.ipynb"] == "PPF", done.stdout + done.stderr
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
    assert verdicts["bar.ipynb"] == "P", done.stdout + done.stderr


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
