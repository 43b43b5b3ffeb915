"""The nbval harness compares outputs for real, under the settings in tests/notebook.env.

Each test runs `make nbval` (the same target `make test` uses) on a small notebook whose
stored outputs are written here, so a harness that compared nothing would fail them.
"""

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


def run_nbval(notebook: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "nbval", f"NOTEBOOKS={notebook}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def execute_one_cell(path: Path, source: str) -> tuple[subprocess.CompletedProcess, list]:
    """Write a one-cell notebook, execute it with `make notebooks` (fresh kernel, notebook
    settings), and return the run and the cell's stored outputs."""
    notebook = new_notebook(metadata={"kernelspec": {"name": "python3", "language": "python",
                                                     "display_name": "Python 3"}})
    notebook.cells.append(new_code_cell(source))
    nbformat.write(notebook, path)
    executed = subprocess.run(["make", "--no-print-directory", "notebooks",
                               f"NOTEBOOKS={path}"], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
    assert executed.returncode == 0, executed.stdout + executed.stderr
    return executed, nbformat.read(path, as_version=4).cells[0].outputs


@pytest.mark.parametrize(("sum_output", "passes"), [("6\n", True), ("7\n", False)])
def test_nbval_compares_outputs_under_notebook_settings(tmp_path, sum_output, passes):
    done = run_nbval(write_notebook(tmp_path / "probe.ipynb", sum_output))
    if passes:
        # Settings reached the kernel, and the sanitize rule hid the object address.
        assert done.returncode == 0, done.stdout + done.stderr
        assert "3 passed" in done.stdout
    else:
        assert done.returncode != 0
        assert "1 failed, 2 passed" in done.stdout


def test_a_widget_progress_bar_in_the_kernel_survives_nbval(tmp_path):
    """tqdm.auto draws a widget bar in a kernel; its stored text form repeats exactly.

    The bar runs long enough for its rate to differ between runs: only the text at
    creation (0%) is stored beside the widget reference, so nbval compares the cell.
    """
    path = tmp_path / "bar.ipynb"
    _, outputs = execute_one_cell(path, (
        "import time\nfrom tqdm.auto import tqdm\n"
        "for _ in tqdm(range(20), desc='work', unit='step'):\n    time.sleep(0.02)\n"
        "print('done')"))
    bar = outputs[0]["data"]
    assert "application/vnd.jupyter.widget-view+json" in bar  # a widget, not a text bar
    assert bar["text/plain"].startswith("work:   0%")
    assert outputs[-1]["text"] == "done\n"
    done = run_nbval(path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_a_rank_forked_from_the_kernel_shows_a_text_bar(tmp_path):
    """A widget drawn by a forked rank would never reach the page (its messages are
    dropped, and the kernel logs "attempted to send message from fork"). progress_bar
    draws text inside a rank, which the launcher relays with the rank's prefix."""
    executed, outputs = execute_one_cell(tmp_path / "rank_bar.ipynb", (
        "from mgpu_helpers import launch\nfrom mgpu_helpers.progress import progress_bar\n\n"
        "def work():\n    for _ in progress_bar(range(3), desc='rank work', unit='step'):\n"
        "        pass\n\n"
        "launch(work, nprocs=1, start_method='fork')\nprint('done')"))
    assert "send message from fork" not in executed.stderr
    assert all(output["output_type"] == "stream" for output in outputs), outputs
    text = "".join(output["text"] for output in outputs)
    assert "[rank 0] rank work: 100%" in text
    assert text.endswith("done\n")
