"""tools/gpu_check.py, the runner behind `make gpu-check`, on small notebooks.

The chapters themselves run under nbval in `make test`; that every one of their code cells
is plain Python, as this runner executes them, is checked in test_chapters.py.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", TOOL)
gpu_check_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check_module)

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


def command(out: Path, chapters, timeout: float, extra) -> list[str]:
    return [sys.executable, str(TOOL), "--no-script", "--out", str(out), "--timeout",
            str(timeout), *extra, "--chapters", *map(str, chapters)]


def read_report(out: Path) -> dict | None:
    report = out / "report.json"
    return json.loads(report.read_text()) if report.exists() else None


def gpu_check(tmp_path, *chapters, timeout=120, extra=(), env=None):
    out = tmp_path / "out"
    done = subprocess.run(command(out, chapters, timeout, extra), capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=env)
    return done, read_report(out)


class Started:
    """A run of the tool in the background; its output goes to files (no pipe to fill)."""

    def __init__(self, folder: Path, *chapters, timeout=120, extra=(), env=None):
        self.out, self.folder = folder / "out", folder
        with open(folder / "stdout", "w") as stdout, open(folder / "stderr", "w") as stderr:
            self.process = subprocess.Popen(command(self.out, chapters, timeout, extra),
                                            stdout=stdout, stderr=stderr, cwd=ROOT, env=env)

    def finish(self) -> tuple[Path, subprocess.CompletedProcess, dict | None]:
        self.process.wait(timeout=600)
        done = subprocess.CompletedProcess(self.process.args, self.process.returncode,
                                           (self.folder / "stdout").read_text(),
                                           (self.folder / "stderr").read_text())
        return self.folder, done, read_report(self.out)


# The short-timeout run's limit per chapter. Generous: its two hanging chapters wait it
# out idle while the other runs compute beside them, and the chapters that must finish in
# time get it on a loaded machine too.
TIMEOUT_S = 10


# Three runs of the tool cover every case: each asks a child for the machine's facts and
# starts one process per chapter, seconds each, so the cases share runs. The three run at
# once (the short-timeout one mostly waits), and all have ended before the first test
# that reads one (no test may leave a process behind).
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    started = {}
    try:
        started["checked"] = start_checked(tmp_path_factory.mktemp("gpu-check"))
        started["both_envs"] = start_both_envs(tmp_path_factory.mktemp("gpu-check-envs"))
        started["timed_out"] = start_timed_out(tmp_path_factory.mktemp("gpu-check-timeouts"))
        return {name: run.finish() for name, run in started.items()}
    finally:
        for run in started.values():  # none left running, even when one failed
            if run.process.poll() is None:
                run.process.kill()
                run.process.wait()


def start_checked(folder: Path) -> Started:
    """Chapters that pass, fail, or raise when they should (timeout 120 s)."""
    good = chapter(folder, "01_good",
                   "import inspect\n\ndef double(x):\n    return 2 * x",
                   "assert double(2) == 4\nassert 'return 2 * x' in inspect.getsource(double)",
                   ("raise ValueError('shown on purpose')", ["raises-exception"]),
                   "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()")
    bad = chapter(folder, "02_bad", "x = 1", "assert x == 2, 'x should be 2'\ny = 2",
                  "assert y == 2", "never = 1", "assert x == 3, 'x should be 3'")
    quiet = chapter(folder, "03_quiet", ("x = 1", ["raises-exception"]))
    launching = chapter(folder, "06_launch",
                        "import mgpu_helpers as mh\n\ndef where():\n    return mh.rank()",
                        "assert mh.launch(where, nprocs=2, backend='gloo', return_all=True)"
                        " == [0, 1]")
    return Started(folder, good, bad, quiet, launching,
                   extra=("--env", "notebook", "--no-exercises"))


@pytest.fixture(scope="module")
def checked(runs):
    folder, done, report = runs["checked"]
    return folder, done, report, {row["name"]: row for row in report["results"]}


def start_both_envs(folder: Path) -> Started:
    """As by default: a chapter that needs tests/notebook.env's seed, under it and in a
    plain environment, then reference solutions from a fake package through the
    exercise checker."""
    seeded = chapter(folder, "09_seeded",
                     "import os\nassert os.environ.get('MGPU_SEED') == '0', 'MGPU_SEED unset'")
    solutions = fake_solutions(folder / "fake_solutions")
    return Started(folder, seeded,
                   extra=("--solutions", str(solutions), "--exercises", "02.2", "03.3", "01.1"),
                   env={**os.environ, "MGPU_EXERCISE_PROGRESS": str(folder / "progress.json")})


@pytest.fixture(scope="module")
def both_envs(runs):
    return runs["both_envs"]


def fake_solutions(folder: Path) -> Path:
    """A package of reference solutions: 02.2 right (the real one), 03.3 wrong, no ch01."""
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "ch02.py").write_text("from solutions.ch02 import collate_sequences\n"
                                    "REFERENCE = {'02.2': collate_sequences}\n")
    (folder / "ch03.py").write_text("def crossover_bytes(alpha, bandwidth, world):\n"
                                    "    return alpha * bandwidth\n\n"
                                    "REFERENCE = {'03.3': crossover_bytes}\n")
    return folder


def start_timed_out(folder: Path) -> Started:
    """A short timeout: a chapter that hangs in a cell, one whose process lingers after
    its last cell, and a good one after them."""
    hang = chapter(folder, "04_hang", "import time", "assert False, 'before the hang'",
                   "time.sleep(600)")
    lingering = chapter(folder, "07_linger",
                        "import threading, time\n"
                        "threading.Thread(target=time.sleep, args=(600,)).start()")
    good = chapter(folder, "08_good", "x = 1")
    return Started(folder, hang, lingering, good, timeout=TIMEOUT_S,
                   extra=("--env", "notebook", "--no-exercises"))


@pytest.fixture(scope="module")
def timed_out(runs):
    _, done, report = runs["timed_out"]
    return done, {row["name"]: row for row in report["results"]}


def test_cells_run_in_order_in_one_namespace_like_a_kernel(checked):
    _, done, report, rows = checked
    row = rows["01_good"]
    assert row["passed"] and row["cells"] == 4, row
    assert "01_good (notebook env): passed" in done.stdout
    assert report["machine"]["plan"] and report["machine"]["torch"]


def test_the_first_failing_cell_is_named_with_its_error(checked):
    folder, done, report, rows = checked
    assert done.returncode == 1
    assert not rows["02_bad"]["passed"]
    assert rows["02_bad"]["failed_cell"] == 2
    assert rows["02_bad"]["error"] == "AssertionError: x should be 2"
    assert "cell 2: AssertionError: x should be 2" in done.stdout
    assert "Traceback" in (folder / "out" / "02_bad.log").read_text()
    assert "chapters (notebook env): 2 of 4 passed" in done.stdout


def test_every_failing_cell_is_recorded_the_later_ones_as_following_the_first(checked):
    done, rows = checked[1], checked[3]
    assert rows["02_bad"]["failures"] == [
        {"cell": 2, "error": "AssertionError: x should be 2", "follows": None},
        {"cell": 3, "error": "NameError: name 'y' is not defined", "follows": 2},
        {"cell": 5, "error": "AssertionError: x should be 3", "follows": 2}]
    assert "cell 5: AssertionError: x should be 3 (after cell 2)" in done.stdout
    assert rows["01_good"]["failures"] == []


def test_the_chapters_run_again_without_notebook_env(both_envs):
    folder, done, report = both_envs
    [stored], [plain] = report["results"], report["plain_results"]
    assert stored["passed"] and stored["env"] == "notebook"
    assert plain["error"] == "AssertionError: MGPU_SEED unset" and plain["env"] == "plain"
    assert report["envs"] == ["notebook", "plain"] and done.returncode == 1
    assert "chapters (notebook env): 1 of 1 passed" in done.stdout
    assert "chapters (plain env): 0 of 1 passed" in done.stdout
    assert (folder / "out" / "09_seeded.plain.log").exists()


def test_plain_environment_drops_what_notebook_env_sets(monkeypatch):
    monkeypatch.setenv("MGPU_SEED", "7")
    assert gpu_check_module.child_environment(None)["MGPU_SEED"] == "0"
    assert "MGPU_SEED" not in gpu_check_module.child_environment(None, notebook=False)


def test_the_reference_solutions_are_run_through_the_checker(both_envs):
    folder, done, report = both_envs
    rows = {row["name"]: row for row in report["exercises"]}
    assert list(rows) == ["02.2", "03.3", "01.1"]
    assert rows["02.2"]["passed"] and rows["02.2"]["error"] is None
    assert not rows["03.3"]["passed"]
    assert rows["03.3"]["error"].startswith("0 of 3 cases passed; fail: alpha 575 us")
    assert rows["01.1"]["error"].startswith("no reference solution in fake_solutions/ch01.py")
    assert "exercises: 1 of 3 passed" in done.stdout
    assert "Exercise 03.3" in (folder / "out" / "exercises.log").read_text()
    assert not (folder / "progress.json").exists()  # a check, not the reader's attempt


def test_a_cell_that_should_raise_and_does_not_fails(checked):
    rows = checked[3]
    assert rows["03_quiet"]["error"] == "tagged raises-exception, but raised nothing"


def test_chapters_launch_ranks_as_in_a_notebook(checked):
    rows = checked[3]
    assert rows["06_launch"]["passed"], rows["06_launch"]


def test_a_hanging_chapter_times_out_and_the_rest_still_runs(timed_out):
    done, rows = timed_out
    assert rows["04_hang"]["failures"] == [
        {"cell": 2, "error": "AssertionError: before the hang", "follows": None},
        {"cell": 3, "error": f"timed out after {TIMEOUT_S} s", "follows": 2}]
    assert rows["08_good"]["passed"]
    assert done.returncode == 1


def test_a_chapter_whose_process_hangs_after_its_last_cell_fails(timed_out):
    rows = timed_out[1]
    assert rows["07_linger"]["error"] == f"timed out after {TIMEOUT_S} s after its last cell"


def test_missing_notebook_is_refused(tmp_path):
    done, report = gpu_check(tmp_path, tmp_path / "absent.ipynb", extra=("--no-exercises",))
    assert done.returncode == 2 and "no such notebook" in done.stderr and report is None


def test_a_cpu_report_is_not_recorded_as_a_gpu_verdict(checked):
    folder = checked[0]
    done = subprocess.run([sys.executable, str(TOOL), "--record",
                           str(folder / "out" / "report.json")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "run without GPUs" in done.stderr


def test_the_summary_shows_the_doctors_problems_and_every_failing_cell():
    report = {"machine": {"gpus": [], "torch": "2.9", "python": "3.12", "plan": "2 CPU ranks",
                          "problems": ["the NVIDIA driver is too old. Update the driver, "
                                       "or install the cu126 build"]},
              "envs": ["notebook", "plain"], "seconds": 3, "report_path": "r.json",
              "results": [{"name": "05_x", "passed": False, "seconds": 1.0,
                           "error": "E: a", "failed_cell": 3,
                           "failures": [{"cell": 3, "error": "E: a", "follows": None},
                                        {"cell": 7, "error": "E: b", "follows": 3}]}],
              "plain_results": [{"name": "05_x", "passed": True, "seconds": 1.0,
                                 "failures": []}],
              "exercises": [{"name": "05.1", "passed": False, "seconds": 0.5,
                             "error": "1 of 2 cases passed"}]}
    text = gpu_check_module.table(report)
    assert text.index("1 problem(s)") < text.index("05_x")
    assert "Update the driver, or install the cu126 build" in " ".join(text.split())
    assert "cell 3: E: a" in text and "cell 7: E: b (after cell 3)" in text
    assert "05.1      FAILED      0.5  1 of 2 cases passed" in text
    assert "chapters (plain env): 1 of 1 passed" in text
    report["machine"]["problems"] = []
    assert "no problems" in gpu_check_module.table(report)
