"""Expert parallelism (chapter 13, sections 3 to 5): each rank holds some of an MoE
layer's experts; tokens travel to their experts' ranks and back by all-to-all, in pieces
of uneven sizes (dropless: every assignment is computed)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class AllToAll(torch.autograd.Function):
    """``AllToAll.apply(x, send_sizes, receive_sizes, group)``: ``send_sizes[i]`` rows of
    ``x`` to rank i, ``receive_sizes[i]`` rows from it; backward, the reverse exchange."""

    # rank r sends send_sizes[i] rows to rank i and receives receive_sizes[i] from it
    @staticmethod
    def forward(ctx, x, send_sizes, receive_sizes, group):
        ctx.sizes, ctx.group = (send_sizes, receive_sizes), group
        out = x.new_empty((sum(receive_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), receive_sizes, send_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_sizes, receive_sizes = ctx.sizes
        back = grad.new_empty((sum(send_sizes), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), send_sizes, receive_sizes,
                               group=ctx.group)
        return back, None, None, None


def expert_parallel_forward(layer, x, group):
    """The output of the MoE ``layer`` (made expert-parallel by :func:`expert_parallel_`)
    for this rank's tokens ``x``, every assignment computed on its expert's rank."""
    # layer: an MoE whose layer.experts are this rank's; layer.total the experts of all ranks
    ranks = dist.get_world_size(group)
    local = len(layer.experts)
    shape, x = x.shape, x.reshape(-1, x.shape[-1])
    weights, chosen = layer.route(x)
    order = chosen.flatten().argsort(stable=True)  # the assignments, sorted by expert
    token = order // layer.top_k
    counts = torch.bincount(chosen.flatten(), minlength=layer.total)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)  # [rank i's count per my expert]
    send_sizes = counts.view(ranks, local).sum(1).tolist()
    receive_sizes = received_counts.view(ranks, local).sum(1).tolist()
    layer.exchanged = send_sizes, receive_sizes  # for section 4
    arrived = AllToAll.apply(x[token], send_sizes, receive_sizes, group)
    # what arrived is grouped by source rank, then by expert: regroup it by expert
    expert_of = torch.arange(local, device=x.device).repeat(ranks) \
        .repeat_interleave(received_counts)
    by_expert = expert_of.argsort(stable=True)
    grouped, grouped_expert = arrived[by_expert], expert_of[by_expert]
    outputs = torch.empty_like(arrived)
    outputs[by_expert] = torch.cat([expert(grouped[grouped_expert == e])
                                    for e, expert in enumerate(layer.experts)])
    back = AllToAll.apply(outputs, receive_sizes, send_sizes, group)
    out = torch.zeros_like(x).index_add(
        0, token, back * weights.flatten()[order, None])
    return out.reshape(shape)


def expert_parallel_(layer, group):
    """Keep this rank's share of ``layer.experts`` (built alike on every rank of
    ``group``), and remember in ``layer.total`` how many there are in all."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    layer.total = len(layer.experts)
    if layer.total % ranks:
        raise ValueError(f"{layer.total} experts do not split over {ranks} ranks: give "
                         "every rank the same number")
    per_rank = layer.total // ranks
    layer.experts = layer.experts[rank * per_rank:(rank + 1) * per_rank]


class ExpertParallelMoE(nn.Module):
    """An MoE layer made expert-parallel over ``group``, as a module for a model's block."""

    def __init__(self, layer, group):
        super().__init__()
        expert_parallel_(layer, group)
        self.layer, self.group = layer, group

    def forward(self, x):
        return expert_parallel_forward(self.layer, x, self.group)
