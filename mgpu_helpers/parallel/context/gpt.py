"""The workbook's GPT (:mod:`mgpu_helpers.models.gpt`) under context parallelism
(chapter 12, sections 6 and 7): each block's attention done by the ring, each rank
holding its zig-zag share of every sequence."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...data.recall import IGNORE
from .ring import RingAttention, positions_of


class RingSelfAttention(nn.Module):
    """A GPT block's attention with its projections, the heads' attention done by the
    ring over ``group``."""

    def __init__(self, attention, group):
        super().__init__()
        self.q, self.k, self.v, self.o = attention.q, attention.k, attention.v, attention.o
        self.head_dim, self.group = attention.head_dim, group

    def forward(self, x):
        batch, length, _ = x.shape
        q, k, v = (projection(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
                   for projection in (self.q, self.k, self.v))
        y = RingAttention.apply(q, k, v, self.group, True)
        return self.o(y.transpose(1, 2).reshape(batch, length, -1))


def context_parallel_(model, group):
    """Every block of ``model`` attends by the ring over ``group`` (in place)."""
    for block in model.blocks:
        block.attention = RingSelfAttention(block.attention, group)


def my_tokens(inputs, targets, group):
    """This rank's zig-zag share of a batch: ``(inputs, targets, positions)``."""
    # pad to a multiple of 2c, then this rank's zig-zag positions
    ranks = dist.get_world_size(group)
    pad = -inputs.shape[1] % (2 * ranks)
    inputs = F.pad(inputs, (0, pad))
    targets = F.pad(targets, (0, pad), value=IGNORE)
    mine = positions_of(dist.get_rank(group), ranks, inputs.shape[1], True)
    return inputs[:, mine], targets[:, mine], mine


def cp_loss(model, inputs, targets, group, context):
    """This rank's part of the batch's mean loss: its answers' losses summed, divided by
    the whole batch's number of answers."""
    ids, answers, mine = my_tokens(inputs, targets, group)
    logits = model(ids, positions=mine.clamp(max=context - 1))  # padding: any position
    scored = torch.tensor(float((answers != IGNORE).sum()), device=logits.device)
    dist.all_reduce(scored, group=group)  # the whole batch's answers
    return F.cross_entropy(logits.flatten(0, 1), answers.flatten(), ignore_index=IGNORE,
                           reduction="sum") / scored
