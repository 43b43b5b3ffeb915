"""Chapter 12's context parallelism (mgpu_helpers.parallel.context), on cases the chapter
does not run: 3 ranks (an odd ring), other sizes, both splits, the all-gather design, the
zig-zag positions for 1 to 5 ranks, and the refusal of a sequence that does not cut
evenly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mgpu_helpers as mh
from mgpu_helpers.parallel import context as cp

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("zigzag", [False, True])
def test_the_splits_cover_every_position_once(ranks, zigzag):
    length = 2 * ranks * 3
    held = [cp.positions_of(rank, ranks, length, zigzag).tolist()
            for rank in range(ranks)]
    assert sorted(p for positions in held for p in positions) == list(range(length))
    for positions in held:  # two runs of consecutive positions, in order within each
        assert positions[:3] == list(range(positions[0], positions[0] + 3))
        assert positions[3:] == list(range(positions[3], positions[3] + 3))


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
def test_zigzag_gives_every_rank_the_same_causal_work(ranks):
    length = 2 * ranks * 4
    work = [sum(int(p) + 1 for p in cp.positions_of(rank, ranks, length, True))
            for rank in range(ranks)]  # a query at p attends to p + 1 keys
    assert len(set(work)) == 1
    in_order = [sum(int(p) + 1 for p in cp.positions_of(rank, ranks, length, False))
                for rank in range(ranks)]
    assert in_order == sorted(in_order) and in_order[0] < in_order[-1]


def test_a_sequence_that_does_not_cut_evenly_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="does not cut into 6 equal chunks for 3 ranks: pad "
                                         "it to a multiple of 6"):
        cp.positions_of(0, 3, 16, True)


def _against_one_process(zigzag: bool, design: str, length: int, head_dim: int):
    import torch.distributed as dist

    rank, ranks = mh.rank(), mh.world_size()
    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(3, 2, length, head_dim, generator=generator, requires_grad=True)
               for _ in range(3))
    d_out = torch.randn(3, 2, length, head_dim, generator=generator)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (expected * d_out).sum().backward()
    mine = cp.positions_of(rank, ranks, length, zigzag)
    q_r, k_r, v_r = (x.detach()[..., mine, :].clone().requires_grad_() for x in (q, k, v))
    if design == "ring":
        out = cp.RingAttention.apply(q_r, k_r, v_r, dist.group.WORLD, zigzag)
    else:
        out = cp.all_gather_attention(q_r, k_r, v_r, dist.group.WORLD, zigzag)
    (out * d_out[..., mine, :]).sum().backward()
    pairs = [(out.detach(), expected.detach()), (q_r.grad, q.grad), (k_r.grad, k.grad),
             (v_r.grad, v.grad)]
    return max(((got - right[..., mine, :]).abs().max() / right.abs().max()).item()
               for got, right in pairs)


@pytest.mark.parametrize(("design", "zigzag"), [("ring", False), ("ring", True),
                                                ("all-gather", True)])
def test_three_ranks_match_one_process_forward_and_backward(design, zigzag):
    errors = mh.launch(_against_one_process, zigzag, design, 18, 4, nprocs=3, backend="gloo",
                       return_all=True)
    assert max(errors) < 1e-5, errors


def test_one_rank_is_plain_causal_attention():
    errors = mh.launch(_against_one_process, True, "ring", 8, 6, nprocs=1, backend="gloo")
    assert errors < 1e-5


def _ring_bytes():
    # this rank's share of chapter 12's sizes: batch 2, 3 heads of 8, 32 tokens over the ring
    import torch.distributed as dist

    from mgpu_helpers.labs.comm_log import CollectivesLogged, ring_bytes_sent

    generator = torch.Generator().manual_seed(mh.rank())
    q, k, v = (torch.randn(2, 3, 32 // mh.world_size(), 8, generator=generator,
                           requires_grad=True) for _ in range(3))
    with CollectivesLogged() as forward:
        out = cp.RingAttention.apply(q, k, v, dist.group.WORLD, True)
    with CollectivesLogged() as backward:
        out.sum().backward()
    sent = [sum(ring_bytes_sent(kind, size, mh.world_size()) for kind, size in log.calls)
            for log in (forward, backward)]
    return sent, k.numel() * 4


def test_the_planner_prices_the_chapters_ring_as_the_chapter_counts_it():
    # chapter 12's ring on 4 ranks: batch 2, 3 heads of 8, 32 tokens, float32; its
    # collectives counted at the dispatcher (comm_log), forward and backward
    from mgpu_helpers.planning import costs, planner

    (forward, backward), block = mh.launch(_ring_bytes, nprocs=4, backend="gloo")
    model = planner.Model("ring", layers=1, dim=24, heads=3, ffn=8, vocab=8)
    plan = planner.Plan(cp=4, micro_batch=2, zero=0)
    predicted = planner.predict(model, planner.H100_NODES, plan, 32, costs.FLOAT32)
    assert block == 2 * 3 * 8 * 8 * 4  # one rank's K: 8 of the 32 tokens
    assert predicted.communication["cp"].bytes_sent == forward + backward

