"""Keeping what PyTorch's C++ side writes to stderr out of outputs a chapter compares:
such lines (the profiler's start and stop, DDP's warnings) carry a timestamp."""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager


@contextmanager
def native_stderr_silenced(keep_lines_without: str | None = None):
    """Sends file descriptor 2 to a temporary file while the block runs, then drops it.

    With ``keep_lines_without``, only the lines containing that text are dropped: every
    other line (an error's last words, another warning) is written back to stderr when
    the block ends. Python's own errors surface as exceptions either way."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if keep_lines_without is not None:
                captured.seek(0)
                dropped = keep_lines_without.encode()
                kept = [line for line in captured.read().splitlines(keepends=True)
                        if dropped not in line]
                if kept:
                    os.write(2, b"".join(kept))
