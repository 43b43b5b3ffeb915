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


def test_cells_run_in_order_in_one_namespace_like_a_kernel(tmp_path):
    good = chapter(tmp_path, "01_good",
                   "import inspect\n\ndef double(x):\n    return 2 * x",
                   "assert double(2) == 4\nassert 'return 2 * x' in inspect.getsource(double)",
                   ("raise ValueError('shown on purpose')", ["raises-exception"]),
                   "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()")
    done, report = gpu_check(tmp_path, good)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = report["results"]
    assert row["passed"] and row["cells"] == 4 and row["name"] == "01_good"
    assert "01_good  passed" in done.stdout and "1 of 1 passed" in done.stdout
    assert report["machine"]["plan"] and report["machine"]["torch"]


def test_the_first_failing_cell_is_named_with_its_error(tmp_path):
    good = chapter(tmp_path, "01_good", "x = 1")
    bad = chapter(tmp_path, "02_bad", "x = 1", "assert x == 2, 'x should be 2'", "never = 1")
    done, report = gpu_check(tmp_path, good, bad)
    assert done.returncode == 1
    rows = {row["name"]: row for row in report["results"]}
    assert rows["01_good"]["passed"] and not rows["02_bad"]["passed"]
    assert rows["02_bad"]["failed_cell"] == 2
    assert rows["02_bad"]["error"] == "AssertionError: x should be 2"
    assert "cell 2: AssertionError: x should be 2" in done.stdout
    assert "Traceback" in (tmp_path / "out" / "02_bad.log").read_text()


def test_a_cell_that_should_raise_and_does_not_fails(tmp_path):
    quiet = chapter(tmp_path, "03_quiet", ("x = 1", ["raises-exception"]))
    _, report = gpu_check(tmp_path, quiet)
    assert report["results"][0]["error"] == "tagged raises-exception, but raised nothing"


def test_a_hanging_chapter_times_out_and_the_rest_still_runs(tmp_path):
    hang = chapter(tmp_path, "04_hang", "import time\ntime.sleep(600)")
    good = chapter(tmp_path, "05_good", "x = 1")
    done, report = gpu_check(tmp_path, hang, good, timeout=5)
    rows = {row["name"]: row for row in report["results"]}
    assert rows["04_hang"]["error"] == "timed out after 5 s"
    assert rows["05_good"]["passed"]


def test_chapters_launch_ranks_as_in_a_notebook(tmp_path):
    launching = chapter(tmp_path, "06_launch",
                        "import mgpu_helpers as mh\n\ndef where():\n    return mh.rank()",
                        "assert mh.launch(where, nprocs=2, backend='gloo', return_all=True)"
                        " == [0, 1]")
    _, report = gpu_check(tmp_path, launching)
    assert report["results"][0]["passed"], report


def test_a_chapter_whose_process_hangs_after_its_last_cell_fails(tmp_path):
    lingering = chapter(tmp_path, "07_linger",
                        "import threading, time\n"
                        "threading.Thread(target=time.sleep, args=(600,)).start()")
    _, report = gpu_check(tmp_path, lingering, timeout=10)
    assert report["results"][0]["error"] == "timed out after 10 s after its last cell"


def test_missing_notebook_is_refused(tmp_path):
    done, report = gpu_check(tmp_path, tmp_path / "absent.ipynb")
    assert done.returncode == 2 and "no such notebook" in done.stderr and report is None


def test_a_cpu_report_is_not_recorded_as_a_gpu_verdict(tmp_path):
    good = chapter(tmp_path, "01_good", "x = 1")
    gpu_check(tmp_path, good)
    done = subprocess.run([sys.executable, str(TOOL), "--record",
                           str(tmp_path / "out" / "report.json")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "run without GPUs" in done.stderr
