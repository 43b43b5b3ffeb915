"""Chapter 07's distributed checkpoint: the training around it, saved by 4 FSDP2 ranks,
loaded by 2.

The chapter writes the checkpoint calls (``get_state_dict``, ``dcp.async_save``,
``dcp.load``, ``set_state_dict``); this module holds the training they interrupt:
:func:`sharded_mlp` builds a small MLP sharded with FSDP2 over all ranks, with its Adam
optimizer; :func:`train_step` runs one step on this rank's share of a global batch that
does not depend on the number of ranks (so that 2 and 4 ranks train the same model);
:func:`summary` gathers what the chapter compares.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..runtime.ranks import rank, world_size

GLOBAL_BATCH = 32


def _model() -> nn.Sequential:
    torch.manual_seed(0)  # one initialisation for every rank (chapter 09's lesson)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return (torch.randn(GLOBAL_BATCH, 16, generator=generator),
            torch.randint(0, 4, (GLOBAL_BATCH,), generator=generator))


def _full(tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def sharded_mlp(lr: float = 1e-2) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Inside a rank: ``Linear(16, 64) -> ReLU -> Linear(64, 4)``, the same initial
    weights on every rank, sharded by ``fully_shard`` over all ranks (each linear layer,
    then the root), and ``torch.optim.Adam`` over its sharded parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Inside a rank: one Adam step on this rank's share of global batch ``step``."""
    images, labels = (t.chunk(world_size())[rank()] for t in _global_batch(step))
    optimizer.zero_grad()
    F.cross_entropy(model(images), labels).backward()
    optimizer.step()


def full_weights(model: nn.Module) -> list[torch.Tensor]:
    """Inside a rank: copies of the full weights (all-gathered from the shards)."""
    return [_full(p).detach().clone() for p in model.parameters()]


def summary(model: nn.Module, optimizer: torch.optim.Optimizer,
            loaded: list[torch.Tensor] | None = None) -> dict:
    """Inside a rank, at the end: the full weights (``"weights"``) and Adam moments
    (``"moments"``), ``loaded`` as given (the full weights right after a load), and the
    shape of the first weight as this rank stores it (``"stored_shape"``)."""
    moments = [_full(optimizer.state[p][key]) for p in model.parameters()
               for key in ("exp_avg", "exp_avg_sq")]
    dist.barrier()
    return {"weights": [_full(p).detach() for p in model.parameters()], "moments": moments,
            "loaded": loaded, "stored_shape": tuple(model[0].weight.to_local().shape)}
