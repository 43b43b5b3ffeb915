"""Lab 5, randomness per rank (the model): replicas initialised from rank-dependent seeds.

:func:`replicas_agree` checks, inside a rank, that every rank holds exactly the same
parameters. :func:`lab_rank_dependent_init` trains replicas that start apart (no DDP
broadcast to hide it); :func:`lab_fsdp_rank_dependent_init` shows the same habit under
FSDP2, which stitches one model from the different ranks' initialisations.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ...runtime.ranks import rank, world_size


def replicas_agree(model: nn.Module) -> bool:
    """Inside a rank: do all ranks hold exactly the same parameters? Every rank returns
    the same answer.

    Every byte of every parameter is compared with rank 0's (one broadcast), so weights
    that are permuted, or differ in ways that cancel in a sum, are caught too; a checksum
    (the sum of all weights) would miss both.
    """
    as_bytes = [p.detach().contiguous().reshape(-1).view(torch.uint8)
                for p in model.parameters()]
    device = as_bytes[0].device if as_bytes else torch.device("cpu")
    mine = torch.cat(as_bytes) if as_bytes else torch.zeros(0, dtype=torch.uint8, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size())]
    dist.all_gather(sizes, torch.tensor([mine.numel()], device=device))
    if any(size.item() != mine.numel() for size in sizes):
        return False  # every rank sees the same sizes, so all of them return here
    reference = mine.clone()
    dist.broadcast(reference, src=0)
    agree = torch.tensor([int(torch.equal(reference, mine))], device=device)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    return bool(agree.item())


def lab_rank_dependent_init(fixed: bool = False) -> bool:
    """Each rank seeds from its rank (a common "make workers differ" habit) and trains
    without DDP's initial broadcast (hand-written all-reduce, or parameters added after
    wrapping). The fix: broadcast rank 0's weights (or seed identically)."""
    torch.manual_seed(1234 + rank())
    model = nn.Linear(8, 2)
    if fixed:
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)
    return replicas_agree(model)


def lab_fsdp_rank_dependent_init(fixed: bool = False) -> dict:
    """The same habit under FSDP2: ``fully_shard`` keeps each rank's own shard of the
    weights that rank initialised, and broadcasts nothing. With rank-dependent seeds the
    model is stitched from different ranks' initialisations. The fix: one seed for the
    model on every rank (for models too big to build whole, build on the ``meta`` device,
    shard, then ``to_empty`` and ``reset_parameters()`` under that seed, or load rank 0's
    weights with ``set_model_state_dict(..., broadcast_from_rank0=True)``)."""
    torch.manual_seed(1234 if fixed else 1234 + rank())
    model = nn.Linear(8, 4)
    built = model.weight.detach().clone()  # what this rank initialised
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size(),)))
    return {"built": built, "sharded": model.weight.full_tensor()}
