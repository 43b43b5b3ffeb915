"""Chapter 07's ZeRO-3 from scratch (mgpu_helpers.labs.zero)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mgpu_helpers import launch
from mgpu_helpers.labs import zero

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_training_matches_ddp_with_1_over_n_storage_and_its_collectives(world):
    ranks = launch(zero.train_sharded_and_ddp, nprocs=world, backend="gloo", return_all=True)
    sharded, ddp = ranks[0]["ZeRO-3"], ranks[0]["DDP"]
    for other in ranks[1:]:  # every rank gathers the same full model
        assert all(torch.equal(a, b) for a, b in zip(sharded["weights"],
                                                     other["ZeRO-3"]["weights"], strict=True))
    assert max((a - b).abs().max().item()
               for a, b in zip(sharded["weights"], ddp["weights"], strict=True)) < 1e-6
    for kind in ("parameters", "gradients", "optimizer state"):
        per_rank = ddp["stored"][kind] / world
        assert per_rank <= sharded["stored"][kind] < per_rank + 4 * world * 2  # + padding
    psi = ddp["parameter count"]
    padded = sum(-(-n // world) * world for n in (32 * 64 + 64, 64 * 10 + 10))  # 2 layers
    assert ddp["collectives"] == {"all_reduce": {"calls": 1, "elements": 2 * psi}}
    # per layer two all-gathers and one reduce-scatter, which gloo runs as an all-reduce
    # of the whole (padded) flat gradient: the flight recorder lists it as one
    assert sharded["collectives"] == {"all_gather": {"calls": 4, "elements": 2 * padded},
                                      "all_reduce": {"calls": 2, "elements": 2 * padded}}


def sharded_layer_gradients():
    torch.manual_seed(0)
    reference = nn.Linear(5, 3)  # 18 parameters: padded to 20 over 4 ranks, 18 over 2
    layer = zero.ShardedLinear(reference)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(dist.get_rank()))
    x.requires_grad_(True)
    layer(x).square().sum().backward()
    expected_x = x.detach().clone().requires_grad_(True)
    reference(expected_x).square().sum().backward()
    return layer.shard.grad, x.grad, expected_x.grad, reference.weight.grad, reference.bias.grad


@pytest.mark.parametrize("world", [2, 4])
def test_a_sharded_layer_gets_its_shard_of_the_averaged_gradient(world):
    ranks = launch(sharded_layer_gradients, nprocs=world, backend="gloo", return_all=True)
    average = torch.cat([torch.stack([r[3] for r in ranks]).mean(0).flatten(),
                         torch.stack([r[4] for r in ranks]).mean(0)])
    shards = torch.cat([r[0] for r in ranks])[:average.numel()]
    torch.testing.assert_close(shards, average)
    for shard_grad, x_grad, expected_x_grad, *_ in ranks:
        torch.testing.assert_close(x_grad, expected_x_grad)  # the input gradient is local
        assert len(shard_grad) == -(-18 // world)
