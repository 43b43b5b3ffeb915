"""Which exercises the reader has passed on this machine.

Kept in one small JSON file, never in the notebooks: ``runs/exercise_progress.json`` in
the workbook's clone (``runs/`` is git-ignored), or, where the package is installed
outside a clone, ``~/.local/share/mgpu-workbook/exercise_progress.json``. The
environment variable ``MGPU_EXERCISE_PROGRESS`` names another file (the tests use it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..runtime.paths import RUNS, in_clone


def progress_file() -> Path:
    """Where progress is kept; see the module's docstring."""
    if os.environ.get("MGPU_EXERCISE_PROGRESS"):
        return Path(os.environ["MGPU_EXERCISE_PROGRESS"])
    if in_clone():
        return RUNS / "exercise_progress.json"
    data_home = Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share"))
    return data_home / "mgpu-workbook" / "exercise_progress.json"


def _recorded() -> dict[str, dict]:
    """Exercise key -> {"passed": the last check passed, "failed": failed checks so far}.
    A file of an earlier version (key -> bool) reads as no failed check."""
    try:
        recorded = json.loads(progress_file().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    if not isinstance(recorded, dict):
        return {}
    state = {}
    for key, value in recorded.items():
        if isinstance(value, dict):
            failed = value.get("failed", 0)
            state[key] = {"passed": bool(value.get("passed")),
                          "failed": failed if isinstance(failed, int) and failed > 0 else 0}
        else:
            state[key] = {"passed": bool(value), "failed": 0}
    return state


def passed() -> dict[str, bool]:
    """Exercise key -> whether its last check passed every case (checked ones only)."""
    return {key: value["passed"] for key, value in _recorded().items()}


def failed_checks(key: str) -> int:
    """How many checks of exercise ``key`` failed on this machine: how far up its hint
    ladder the reader has climbed."""
    return _recorded().get(key, {}).get("failed", 0)


def record(key: str, outcome: bool) -> None:
    """Remember the last check of exercise ``key`` (and count it if it failed); written
    atomically, so an interrupted write never loses what was recorded before."""
    path = progress_file()
    state = _recorded()
    failed = state.get(key, {}).get("failed", 0) + (not outcome)
    state[key] = {"passed": outcome, "failed": failed}
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(dict(sorted(state.items())), indent=1) + "\n")
    temporary.replace(path)
