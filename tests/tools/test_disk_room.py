"""tools/disk_room.py: `make` refuses to create .venv on a disk without room for it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import disk_room  # tools/disk_room.py (pytest's pythonpath)
import pytest

ROOT = Path(__file__).resolve().parents[2]

Usage = namedtuple("Usage", "total used free")


def test_enough_room_is_no_error(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(0, 0, 8e9))
    assert disk_room.room_error(tmp_path / "venv", 7) is None


def test_too_little_room_names_the_need_the_free_space_and_the_disk(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda path: asked.append(path) or Usage(0, 0, 2.5e9))
    error = disk_room.room_error(tmp_path / "not" / "yet" / "venv", 7)
    assert asked == [tmp_path.resolve()]  # the nearest folder that exists
    assert "needs about 7 GB" in error and "only 2.5 GB is free" in error
    assert str(tmp_path.resolve()) in error and "Free 4.5 GB or more" in error


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_stops_before_creating_the_environment(tmp_path):
    venv = tmp_path / "venv"
    done = subprocess.run(
        ["make", "--no-print-directory", "venv", f"VENV={venv}", "VENV_GB=1000000",
         f"PYTHON={sys.executable}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"error: {venv} needs about 1000000 GB of disk" in done.stderr
    assert not venv.exists()  # nothing written, nothing half-installed
