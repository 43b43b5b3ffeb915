"""Shared fixtures: no test may leave a process behind. Tests start with make's flags
removed from the environment."""

import os
import time

import psutil
import pytest


def _is_resource_tracker(process: psutil.Process) -> bool:
    """multiprocessing's resource tracker: started by the first spawned child, it serves
    this test process until it exits. It is not a rank or a worker left behind."""
    return any("multiprocessing.resource_tracker" in part for part in process.cmdline())


def child_pids() -> list[int]:
    """Live (non-zombie) processes whose parent is this test process (Linux and macOS)."""
    found = []
    for child in psutil.Process().children(recursive=False):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and not _is_resource_tracker(child):
                found.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


# Some tests run `make lab`, `make nbval`... themselves. Under `make test` the parent
# make's flags (its jobserver, --output-sync) would reach those runs: output held back
# until JupyterLab exits, and "jobserver unavailable" warnings. Each test's make starts
# as if typed at a shell.
for variable in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"):
    os.environ.pop(variable, None)


@pytest.fixture
def no_leftover_processes():
    yield
    deadline = time.monotonic() + 5
    while child_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert child_pids() == [], "a test left child processes running"
