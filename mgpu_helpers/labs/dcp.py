"""Chapter 07's distributed checkpoint: saved by 4 FSDP2 ranks, loaded by 2.

:func:`fsdp_run` trains a small MLP sharded with FSDP2 over all ranks, on a global batch
that does not depend on the number of ranks, and can save a distributed checkpoint
(``torch.distributed.checkpoint``: every rank writes its own shards, plus metadata) or
start from one. Loading reshards: the checkpoint's layout need not match the loading
ranks'.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..ranks import rank, world_size

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


def fsdp_run(first_step: int, last_step: int, load_from: str | None = None,
             save_to: str | None = None, save_after: int | None = None,
             in_background: bool = False) -> dict:
    """Inside a rank: optionally load a distributed checkpoint, then train steps
    ``first_step`` to ``last_step - 1`` (this rank's share of each global batch),
    saving a checkpoint to ``save_to`` after step ``save_after - 1``. Returns the full
    weights and Adam moments at the end (gathered), the full weights right after the
    load, and the shape of the first weight as this rank stores it.

    With ``in_background`` the checkpoint is written by ``dcp.async_save``: the state is
    copied first, then written by a background thread while training goes on; the
    write is waited for at the end."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loaded, pending = None, None
    # the background save's own gloo group (as torchtitan makes one), also on GPUs: a
    # "cpu:gloo,cuda:nccl" default group would share its gloo part with training's
    save_group = dist.new_group(backend="gloo") if in_background else None
    if load_from is not None:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=load_from)  # each rank reads the pieces it needs
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        loaded = [_full(p).detach().clone() for p in model.parameters()]
    for step in range(first_step, last_step):
        images, labels = (t.chunk(world_size())[rank()] for t in _global_batch(step))
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        if step + 1 == save_after:  # every rank writes its own shards, in parallel
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
            if in_background:  # returns once the state is copied; the writing goes on
                # its collectives run in a background thread: a group of their own,
                # or they interleave with training's on the default group and hang
                pending = dcp.async_save(state, checkpoint_id=save_to,
                                         process_group=save_group)
            else:
                dcp.save(state, checkpoint_id=save_to)
    if pending is not None:
        pending.result()  # the files are complete only now
    moments = [_full(optimizer.state[p][key]) for p in model.parameters()
               for key in ("exp_avg", "exp_avg_sq")]
    dist.barrier()
    return {"weights": [_full(p).detach() for p in model.parameters()], "moments": moments,
            "loaded": loaded, "stored_shape": tuple(model[0].weight.to_local().shape)}
