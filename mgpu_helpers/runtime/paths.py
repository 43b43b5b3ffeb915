"""Where the workbook's own files are, found from the package, not from the working
directory: a kernel started in another folder (Kaggle, Colab, a JupyterLab of your own)
finds them too.

``CLONE`` is the top folder of the clone (the package's parent), with ``notebooks/``,
``benchmarks/results/`` (the stored reference runs the chapters print), ``data/`` and
``runs/`` (git-ignored: what runs write). Installed from a wheel, outside a clone,
``in_clone()`` is False and those folders do not exist.
"""

from __future__ import annotations

from pathlib import Path

#: The clone's top folder.
CLONE = Path(__file__).resolve().parents[2]
#: The benchmarks' stored reference runs (``make bench-store`` writes them).
RESULTS = CLONE / "benchmarks" / "results"
#: What runs write: traces, progress, logs (git-ignored).
RUNS = CLONE / "runs"


def in_clone() -> bool:
    """True when the package is used from a clone of the workbook (not a wheel)."""
    return (CLONE / "notebooks").is_dir() and (CLONE / "mgpu_helpers").is_dir()
