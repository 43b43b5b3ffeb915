"""The nbval harness compares outputs for real, under the settings in tests/notebook.env.

Each test runs `make nbval` (the same target `make test` uses) on a small notebook whose
stored outputs are written here, so a harness that compared nothing would fail them.
"""

import subprocess
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

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
