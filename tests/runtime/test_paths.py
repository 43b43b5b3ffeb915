"""mgpu_helpers.runtime.paths: the workbook's files found from the package, whatever the working
directory (a kernel started outside notebooks/, as on Kaggle or Colab)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from mgpu_helpers.runtime import paths

ROOT = Path(__file__).resolve().parents[2]


def test_the_clone_and_its_folders_are_found_from_the_package():
    assert paths.CLONE == ROOT and paths.in_clone()
    assert paths.RESULTS == ROOT / "benchmarks" / "results" and paths.RESULTS.is_dir()
    assert paths.RUNS == ROOT / "runs"


def test_a_process_started_elsewhere_finds_the_stored_runs(tmp_path):
    code = ("from mgpu_helpers.runtime.paths import RESULTS; "
            "print((RESULTS / 'allreduce_cost.json').is_file())")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == "True", done.stderr


def test_no_chapter_reaches_benchmarks_or_runs_through_the_working_directory():
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for index, cell in enumerate(json.loads(notebook.read_text())["cells"]):
            source = "".join(cell["source"])
            if cell["cell_type"] == "code":
                for relative in ("../benchmarks", "../runs"):
                    assert relative not in source, (
                        f"{notebook.name} cell {index} reads {relative}: use "
                        "mgpu_helpers.runtime.paths.RESULTS or RUNS, which do not depend on the "
                        "kernel's working directory")
