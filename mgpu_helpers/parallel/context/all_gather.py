"""The all-gather design of context parallelism (chapter 12, section 5): every rank
gathers all ranks' K and V before attention; backward reduce-scatters their gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .ring import positions_of


class GatherKV(torch.autograd.Function):
    """``GatherKV.apply(x, group)``: every rank's ``x`` (K or V) in rank order along the
    sequence; backward, each rank's part of the gradients' sum."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, -2)

    @staticmethod
    def backward(ctx, grad):
        pieces = [piece.contiguous() for piece in grad.chunk(dist.get_world_size(ctx.group), -2)]
        mine = torch.empty_like(pieces[0])
        dist.reduce_scatter(mine, pieces, group=ctx.group)  # each piece contiguous, as gloo needs
        return mine, None


def all_gather_attention(q, k, v, group, zigzag=True):
    """This rank's causal attention output, K and V gathered from every rank of ``group``
    and masked by global positions."""
    ranks, length = dist.get_world_size(group), q.shape[-2] * dist.get_world_size(group)
    keys = torch.cat([positions_of(r, ranks, length, zigzag) for r in range(ranks)])
    queries = positions_of(dist.get_rank(group), ranks, length, zigzag)
    visible = (keys <= queries[:, None]).to(q.device)  # the causal mask, by positions
    return F.scaled_dot_product_attention(q, GatherKV.apply(k, group), GatherKV.apply(v, group),
                                          attn_mask=visible)
