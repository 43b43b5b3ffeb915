"""FSDP2 and tensor parallelism on 2 gloo ranks compute what DDP and the unsharded
layers compute (the groundwork for chapter 07)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mgpu_helpers import launch, rank, world_size

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def shard_of_data(steps=3, per_rank=8):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(steps, world_size() * per_rank, 8, generator=generator)
    y = torch.randint(0, 4, (steps, world_size() * per_rank), generator=generator)
    mine = slice(rank() * per_rank, (rank() + 1) * per_rank)
    return [(x[s, mine], y[s, mine]) for s in range(steps)]


def train(wrap):
    model = mlp()
    wrapped = wrap(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    for x, y in shard_of_data():
        optimizer.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        optimizer.step()
    return wrapped


def fsdp_against_ddp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (world_size(),))

    def shard(model):
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    sharded = train(shard)
    local = sum(p.to_local().numel() for p in sharded.parameters())
    full = [p.full_tensor() for p in sharded.parameters()]
    ddp = train(lambda model: DDP(model)).module
    return local, full, [p.detach() for p in ddp.parameters()]


def test_fsdp2_trains_like_ddp_and_holds_half_the_parameters_per_rank():
    ranks = launch(fsdp_against_ddp, nprocs=2, return_all=True, timeout=60, join_timeout=180)
    total = sum(p.numel() for p in mlp().parameters())
    for local, full, ddp in ranks:
        assert local <= total // 2 + 32  # dim-0 shards; odd sizes round up on rank 0
        for a, b in zip(full, ddp, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert sum(local for local, _, _ in ranks) == total


def tensor_parallel_against_unsharded():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world_size(),))
    reference, model = mlp(), mlp()
    parallelize_module(model, mesh, {"2": ColwiseParallel(), "4": RowwiseParallel()})
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    out, expected = model(x), reference(x)
    out.sum().backward()
    expected.sum().backward()
    local_rows = model[2].weight.to_local().shape[0]
    grads = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
             for p in model.parameters()]
    return out.detach(), expected.detach(), local_rows, grads, [
        p.grad for p in reference.parameters()]


def test_tensor_parallel_layers_compute_what_the_unsharded_layers_compute():
    ranks = launch(tensor_parallel_against_unsharded, nprocs=2, return_all=True, timeout=60,
                   join_timeout=180)
    for out, expected, local_rows, grads, expected_grads in ranks:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        assert local_rows == 16  # the column-parallel layer keeps half its output rows
        for grad, expected_grad in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)
