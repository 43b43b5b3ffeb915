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

from ..paths import RUNS, in_clone


def progress_file() -> Path:
    """Where progress is kept; see the module's docstring."""
    if os.environ.get("MGPU_EXERCISE_PROGRESS"):
        return Path(os.environ["MGPU_EXERCISE_PROGRESS"])
    if in_clone():
        return RUNS / "exercise_progress.json"
    data_home = Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share"))
    return data_home / "mgpu-workbook" / "exercise_progress.json"


def passed() -> dict[str, bool]:
    """Exercise key -> whether its last check passed every case (checked ones only)."""
    path = progress_file()
    try:
        recorded = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return {key: bool(value) for key, value in recorded.items()} if isinstance(
        recorded, dict) else {}


def record(key: str, outcome: bool) -> None:
    """Remember the last check of exercise ``key``; written atomically, so an interrupted
    write never loses what was recorded before."""
    path = progress_file()
    state = passed()
    state[key] = outcome
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(dict(sorted(state.items())), indent=1) + "\n")
    temporary.replace(path)
