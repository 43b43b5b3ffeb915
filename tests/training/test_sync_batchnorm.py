"""CpuSyncBatchNorm: batch statistics over all ranks' samples, on CPU ranks (gloo)."""

import pytest
import torch
from torch import nn

from mgpu_helpers import launch, rank
from mgpu_helpers.training.sync_batchnorm import CpuSyncBatchNorm, convert_sync_batchnorm

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def global_batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    # Channels with different means and scales, so a per-rank mean is visibly wrong.
    return torch.randn(8, 3, 4, 4, generator=generator) * torch.tensor([1.0, 3.0, 0.5]).view(
        1, 3, 1, 1) + torch.arange(8.0).view(8, 1, 1, 1)


def batchnorm_step(layer_type):
    """Forward and backward on this rank's half of the global batch."""
    torch.manual_seed(0)
    layer = layer_type(3)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
    half = global_batch().chunk(2)[rank()].clone().requires_grad_()
    output = layer(half)
    weights = torch.linspace(-1, 1, 8 * 3 * 16).view(8, 3, 4, 4).chunk(2)[rank()]
    (output * weights).sum().backward()
    return {"output": output.detach(), "input_grad": half.grad, "running_mean":
            layer.running_mean, "running_var": layer.running_var,
            "weight_grad": layer.weight.grad, "bias_grad": layer.bias.grad}


def reference():
    torch.manual_seed(0)
    layer = nn.BatchNorm2d(3)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
    batch = global_batch().requires_grad_()
    output = layer(batch)
    (output * torch.linspace(-1, 1, 8 * 3 * 16).view(8, 3, 4, 4)).sum().backward()
    return {"output": output.detach(), "input_grad": batch.grad, "running_mean":
            layer.running_mean, "running_var": layer.running_var,
            "weight_grad": layer.weight.grad, "bias_grad": layer.bias.grad}


def test_synced_batchnorm_on_two_ranks_equals_batchnorm_on_the_global_batch():
    expected = reference()
    ranks = launch(batchnorm_step, CpuSyncBatchNorm, nprocs=2, return_all=True)
    for key in ("output", "input_grad"):
        torch.testing.assert_close(torch.cat([r[key] for r in ranks]), expected[key])
    for r in ranks:  # every rank holds the global statistics
        torch.testing.assert_close(r["running_mean"], expected["running_mean"])
        torch.testing.assert_close(r["running_var"], expected["running_var"])
    for key in ("weight_grad", "bias_grad"):  # DDP would sum these local shares
        torch.testing.assert_close(ranks[0][key] + ranks[1][key], expected[key])


def test_plain_batchnorm_on_two_ranks_does_not():
    expected = reference()
    ranks = launch(batchnorm_step, nn.BatchNorm2d, nprocs=2, return_all=True)
    assert not torch.allclose(torch.cat([r["output"] for r in ranks]), expected["output"],
                              atol=1e-3)
    assert not torch.allclose(ranks[0]["running_mean"], ranks[1]["running_mean"])


def test_outside_a_process_group_it_is_plain_batchnorm():
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(3)
    synced = convert_sync_batchnorm(nn.Sequential(plain))[0]
    batch = global_batch()
    torch.testing.assert_close(synced(batch), nn.BatchNorm2d(3)(batch))
    synced.eval()
    torch.testing.assert_close(synced(batch), nn.functional.batch_norm(
        batch, synced.running_mean, synced.running_var, synced.weight, synced.bias))


def test_convert_replaces_nested_batchnorms_and_keeps_their_state():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, momentum=0.3),
                          nn.Sequential(nn.Flatten(), nn.BatchNorm1d(4 * 2 * 2)))
    model[1].running_mean.fill_(2.0)
    model.eval()
    converted = convert_sync_batchnorm(model)
    assert isinstance(converted[1], CpuSyncBatchNorm)
    assert isinstance(converted[2][1], CpuSyncBatchNorm)
    assert converted[1].momentum == 0.3 and not converted[1].training
    assert torch.equal(converted[1].running_mean, torch.full((4,), 2.0))
    assert converted(torch.randn(2, 3, 2, 2)).shape == (2, 16)


def test_one_dimensional_input_is_rejected_with_the_expected_shape():
    with pytest.raises(ValueError, match=r"at least 2D input \(N, C, ...\)"):
        CpuSyncBatchNorm(3)(torch.randn(3))
