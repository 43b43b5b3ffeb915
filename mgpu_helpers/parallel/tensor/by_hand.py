"""Tensor parallelism by hand (chapter 11, section 1): a GPT block's linear layers split
over the ranks of a group, column- then row-parallel, between Megatron-LM's f and g."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class CopyToTP(torch.autograd.Function):
    """f: the identity forward, an all-reduce of the gradient backward."""

    # "f": every rank uses the same input, so its gradient is the sum of every rank's
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g: an all-reduce forward, the identity backward."""

    # "g": every rank holds a partial output; the sum is the output, the same on each rank
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def keep_slice_(linear, dim, group):
    """Keep this rank's 1/t of ``linear``'s weight along ``dim`` (in place)."""
    # dim 0 = output features (column-parallel), dim 1 = input features (row-parallel)
    piece = linear.weight.detach().chunk(dist.get_world_size(group), dim)
    linear.weight = nn.Parameter(piece[dist.get_rank(group)].clone())
    linear.weight.split_over_tp = True  # a mark for section 2


class TensorParallel(nn.Module):
    """f, then ``module`` on this rank's slices, then g."""

    def __init__(self, module, group):
        super().__init__()
        self.module, self.group = module, group

    def forward(self, x):
        return ReduceFromTP.apply(self.module(CopyToTP.apply(x, self.group)), self.group)


def tensor_parallel_(block, group):
    """Split a GPT block (:class:`mgpu_helpers.models.gpt.Block`) over ``group``, whole
    attention heads on each rank (in place)."""
    t = dist.get_world_size(group)
    heads = block.attention.q.out_features // block.attention.head_dim
    if heads % t:
        raise ValueError(f"{heads} attention heads do not split over {t} ranks: each rank "
                         "must hold whole heads; choose a TP degree that divides the heads")
    for linear in (block.attention.q, block.attention.k, block.attention.v, block.mlp.up):
        keep_slice_(linear, 0, group)
    for linear in (block.attention.o, block.mlp.down):
        keep_slice_(linear, 1, group)
    block.attention = TensorParallel(block.attention, group)
    block.mlp = TensorParallel(block.mlp, group)
