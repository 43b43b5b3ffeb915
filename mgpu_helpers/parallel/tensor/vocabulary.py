"""Loss parallelism by hand (chapter 11, section 3): the embedding table and the head's
logits split over the vocabulary, the cross-entropy computed without gathering them."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F

from ...data.recall import IGNORE
from .by_hand import ReduceFromTP


def vocab_parallel_embedding(ids, weight, group):
    """The embedding of ``ids`` from a table whose rows (token ids) are split over the
    ranks of ``group``: each rank looks up its own ids, g adds the ranks' rows."""
    rows = weight.shape[0]
    first = dist.get_rank(group) * rows
    mine = (ids >= first) & (ids < first + rows)
    local = F.embedding((ids - first) * mine, weight) * mine.unsqueeze(-1)
    return ReduceFromTP.apply(local, group)


def vocab_parallel_cross_entropy(logits, targets, group, ignore_index=IGNORE):
    """The mean cross-entropy of the targets that are not ``ignore_index``, from logits
    split over the vocabulary: three all-reduces of one number per token."""
    # logits: (tokens, V/t), this rank's columns; targets: (tokens,) global token ids
    columns = logits.shape[-1]
    first = dist.get_rank(group) * columns
    largest = logits.detach().amax(-1)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - largest.unsqueeze(-1)
    total = ReduceFromTP.apply(shifted.exp().sum(-1), group)
    mine = (targets >= first) & (targets < first + columns)
    picked = shifted.gather(-1, ((targets - first) * mine).unsqueeze(-1)).squeeze(-1) * mine
    picked = ReduceFromTP.apply(picked, group)
    scored = targets != ignore_index
    return ((total.log() - picked) * scored).sum() / scored.sum()
