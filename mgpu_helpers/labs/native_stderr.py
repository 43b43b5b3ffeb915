"""Silencing what PyTorch's C++ side writes to stderr, for labs whose output a chapter
compares: such lines (the profiler's start and stop, DDP's warnings) carry a timestamp."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager


@contextmanager
def native_stderr_silenced():
    """Sends file descriptor 2 to /dev/null while the block runs. Python's own errors
    still surface as exceptions; only what is written to the descriptor is lost."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
