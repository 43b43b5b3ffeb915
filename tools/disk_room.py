"""Is there room for .venv? Run by `make` before it creates the environment.

PyTorch's CUDA build and its libraries take about 6.2 GB once installed (x86-64, the
pinned versions). A pip install that runs out of disk half-way stops with "[Errno 28] No
space left on device" after minutes, and leaves a broken .venv behind; this check says
so before anything is written, with how much is free and where.

    python tools/disk_room.py .venv          # exit 1 when less than 7 GB is free there
    python tools/disk_room.py .venv --gb 10
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

NEEDED_GB = 7.0  # the installed environment, 6.2 GB, and a margin for pip's own files


def nearest_existing(path: Path) -> Path:
    """``path`` itself, or its closest ancestor that exists (the disk it will be on)."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def room_error(target: Path, needed_gb: float) -> str | None:
    """Why ``target`` cannot take ``needed_gb`` gigabytes, or None if it can."""
    place = nearest_existing(target)
    free_gb = shutil.disk_usage(place).free / 1e9
    if free_gb >= needed_gb:
        return None
    return (f"error: {target} needs about {needed_gb:.0f} GB of disk (PyTorch with its CUDA "
            f"libraries), and only {free_gb:.1f} GB is free on the disk that holds {place}. "
            f"Free {needed_gb - free_gb:.1f} GB or more there (an old clone's .venv, "
            f"pip's cache: `pip cache purge`), then run make again.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, help="where the environment will be created")
    parser.add_argument("--gb", type=float, default=NEEDED_GB, help="gigabytes it needs")
    args = parser.parse_args(argv)
    error = room_error(args.target, args.gb)
    if error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
