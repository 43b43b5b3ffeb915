"""Lab 1, hangs: a collective that only some ranks call, turned into an error by the
group's timeout, and ``monitored_barrier``, which names the ranks that did not arrive.

With the bug, the ranks that stay away sleep :data:`BUSY_SECONDS`, far beyond every
timeout: the ranks that did call wait exactly the group's timeout and fail.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from ...runtime.ranks import rank

BUSY_SECONDS = 60  # how long a "busy" rank would stay away: far beyond every timeout


def lab_collective_on_one_rank(fixed: bool = False) -> float:
    """Rank 0 sums a tensor with everybody; with the bug, the others never call it
    (they are "busy": a branch that only rank 0 takes, e.g. ``if is_main(): log(...)``
    with a collective inside). Rank 0 waits until the group's timeout."""
    tensor = torch.ones(4)
    if fixed or rank() == 0:
        dist.all_reduce(tensor)
    else:
        time.sleep(BUSY_SECONDS)
    return tensor.sum().item()


def lab_monitored_barrier(fixed: bool = False, seconds: float = 2.0,
                          wait_all_ranks: bool = False) -> str:
    """``monitored_barrier`` names the ranks that did not arrive (gloo only; rank 0
    collects everyone's acknowledgement with its own timeout). With the bug every rank
    but 0 stays away; it names the first missing rank, or with ``wait_all_ranks`` all of
    them."""
    if not fixed and rank() != 0:
        time.sleep(BUSY_SECONDS)
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=seconds),
                           wait_all_ranks=wait_all_ranks)
    return "all ranks passed the barrier"
