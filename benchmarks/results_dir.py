"""Where a benchmark writes its JSON and plot.

``benchmarks/results/`` holds the stored runs: measured on this repository's 2-core
reference machine, they are what the chapters check their claims against and what the
README quotes. A run on any other machine must not overwrite them: the chapters' checks
would then hold another machine's numbers against claims about this one, and `make test`
would fail. So a benchmark writes to ``runs/bench/`` (git-ignored), or to the folder
named by ``MGPU_BENCH_DIR``; `make bench-store` sets it to ``benchmarks/results/`` to
renew the stored runs.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STORED = ROOT / "benchmarks" / "results"
DEFAULT = ROOT / "runs" / "bench"


def results_dir() -> Path:
    """The folder this run writes to (created if missing)."""
    chosen = os.environ.get("MGPU_BENCH_DIR", "").strip()
    folder = Path(chosen).expanduser().resolve() if chosen else DEFAULT
    folder.mkdir(parents=True, exist_ok=True)
    return folder
