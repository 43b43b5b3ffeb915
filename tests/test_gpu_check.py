"""tools/gpu_check.py, the runner behind `make gpu-check`, on small notebooks.

The chapters themselves run under nbval in `make test`; that every one of their code cells
is plain Python, as this runner executes them, is checked in test_chapters.py.
"""

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "gpu_check.py"

pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.slow]


def chapter(folder: Path, name: str, *cells) -> Path:
    notebook = new_notebook(cells=[new_markdown_cell(f"# {name}")])
    for cell in cells:
        source, tags = cell if isinstance(cell, tuple) else (cell, [])
        code = new_code_cell(source)
        if tags:
            code.metadata["tags"] = tags
        notebook.cells.append(code)
    path = folder / f"{name}.ipynb"
    nbformat.write(notebook, path)
    return path


def gpu_check(tmp_path, *chapters, timeout=120, extra=()):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(TOOL), "--no-script", "--out", str(out),
                           "--timeout", str(timeout), *extra, "--chapters",
                           *map(str, chapters)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() \
        else None
    return done, report


TIMEOUT_S = 5  # the short-timeout run's limit per chapter


# Two runs of the tool cover every case: each run asks a child for the machine's facts and
# starts one process per chapter, seconds each, so the cases share runs.
@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """One run over chapters that pass, fail, or raise when they should (timeout 120 s)."""
    folder = tmp_path_factory.mktemp("gpu-check")
    good = chapter(folder, "01_good",
                   "import inspect\n\ndef double(x):\n    return 2 * x",
                   "assert double(2) == 4\nassert 'return 2 * x' in inspect.getsource(double)",
                   ("raise ValueError('shown on purpose')", ["raises-exception"]),
                   "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()")
    bad = chapter(folder, "02_bad", "x = 1", "assert x == 2, 'x should be 2'", "never = 1")
    quiet = chapter(folder, "03_quiet", ("x = 1", ["raises-exception"]))
    launching = chapter(folder, "06_launch",
                        "import mgpu_helpers as mh\n\ndef where():\n    return mh.rank()",
                        "assert mh.launch(where, nprocs=2, backend='gloo', return_all=True)"
                        " == [0, 1]")
    done, report = gpu_check(folder, good, bad, quiet, launching)
    return folder, done, report, {row["name"]: row for row in report["results"]}


@pytest.fixture(scope="module")
def timed_out(tmp_path_factory):
    """One run with a short timeout: a chapter that hangs in a cell, one whose process
    lingers after its last cell, and a good one after them."""
    folder = tmp_path_factory.mktemp("gpu-check-timeouts")
    hang = chapter(folder, "04_hang", "import time\ntime.sleep(600)")
    lingering = chapter(folder, "07_linger",
                        "import threading, time\n"
                        "threading.Thread(target=time.sleep, args=(600,)).start()")
    good = chapter(folder, "08_good", "x = 1")
    done, report = gpu_check(folder, hang, lingering, good, timeout=TIMEOUT_S)
    return done, {row["name"]: row for row in report["results"]}



def test_cells_run_in_order_in_one_namespace_like_a_kernel(checked):
    _, done, report, rows = checked
    row = rows["01_good"]
    assert row["passed"] and row["cells"] == 4, row
    assert "01_good: passed" in done.stdout
    assert report["machine"]["plan"] and report["machine"]["torch"]


def test_the_first_failing_cell_is_named_with_its_error(checked):
    folder, done, report, rows = checked
    assert done.returncode == 1
    assert not rows["02_bad"]["passed"]
    assert rows["02_bad"]["failed_cell"] == 2
    assert rows["02_bad"]["error"] == "AssertionError: x should be 2"
    assert "cell 2: AssertionError: x should be 2" in done.stdout
    assert "Traceback" in (folder / "out" / "02_bad.log").read_text()
    assert "2 of 4 passed" in done.stdout


def test_a_cell_that_should_raise_and_does_not_fails(checked):
    rows = checked[3]
    assert rows["03_quiet"]["error"] == "tagged raises-exception, but raised nothing"


def test_chapters_launch_ranks_as_in_a_notebook(checked):
    rows = checked[3]
    assert rows["06_launch"]["passed"], rows["06_launch"]


def test_a_hanging_chapter_times_out_and_the_rest_still_runs(timed_out):
    done, rows = timed_out
    assert rows["04_hang"]["error"] == f"timed out after {TIMEOUT_S} s"
    assert rows["08_good"]["passed"]
    assert done.returncode == 1


def test_a_chapter_whose_process_hangs_after_its_last_cell_fails(timed_out):
    rows = timed_out[1]
    assert rows["07_linger"]["error"] == f"timed out after {TIMEOUT_S} s after its last cell"


def test_missing_notebook_is_refused(tmp_path):
    done, report = gpu_check(tmp_path, tmp_path / "absent.ipynb")
    assert done.returncode == 2 and "no such notebook" in done.stderr and report is None


def test_a_cpu_report_is_not_recorded_as_a_gpu_verdict(checked):
    folder = checked[0]
    done = subprocess.run([sys.executable, str(TOOL), "--record",
                           str(folder / "out" / "report.json")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "run without GPUs" in done.stderr
