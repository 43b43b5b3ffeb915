"""Chapter 11's tensor parallelism (mgpu_helpers.parallel.tensor), on cases the chapter
does not run: 3 ranks (an odd TP degree) for the vocabulary-parallel loss and
embedding, and the plans against the GPT block they name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mgpu_helpers as mh
from mgpu_helpers.data.recall import IGNORE
from mgpu_helpers.models.gpt import GPT, GPTConfig
from mgpu_helpers.parallel import tensor as tp

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _vocabulary_against_one_process(vocab=48, tokens=20, dim=6):
    import torch.distributed as dist

    rank, t, group = mh.rank(), mh.world_size(), dist.group.WORLD
    generator = torch.Generator().manual_seed(5)
    table = torch.randn(vocab, dim, generator=generator, requires_grad=True)
    logits = torch.randn(tokens, vocab, generator=generator, requires_grad=True)
    ids = torch.randint(vocab, (tokens,), generator=generator)
    targets = ids.clone()
    targets[::4] = IGNORE
    F.embedding(ids, table).pow(2).sum().backward()
    expected = F.cross_entropy(logits, targets, ignore_index=IGNORE)
    expected.backward()
    my_table = table.detach().chunk(t, 0)[rank].clone().requires_grad_()
    my_logits = logits.detach().chunk(t, -1)[rank].clone().requires_grad_()
    rows = tp.vocab_parallel_embedding(ids, my_table, group)
    rows.pow(2).sum().backward()
    loss = tp.vocab_parallel_cross_entropy(my_logits, targets, group)
    loss.backward()
    return {"rows": (rows - F.embedding(ids, table)).abs().max().item(),
            "table gradient": (my_table.grad - table.grad.chunk(t, 0)[rank]).abs().max().item(),
            "loss": abs(loss.item() - expected.item()),
            "logits gradient": (my_logits.grad
                                - logits.grad.chunk(t, -1)[rank]).abs().max().item()}


def test_the_vocabulary_parallel_loss_and_embedding_on_3_ranks_equal_one_process():
    for result in mh.launch(_vocabulary_against_one_process, nprocs=3, backend="gloo",
                            return_all=True):
        assert max(result.values()) < 1e-6, result


def _refusal_on_3_ranks():
    import torch.distributed as dist

    try:  # 4 heads on 3 ranks
        tp.tensor_parallel_(GPT(GPTConfig(vocab_size=8, context=4, dim=8, layers=1,
                                          heads=4)).blocks[0], dist.group.WORLD)
    except ValueError as refusal:
        return str(refusal)
    return None


def test_heads_that_do_not_split_over_the_ranks_are_refused_with_the_fix():
    refusals = mh.launch(_refusal_on_3_ranks, nprocs=3, backend="gloo", return_all=True)
    assert all(r and "4 attention heads do not split over 3 ranks" in r and
               "choose a TP degree that divides the heads" in r for r in refusals), refusals


def test_the_plans_name_the_gpt_blocks_own_modules():
    block = GPT(GPTConfig(vocab_size=8, context=4, dim=8, layers=1, heads=2)).blocks[0]
    names = {name for name, _ in block.named_modules()}
    with_sp, tp_alone = tp.block_plan(), tp.block_plan(sequence_parallel=False)
    assert set(with_sp) <= names and set(tp_alone) <= names
    # TP alone splits the same linear layers; SP adds the norms and the regions' inputs
    assert set(tp_alone) < set(with_sp)
    assert set(with_sp) - set(tp_alone) == {"attention_norm", "attention", "mlp_norm", "mlp"}
    assert tp.block_plan() is not tp.block_plan()  # a fresh plan each call
