"""Chapter 03's ring all-reduce and all-reduce cost model (mgpu_helpers.labs.collectives)."""

import pytest
import torch
import torch.distributed as dist

from mgpu_helpers import launch
from mgpu_helpers.labs import collectives
from mgpu_helpers.measure.traffic import sends_counted


def ring_against_torch(length):
    torch.manual_seed(dist.get_rank())
    x = torch.randint(-1000, 1000, (length,)).float()  # integers: exact sums in any order
    ours = x.clone()
    with sends_counted() as sent:
        collectives.ring_all_reduce(ours)
    reference = x.clone()
    dist.all_reduce(reference)
    return torch.equal(ours, reference), sent


@pytest.mark.usefixtures("no_leftover_processes")
@pytest.mark.parametrize("world, length", [(2, 11), (3, 11), (4, 7)])
def test_ring_all_reduce_equals_dist_all_reduce_with_its_message_count(world, length):
    results = launch(ring_against_torch, length, nprocs=world, backend="gloo",
                     return_all=True)
    assert all(equal for equal, _ in results)
    assert [len(sent) for _, sent in results] == [2 * (world - 1)] * world
    assert [{peer for peer, _ in sent} for _, sent in results] == [
        {(rank + 1) % world} for rank in range(world)]
    assert sum(b for _, sent in results for _, b in sent) == 2 * (world - 1) * length * 4


def every_kind_of_send():
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = (rank + 1) % world
    incoming = torch.empty(3)
    with sends_counted() as sent:
        request = dist.isend(torch.ones(3), peer)                  # 12 B
        dist.recv(incoming, (rank - 1) % world)
        request.wait()
        ops = [dist.P2POp(dist.isend, torch.ones(5), peer),        # 20 B
               dist.P2POp(dist.irecv, torch.empty(5), (rank - 1) % world)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        dist.all_reduce(torch.ones(7))                             # a collective: not counted
    return sent, dist.ProcessGroup.send.__name__                   # restored on exit


@pytest.mark.usefixtures("no_leftover_processes")
def test_sends_counted_sees_isend_and_batched_sends_and_is_undone():
    results = launch(every_kind_of_send, nprocs=2, backend="gloo", return_all=True)
    for rank, (sent, method) in enumerate(results):
        assert sent == [(1 - rank, 12), (1 - rank, 20)]
        assert method == "send"  # the original method again, not the counting wrapper


def test_each_collective_has_the_ring_s_steps_and_volume():
    assert collectives.steps_and_volume(1000, 4, "all_gather") == (3, 750.0)
    assert collectives.steps_and_volume(1000, 4, "reduce_scatter") == (3, 750.0)
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        collectives.steps_and_volume(1000, 4, "broadcast")
    # nccl-tests: busbw = algbw * 2(N-1)/N for an all-reduce, (N-1)/N for the halves
    assert collectives.bus_bandwidth(8e6, 1e-3, 4) == pytest.approx((8e9, 12e9))
    assert collectives.bus_bandwidth(8e6, 1e-3, 4, "all_gather") == pytest.approx((8e9, 6e9))


def timed_on_a_rank(name):
    return collectives.collective_seconds(name, [64, 4096], repeats=2)


@pytest.mark.usefixtures("no_leftover_processes")
@pytest.mark.parametrize("name", sorted(collectives.PHASES))
def test_collective_seconds_times_each_collective_and_size(name):
    timed = launch(timed_on_a_rank, name, nprocs=2, backend="gloo")
    assert sorted(timed) == ["fastest", "median"]
    assert all(len(values) == 2 for values in timed.values())
    assert all(0 < fast <= median for fast, median in zip(timed["fastest"], timed["median"],
                                                           strict=True))


def test_steps_and_volume_of_a_ring():
    assert collectives.steps_and_volume(1000, 4) == (6, 1500.0)
    assert collectives.steps_and_volume(1000, 2) == (2, 1000.0)
    with pytest.raises(ValueError, match="at least 2 ranks, got 1"):
        collectives.steps_and_volume(1000, 1)


@pytest.mark.parametrize("name", sorted(collectives.PHASES))
def test_fit_recovers_the_model_that_made_the_times(name):
    alpha, bandwidth = 2e-4, 3e9
    times = [collectives.predict(n, alpha, bandwidth, 4, name) for n in collectives.SIZES]
    fitted = collectives.fit(collectives.SIZES, times, 4, name)
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
