"""How a launched rank's process ends: its process group, the threads and child
processes its work left, its buffered output, then ``os._exit``."""

from __future__ import annotations

import os
import sys
import traceback

import torch.distributed as dist

from ..private_apis import join_non_daemon_threads, run_multiprocessing_finalizers

# A launched rank's process ends right after its group, with os._exit (see _end_rank).
# destroy_process_group() shuts every backend down (NCCL communicators too), but the
# destroyed gloo group's destructor then takes about 20 ms to join its threads and close
# its sockets: a rank holds the group here instead, and the exit frees it.
_ENDED_GROUPS: list = []


def _finish_group(clean: bool, process_ends: bool = False) -> None:
    if dist.is_available() and dist.is_initialized():
        if clean:
            dist.barrier()  # no rank tears down the store while another still needs it
        group = dist.group.WORLD
        dist.destroy_process_group()
        if process_ends:
            _ENDED_GROUPS.append(group)


def _end_rank(code: int) -> None:
    """End the rank's process the same way under fork and spawn: what multiprocessing
    does after its target returns (its finalizers; daemonic children such as DataLoader
    workers terminated, the others joined; non-daemon threads and thread pools joined),
    the streams flushed, Python's and C's, then ``os._exit``.

    A forked multiprocessing child leaves with ``os._exit`` anyway; a spawned one with
    ``sys.exit``, which finalizes the interpreter while gloo's worker threads still run.
    A worker thread that then touches a Python object (a tensor of its last collective)
    cannot take the GIL any more, and the process aborts with "terminate called without
    an active exception" after it has returned its result: one spawn launch in 40 did,
    on two cores under load. What ``os._exit`` skips is the interpreter's finalization:
    ``atexit`` handlers registered in the rank, and object destructors.
    """
    for step in (run_multiprocessing_finalizers, join_non_daemon_threads):
        try:
            step()
        except BaseException:  # keep ending; say why
            traceback.print_exc()
    flush_all_streams()  # os._exit would drop what is still buffered
    os._exit(code)


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
