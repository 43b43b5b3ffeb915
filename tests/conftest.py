"""Shared fixtures: no test may leave a process behind."""

import time

import psutil
import pytest


def child_pids() -> list[int]:
    """Live (non-zombie) processes whose parent is this test process (Linux and macOS)."""
    found = []
    for child in psutil.Process().children(recursive=False):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                found.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.fixture
def no_leftover_processes():
    yield
    deadline = time.monotonic() + 5
    while child_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert child_pids() == [], "a test left child processes running"
