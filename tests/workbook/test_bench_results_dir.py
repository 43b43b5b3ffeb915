"""Where benchmarks write: runs/bench/ or MGPU_BENCH_DIR, never over the stored runs in
benchmarks/results/ that the chapters check (unless asked to, by `make bench-store`)."""

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
_spec = importlib.util.spec_from_file_location("results_dir", BENCHMARKS / "results_dir.py")
results_dir = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results_dir)


def test_default_is_runs_bench_and_the_variable_overrides_it(monkeypatch, tmp_path):
    monkeypatch.delenv("MGPU_BENCH_DIR", raising=False)
    assert results_dir.results_dir() == ROOT / "runs" / "bench"
    monkeypatch.setenv("MGPU_BENCH_DIR", str(tmp_path / "new" / "folder"))
    assert results_dir.results_dir() == tmp_path / "new" / "folder"
    assert (tmp_path / "new" / "folder").is_dir()


def test_every_benchmark_writes_through_results_dir():
    scripts = [p for p in sorted(BENCHMARKS.glob("*.py")) if p.name != "results_dir.py"]
    assert len(scripts) >= 10
    for script in scripts:
        source = script.read_text()
        assert "RESULTS = results_dir()" in source, script.name
        # no path of its own into benchmarks/results/ (a JSON key "results" is fine)
        assert not re.search(r'/\s*"results"|benchmarks/results', source), script.name


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


@pytest.mark.slow
def test_a_benchmark_writes_where_mgpu_bench_dir_says_and_not_over_the_stored_runs(tmp_path):
    stored = digests(results_dir.STORED)
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gil_threads.py"), "--rounds", "1", "--repeats", "1"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "MGPU_BENCH_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gil_threads.json", "gil_threads.png"]
    assert json.loads((tmp_path / "gil_threads.json").read_text())["rounds"] == 1
    assert digests(results_dir.STORED) == stored
