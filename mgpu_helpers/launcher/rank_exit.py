"""How a launched rank's process ends: its process group, the threads and child
processes its work left, its buffered output, then ``os._exit``."""

from __future__ import annotations

import os
import traceback

import torch.distributed as dist

from ..runtime.private_apis import join_non_daemon_threads, run_multiprocessing_finalizers
from .streams import flush_all_streams

# A launched rank's process ends right after its group, with os._exit (see end_rank).
# destroy_process_group() shuts every backend down (NCCL communicators too), but the
# destroyed gloo group's destructor then takes about 20 ms to join its threads and close
# its sockets: a rank holds the group here instead, and the exit frees it.
_ENDED_GROUPS: list = []


def finish_group(clean: bool, process_ends: bool = False) -> None:
    """Destroy this process's group: after a barrier when ``clean`` (every rank got
    here), at once after a failure. ``process_ends``: the process exits right after."""
    if dist.is_available() and dist.is_initialized():
        if clean:
            dist.barrier()  # no rank tears down the store while another still needs it
        group = dist.group.WORLD
        dist.destroy_process_group()
        if process_ends:
            _ENDED_GROUPS.append(group)


def end_rank(code: int) -> None:
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

