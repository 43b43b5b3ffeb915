"""mgpu_helpers/labs/comm_log.py: the collectives a rank runs, seen however they are
reached, and the ring's bytes for each (chapter 11's meter)."""

import pytest

import mgpu_helpers as mh
from mgpu_helpers.labs.comm_log import ring_bytes_sent

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _logged_in_a_rank():
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from mgpu_helpers.labs.comm_log import CollectivesLogged

    all_reduce = dist.all_reduce  # an alias is still seen
    x = torch.ones(8)
    mesh = init_device_mesh("cpu", (2,))
    logits = distribute_tensor(torch.randn(6, 8), mesh, [Shard(1)]).requires_grad_()
    with CollectivesLogged() as plain:
        all_reduce(x)
        dist.all_gather_single(torch.empty(16), x)
        dist.reduce_scatter_single(torch.empty(4), x)
        if dist.get_rank() == 0:
            dist.send(x, 1)
        else:
            dist.recv(x, 0)
    with CollectivesLogged() as through_dtensor:
        distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
        with loss_parallel():  # its all-reduces run inside DTensor's operators
            F.cross_entropy(logits, torch.arange(6)).backward()
    outside = CollectivesLogged()
    all_reduce(x)  # not inside the block: not seen
    return plain.calls, through_dtensor.kinds(), outside.calls


def test_every_collective_is_seen_with_the_bytes_this_rank_puts_in():
    ranks = mh.launch(_logged_in_a_rank, nprocs=2, backend="gloo", return_all=True)
    for rank, (plain, through_dtensor, outside) in enumerate(ranks):
        p2p = ("send", 32) if rank == 0 else ("recv", 32)
        assert plain == [("all_reduce", 32), ("all_gather", 32), ("reduce_scatter", 32), p2p]
        # distribute_tensor scatters, redistribute all-gathers; the loss all-reduces the
        # maximum, the sum of exponentials and the target's score
        assert through_dtensor[:2] == ["scatter", "all_gather"]
        assert through_dtensor.count("all_reduce") == 3
        assert outside == []


@pytest.mark.parametrize("kind,world,expected", [
    ("all_reduce", 4, 2 * 3 / 4 * 1000), ("all_reduce", 1, 0.0),
    ("all_gather", 4, 3 * 1000), ("reduce_scatter", 4, 3 / 4 * 1000),
    ("send", 4, 1000), ("recv", 4, 0),
])
def test_ring_bytes_are_chapter_03s_volumes(kind, world, expected):
    assert ring_bytes_sent(kind, 1000, world) == pytest.approx(expected)


def test_ring_bytes_refuse_what_has_no_ring_formula():
    with pytest.raises(ValueError, match="no ring formula for 'broadcast'"):
        ring_bytes_sent("broadcast", 10, 2)
    with pytest.raises(ValueError, match="at least one rank, got world=0"):
        ring_bytes_sent("all_reduce", 10, 0)
