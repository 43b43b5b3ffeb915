"""Chapter 03's ring all-reduce and all-reduce cost model (mgpu_helpers.labs.collectives)."""

import pytest
import torch
import torch.distributed as dist

from mgpu_helpers import launch
from mgpu_helpers.labs import collectives


def ring_against_torch(length):
    torch.manual_seed(dist.get_rank())
    x = torch.randint(-1000, 1000, (length,)).float()  # integers: exact sums in any order
    ours = x.clone()
    sent = collectives.ring_all_reduce(ours)
    reference = x.clone()
    dist.all_reduce(reference)
    return torch.equal(ours, reference), sent


@pytest.mark.usefixtures("no_leftover_processes")
@pytest.mark.parametrize("world, length", [(2, 11), (3, 11), (4, 7)])
def test_ring_all_reduce_equals_dist_all_reduce_with_its_message_count(world, length):
    results = launch(ring_against_torch, length, nprocs=world, backend="gloo",
                     return_all=True)
    assert all(equal for equal, _ in results)
    assert [sent["messages"] for _, sent in results] == [2 * (world - 1)] * world
    assert sum(sent["bytes"] for _, sent in results) == 2 * (world - 1) * length * 4


def test_steps_and_volume_of_a_ring():
    assert collectives.steps_and_volume(1000, 4) == (6, 1500.0)
    assert collectives.steps_and_volume(1000, 2) == (2, 1000.0)
    with pytest.raises(ValueError, match="at least 2 ranks, got 1"):
        collectives.steps_and_volume(1000, 1)


def test_fit_recovers_the_model_that_made_the_times():
    alpha, bandwidth = 2e-4, 3e9
    times = [collectives.predict(n, alpha, bandwidth, 4) for n in collectives.SIZES]
    fitted = collectives.fit(collectives.SIZES, times, 4)
    assert fitted == pytest.approx((alpha, bandwidth), rel=1e-6)


def test_fit_tolerates_noise_and_weighs_every_size_alike():
    alpha, bandwidth = 5e-4, 1.3e9
    generator = torch.Generator().manual_seed(0)
    noise = 1 + 0.05 * (2 * torch.rand(len(collectives.SIZES), generator=generator) - 1)
    times = [collectives.predict(n, alpha, bandwidth, 2) * float(e)
             for n, e in zip(collectives.SIZES, noise, strict=True)]
    fitted_alpha, fitted_bandwidth = collectives.fit(collectives.SIZES, times, 2)
    # +-5% on every time: both numbers within 10% (an absolute fit would lose alpha)
    assert fitted_alpha == pytest.approx(alpha, rel=0.1)
    assert fitted_bandwidth == pytest.approx(bandwidth, rel=0.1)


def test_fit_refuses_times_that_do_not_fit_and_bad_input():
    with pytest.raises(ValueError, match="do not fit the model"):
        collectives.fit([64, 1024, 65536], [3e-3, 2e-3, 1e-3], 2)  # faster when bigger
    with pytest.raises(ValueError, match="at least 2 sizes"):
        collectives.fit([64], [1e-3], 2)
    with pytest.raises(ValueError, match="at least 2 sizes"):
        collectives.fit([64, 128], [1e-3], 2)
