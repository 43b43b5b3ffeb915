"""Is this kernel running with the settings `make lab` and `make test` use?

The stored outputs of the chapters were made under ``tests/notebook.env`` (one intra-op
thread, fixed hash seed, ...). A chapter opened another way (Colab, Kaggle, a JupyterLab
of your own) still runs, and every check in it still holds, but timings and the last
digits of some printed numbers may differ. :func:`check_notebook_settings` says which
settings differ, and prints nothing when they all match.
"""

from __future__ import annotations

import os
from pathlib import Path

from .paths import CLONE

SETTINGS_FILE = CLONE / "tests" / "notebook.env"


def expected_settings(path: Path = SETTINGS_FILE) -> dict[str, str] | None:
    """The ``KEY=VALUE`` lines of tests/notebook.env; None without the repository."""
    if not Path(path).is_file():
        return None
    settings = {}
    for line in Path(path).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings


def setting_differences(environ=None, path: Path = SETTINGS_FILE) -> list[str]:
    """One line per setting whose value here differs from tests/notebook.env."""
    environ = os.environ if environ is None else environ
    expected = expected_settings(path)
    if expected is None:
        return []
    return [f"{key} is {environ[key]!r} here" if key in environ else f"{key} is unset here"
            for key, value in expected.items() if environ.get(key) != value]


def check_notebook_settings(environ=None, path: Path = SETTINGS_FILE) -> list[str]:
    """Print what differs from the settings `make lab` uses (nothing when all match),
    and return the differences."""
    differences = setting_differences(environ, path)
    if differences:
        print("Not the settings of `make lab` (tests/notebook.env): "
              + "; ".join(differences) + ". Every cell still runs and every check still "
              "holds; timings and the last digits of some printed numbers may differ from "
              "the stored outputs. To match them, start JupyterLab with "
              "tests/with_notebook_env.sh (see the README).")
    return differences
