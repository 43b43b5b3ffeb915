"""Chapter 13's MoE layer and expert parallelism (mgpu_helpers.parallel.expert), on cases
the chapter does not run: 3 ranks, experts that receive no token, a rank that sends
nothing, capacity at its edges, and the abort when a rank's counts disagree with its
data."""

from __future__ import annotations

import pytest
import torch

import mgpu_helpers as mh
from mgpu_helpers.launcher import LaunchError
from mgpu_helpers.parallel import expert as ep

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def test_capacity_keeps_the_first_assignments_and_counts_the_rest():
    torch.manual_seed(0)
    layer = ep.MoE(dim=8, hidden=16, experts=4, top_k=1, capacity_factor=0.25)
    x = torch.randn(32, 8)
    with torch.no_grad():
        out = layer(x)
    loads = layer.tokens_per_expert.tolist()  # capacity: ceil(0.25 * 32 / 4) = 2 each
    assert layer.dropped == sum(max(0, n - 2) for n in loads) > 0
    computed = (out.abs().sum(1) > 0).nonzero().flatten().tolist()
    assert len(computed) == sum(min(2, n) for n in loads)
    _, chosen = layer.route(x)
    for e in range(4):  # the kept ones are each expert's first tokens
        firsts = (chosen[:, 0] == e).nonzero().flatten()[:2].tolist()
        assert set(firsts) <= set(computed)


def test_the_balancing_loss_is_one_when_even_and_grows_as_the_load_concentrates():
    layer = ep.MoE(dim=4, hidden=8, experts=4, top_k=1)
    with torch.no_grad():
        layer.router.weight.zero_()  # every probability 1/4
        layer.route(torch.randn(16, 4))
    # top-1 of equal scores picks expert 0 every time: f = (1, 0, 0, 0), P = 1/4 each
    assert layer.aux_loss.item() == pytest.approx(1.0)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4) * 10)
        layer.route(torch.eye(4).repeat(4, 1))  # each expert gets its own tokens: even
    assert layer.aux_loss.item() == pytest.approx(1.0, abs=1e-3)
    with torch.no_grad():
        layer.route(torch.eye(4)[[0] * 16])  # everything to expert 0, with high probability
    assert layer.aux_loss.item() > 3.9


def _ep_against_one_process(tokens_per_rank, experts):
    import torch.distributed as dist

    rank, ranks = mh.rank(), mh.world_size()
    torch.manual_seed(3)
    reference = ep.MoE(8, 16, experts=experts, top_k=2)
    torch.manual_seed(3)
    layer = ep.MoE(8, 16, experts=experts, top_k=2)
    ep.expert_parallel_(layer, dist.group.WORLD)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(sum(tokens_per_rank), 8, generator=generator, requires_grad=True)
    reference(x).pow(2).sum().backward()
    start = sum(tokens_per_rank[:rank])
    mine = slice(start, start + tokens_per_rank[rank])
    x_r = x.detach()[mine].clone().requires_grad_()
    out = ep.expert_parallel_forward(layer, x_r, dist.group.WORLD)
    out.pow(2).sum().backward()
    errors = [0.0]
    if len(x_r):  # a rank with no token of its own has no output to compare
        errors.append((out.detach() - reference(x.detach())[mine]).abs().max().item())
        errors.append((x_r.grad - x.grad[mine]).abs().max().item())
    per_rank = experts // ranks
    for e, expert in enumerate(layer.experts):
        for p, q in zip(expert.parameters(), reference.experts[rank * per_rank + e].parameters(),
                        strict=True):
            errors.append((p.grad - q.grad).abs().max().item() if q.grad is not None
                          else (0.0 if p.grad is None else p.grad.abs().max().item()))
    return max(errors)


@pytest.mark.parametrize("tokens_per_rank", [[5, 7, 4], [6, 0, 3]])
def test_three_ranks_with_uneven_tokens_match_one_process(tokens_per_rank):
    # 12 experts for ~30 assignments: some experts receive nothing; [6, 0, 3]: a rank
    # with no token of its own still serves its experts
    errors = mh.launch(_ep_against_one_process, tokens_per_rank, 12, nprocs=3,
                       backend="gloo", return_all=True)
    assert max(errors) < 1e-5, errors


def test_experts_that_do_not_split_are_refused():
    layer = ep.MoE(4, 8, experts=5, top_k=1)

    def refused():
        import torch.distributed as dist

        try:
            ep.expert_parallel_(layer, dist.group.WORLD)
        except ValueError as error:
            return str(error)

    message = mh.launch(refused, nprocs=2, backend="gloo")
    assert message == ("5 experts do not split over 2 ranks: give every rank the same number")


def _counts_that_lie():
    import torch.distributed as dist

    ranks = mh.world_size()
    x = torch.ones(ranks * 2, 4)
    announced = [2] * ranks
    if mh.rank() == 0:
        announced[1] -= 1  # rank 1 is told to expect one row less than rank 0 sends
    expected = torch.empty(ranks, dtype=torch.int64)
    dist.all_to_all_single(expected, torch.tensor(announced))
    out = x.new_empty((int(expected.sum()), 4))
    dist.all_to_all_single(out, x, expected.tolist(), [2] * ranks)


def test_counts_that_disagree_with_the_data_abort_the_ranks_under_gloo(capfd):
    with pytest.raises(LaunchError, match="SIGABRT"):
        mh.launch(_counts_that_lie, nprocs=2, backend="gloo", timeout=20)
    assert "Received data size doesn't match expected size" in capfd.readouterr().err
