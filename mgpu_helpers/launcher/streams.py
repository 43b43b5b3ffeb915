"""Flushing a process's output streams, Python's and C's: a rank does it before
``os._exit``, the launcher before it forks a rank."""

from __future__ import annotations

import sys


def flush_all_streams() -> None:
    """Write out what this process's output streams still buffer: Python's (``sys.stdout``
    and the original ``sys.__stdout__``, with their stderr) and C's stdio (``fflush(NULL)``:
    on a pipe C's stdout is fully buffered; ``exit()`` flushes it, ``os._exit`` does not).

    The launcher calls it before forking too, so a forked rank, which inherits the
    buffers, never writes out its parent's pending output a second time."""
    import ctypes

    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to say
            pass
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to ask (not on Linux or macOS)
        pass
