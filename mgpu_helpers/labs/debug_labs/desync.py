"""Lab 2, desynchronised collectives: every rank calls them, but with different shapes or
in a different order. gloo aborts, or the ranks wait until the group's timeout;
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (:func:`.failures.distributed_debug`) checks each
collective across the ranks first and names the mismatch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...runtime.ranks import rank


def lab_mismatched_shapes(fixed: bool = False) -> list:
    """Every rank calls the collective, but with a different shape (e.g. the last
    partial batch of a rank). gloo aborts the process; with TORCH_DISTRIBUTED_DEBUG=
    DETAIL each collective is first checked across ranks and the mismatch is named."""
    tensor = torch.ones(4 if fixed else 4 + rank())
    dist.all_reduce(tensor)
    return tensor.tolist()


def lab_mismatched_order(fixed: bool = False) -> list:
    """Every rank calls the same two collectives, in a different order."""
    summed, shared = torch.ones(3), torch.full((3,), float(rank()))
    if fixed or rank() == 0:
        dist.all_reduce(summed)
        dist.broadcast(shared, src=0)
    else:
        dist.broadcast(shared, src=0)
        dist.all_reduce(summed)
    return summed.tolist() + shared.tolist()
