"""Chapter 07's 2-D device mesh: FSDP across one dimension, tensor parallelism across
the other, on 4 ranks: the training and the comparison around the chapter's set-up.

The chapter builds a 2 x 2 mesh with dimensions ``("dp", "tp")``, splits a feed-forward
block (:func:`block`) column- and row-wise along ``"tp"`` (the ranks of one row) with
``parallelize_module``, and shards the pieces again along ``"dp"`` (the ranks of one
column) with ``fully_shard``. :func:`train_and_compare` trains it, each row on its own
half of the batch, next to the unsplit block trained on the whole batch, and reports
what each rank holds. On a real cluster ``"tp"`` lies inside a node (NVLink) and
``"dp"`` across nodes.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 16
DIMS = ("dp", "tp")


def block() -> nn.Sequential:
    """``Linear(16, 64) -> ReLU -> Linear(64, 16)``, the same weights at every call."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.ReLU(), nn.Linear(4 * WIDTH, WIDTH))


def _global_batch(step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return (torch.randn(size, WIDTH, generator=generator),
            torch.randn(size, WIDTH, generator=generator))


def train_and_compare(model: nn.Module, reference: nn.Module, mesh, steps: int = 2,
                      lr: float = 0.1) -> dict:
    """Inside one of the mesh's ranks: train ``model`` (split over ``mesh``, whose
    dimensions are ``("dp", "tp")``) for ``steps`` SGD steps, this row's half of each
    batch, and ``reference`` (unsplit) on the whole batch in this process. Returns this
    rank's mesh coordinates, each parameter's placements and local shape, and the
    largest difference between the full 2-D-sharded weights and the unsplit ones."""
    if tuple(mesh.mesh_dim_names or ()) != DIMS:
        raise ValueError(f"train_and_compare needs a mesh with dimensions {DIMS}, got "
                         f"{mesh.mesh_dim_names}: build it with init_device_mesh(..., "
                         f"mesh_dim_names={DIMS})")
    with warnings.catch_warnings():
        # FSDP2 warns that the block returns a view, which an in-place op would detach
        # from its backward hook; nothing here changes the output in place
        warnings.filterwarnings("ignore", message=".*returned a view tensor")
        return _train_and_compare(model, reference, mesh, steps, lr)


def _train_and_compare(model, reference, mesh, steps: int, lr: float) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    row, rows = mesh["dp"].get_local_rank(), mesh["dp"].size()
    for step in range(steps):
        inputs, targets = _global_batch(step)
        mine = slice(row * len(inputs) // rows, (row + 1) * len(inputs) // rows)
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
