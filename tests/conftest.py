"""Shared fixtures: no test may leave a process behind."""

import os
import time

import pytest


def child_pids() -> list[int]:
    """Live (non-zombie) processes whose parent is this test process."""
    me = str(os.getpid())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                state, parent = stat.read().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if parent == me and state != "Z":
            found.append(int(entry))
    return found


@pytest.fixture
def no_leftover_processes():
    yield
    deadline = time.monotonic() + 5
    while child_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert child_pids() == [], "a test left child processes running"
