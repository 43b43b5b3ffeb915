"""Chapter 12: reference solutions and plausible mistakes."""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


def merge_partials(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), 0.0, lse)  # a row that saw no key at all
    return (out_a * torch.exp(lse_a - safe).unsqueeze(-1)
            + out_b * torch.exp(lse_b - safe).unsqueeze(-1)), lse


def merge_through_exp(out_a, lse_a, out_b, lse_b):
    a, b = torch.exp(lse_a), torch.exp(lse_b)  # overflows for large scores
    total = a + b
    return (out_a * (a / total).unsqueeze(-1) + out_b * (b / total).unsqueeze(-1)), total.log()


def merge_without_guard(out_a, lse_a, out_b, lse_b):
    lse = torch.maximum(lse_a, lse_b) + torch.log1p(torch.exp(-(lse_a - lse_b).abs()))
    return (out_a * torch.exp(lse_a - lse).unsqueeze(-1)
            + out_b * torch.exp(lse_b - lse).unsqueeze(-1)), lse


def merge_as_in_the_chapter(out_a, lse_a, out_b, lse_b):
    # the chapter's merge: right whenever a row has seen some key, NaN where it has seen none
    lse = torch.logaddexp(lse_a, lse_b)
    return (out_a * torch.exp(lse_a - lse).unsqueeze(-1)
            + out_b * torch.exp(lse_b - lse).unsqueeze(-1)), lse


def merge_by_averaging(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def _ring_step(tensor, group):
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(tensor)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % ranks), group),
        dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % ranks), group)])
    return works, received


def _window_block(q, k, v, q_start, k_start, window):
    q_pos = torch.arange(q_start, q_start + q.shape[-2])[:, None]
    k_pos = torch.arange(k_start, k_start + k.shape[-2])
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill((k_pos > q_pos) | (k_pos <= q_pos - window), float("-inf"))
    lse = scores.logsumexp(-1)
    weights = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return weights @ v, lse


def _window_ring(q, k, v, window, group, skip=True, width=None, passing=True):
    width = window if width is None else width
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    n = q.shape[-2]
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
    kv = torch.stack([k, v])
    for step in range(ranks if passing else 1):
        if passing and step < ranks - 1:
            works, incoming = _ring_step(kv, group)
        owner = (rank - step) % ranks
        reaches = owner * n + n - 1 >= rank * n - width + 1
        if owner <= rank and (reaches or not skip):
            block_out, block_lse = _window_block(q, kv[0], kv[1], rank * n, owner * n, width)
            new = torch.logaddexp(lse, block_lse)
            safe = torch.where(torch.isinf(new), 0.0, new)
            out = (out * torch.exp(lse - safe).unsqueeze(-1)
                   + block_out * torch.exp(block_lse - safe).unsqueeze(-1))
            lse = new
        if passing and step < ranks - 1:
            for work in works:
                work.wait()
            kv = incoming
    return out


def window_ring_attention(q, k, v, window, group):
    return _window_ring(q, k, v, window, group)


def window_ring_computing_every_earlier_block(q, k, v, window, group):
    return _window_ring(q, k, v, window, group, skip=False)


def window_ring_one_key_too_many(q, k, v, window, group):
    return _window_ring(q, k, v, window, group, width=window + 1)


def window_ring_without_passing(q, k, v, window, group):
    return _window_ring(q, k, v, window, group, passing=False)


def window_by_all_gather(q, k, v, window, group):
    ranks, n = dist.get_world_size(group), q.shape[-2]
    keys = [torch.empty_like(k) for _ in range(ranks)]
    values = [torch.empty_like(v) for _ in range(ranks)]
    dist.all_gather(keys, k.contiguous(), group=group)
    dist.all_gather(values, v.contiguous(), group=group)
    rank = dist.get_rank(group)
    q_pos = torch.arange(rank * n, rank * n + n)[:, None]
    k_pos = torch.arange(ranks * n)
    visible = (k_pos <= q_pos) & (k_pos > q_pos - window)
    return F.scaled_dot_product_attention(q, torch.cat(keys, -2), torch.cat(values, -2),
                                          attn_mask=visible)


REFERENCE = {"12.1": merge_partials, "12.2": window_ring_attention}
MISTAKES = {
    "12.1": [(merge_through_exp, "fail", "with scores in the hundreds"),
             (merge_without_guard, "fail", "saw no key in either set"),
             (merge_as_in_the_chapter, "fail", "saw no key in either set"),
             (merge_by_averaging, "fail", "each partial output weighs")],
    "12.2": [(window_ring_computing_every_earlier_block, "fail", "block pairs some window reaches"),
             (window_ring_one_key_too_many, "fail", "differs from one process's"),
             (window_ring_without_passing, "fail", "need its last keys and values"),
             (window_by_all_gather, "fail", "K and V must travel point to point")],
}
