"""Chapter 07's 2-D device mesh: FSDP across one dimension, tensor parallelism across
the other, on 4 ranks.

The ranks form a 2 x 2 grid, ``ParallelDims(fsdp=2, tp=2)``. Along ``"tp"`` (the ranks
of one row), a feed-forward block's two linear layers are split column- and row-wise, as
in chapter 07's tensor parallelism; along ``"fsdp"`` (the ranks of one column), the
resulting shards are sharded again by FSDP2, and each row trains on its own half of the
batch. On a real cluster the ``"tp"`` dimension lies inside a node (NVLink) and
``"fsdp"`` across nodes.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..topology import ParallelDims

WIDTH = 16


def _block() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.ReLU(), nn.Linear(4 * WIDTH, WIDTH))


def _global_batch(step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return (torch.randn(size, WIDTH, generator=generator),
            torch.randn(size, WIDTH, generator=generator))


def fsdp_and_tp(steps: int = 2, lr: float = 0.1) -> dict:
    """Inside one of 4 ranks: the block trained ``steps`` SGD steps on a (fsdp=2, tp=2)
    mesh, and the unsplit block trained on the whole batch in this process. Returns this
    rank's mesh coordinates, each parameter's placements and local shape, and the
    largest difference between the full 2-D-sharded weights and the unsplit ones."""
    with warnings.catch_warnings():
        # FSDP2 warns that the block returns a view, which an in-place op would detach
        # from its backward hook; nothing here changes the output in place
        warnings.filterwarnings("ignore", message=".*returned a view tensor")
        return _train_and_compare(steps, lr)


def _train_and_compare(steps: int, lr: float) -> dict:
    mesh = ParallelDims(fsdp=2, tp=2).build_mesh("cpu")
    model, reference = _block(), _block()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["fsdp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    row = mesh["fsdp"].get_local_rank()
    for step in range(steps):
        inputs, targets = _global_batch(step)
        mine = slice(row * len(inputs) // 2, (row + 1) * len(inputs) // 2)
        optimizer.zero_grad()
        F.mse_loss(model(inputs[mine]), targets[mine]).backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        F.mse_loss(reference(inputs), targets).backward()
        reference_optimizer.step()
    parameters = dict(model.named_parameters())
    # gathering a weight split along one dimension twice takes 2 all-gathers, which
    # DTensor logs as suboptimal: true, and irrelevant for a check
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        difference = max((p.full_tensor() - r).abs().max().item()
                          for p, r in zip(parameters.values(), reference.parameters(),
                                          strict=True))
    finally:
        redistribute_log.setLevel(level)
    return {
        "coordinates": (row, mesh["tp"].get_local_rank()),
        "placements": {name: str(p.placements) for name, p in parameters.items()},
        "local_shapes": {name: tuple(p.to_local().shape) for name, p in parameters.items()},
        "difference": difference,
    }
