"""Sequence parallelism by hand (chapter 11, section 2): between the blocks' split
regions each rank holds s/t of the tokens; g's all-reduce becomes a reduce-scatter over
the tokens, f an all-gather."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .by_hand import TensorParallel, tensor_parallel_

all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # older name
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gather_tokens(x, group):
    """``(b, s/t, h)`` on each rank -> ``(b, s, h)``, the ranks' pieces in order."""
    pieces = x.movedim(1, 0).contiguous()  # collectives cut along dimension 0
    whole = pieces.new_empty((dist.get_world_size(group) * pieces.shape[0], *pieces.shape[1:]))
    all_gather(whole, pieces, group=group)
    return whole.movedim(0, 1).contiguous()


def scatter_tokens(x, group):
    """``(b, s, h)`` partial sums -> this rank's ``(b, s/t, h)`` of the sum."""
    whole = x.movedim(1, 0).contiguous()
    mine = whole.new_empty((whole.shape[0] // dist.get_world_size(group), *whole.shape[1:]))
    reduce_scatter(mine, whole, group=group)
    return mine.movedim(0, 1).contiguous()


class GatherTokens(torch.autograd.Function):
    """SP's f: gather the tokens forward, reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        return scatter_tokens(grad, ctx.group), None


class ScatterTokens(torch.autograd.Function):
    """SP's g: reduce-scatter the partial outputs forward, gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return scatter_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_tokens(grad, ctx.group), None


class SequenceParallelRegion(TensorParallel):
    """SP's f, then the module on this rank's slices, then SP's g."""

    def forward(self, x):
        return ScatterTokens.apply(self.module(GatherTokens.apply(x, self.group)), self.group)


def sequence_parallel_(block, group):
    """Split a GPT block over ``group`` with TP + SP (in place)."""
    tensor_parallel_(block, group)
    block.attention = SequenceParallelRegion(block.attention.module, group)
    block.mlp = SequenceParallelRegion(block.mlp.module, group)


def sum_unsplit_gradients_(model, group):
    """Add the ranks' parts of the gradients of the weights that are not split."""
    # a weight that is not split (a layer norm's) sees s/t tokens on each rank, so its
    # gradient there is the part from those tokens: add the ranks' parts
    for parameter in model.parameters():
        if not getattr(parameter, "split_over_tp", False):
            dist.all_reduce(parameter.grad, group=group)
