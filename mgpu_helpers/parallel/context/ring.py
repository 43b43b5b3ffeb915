"""Ring attention (chapter 12, sections 2 to 4): causal attention over a sequence cut
into 2c chunks, two per rank, K and V passed around a ring of c ranks while each rank
attends its queries to the blocks it holds and merges the results (online softmax).

Shapes: ``q``, ``k``, ``v`` are ``(..., n, d)``, this rank's two chunks side by side."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def attend(q, k, v, q_start, k_start):
    """Causal attention of queries at positions ``q_start..`` to keys at ``k_start..``:
    ``(output, log-sum-exp)``, or None when every key comes after every query."""
    # q: (..., n, d) at positions q_start..; k, v: (..., m, d) at k_start..; causal
    n, m = q.shape[-2], k.shape[-2]
    if k_start > q_start + n - 1:
        return None  # every key after every query: nothing to compute
    q_positions = torch.arange(q_start, q_start + n, device=q.device)
    k_positions = torch.arange(k_start, k_start + m, device=q.device)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(k_positions > q_positions[:, None], float("-inf"))
    lse = scores.logsumexp(-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def merge(out, lse, block_out, block_lse):
    """Two partial attentions (each normalised over its own keys) as one over both."""
    new_lse = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - new_lse).unsqueeze(-1)
            + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)), new_lse


def chunk_starts(rank, ranks, chunk, zigzag):
    """Where ``rank``'s two chunks of ``chunk`` tokens start."""
    # chunks 2r and 2r+1 in order, or r and 2c-1-r
    order = (rank, 2 * ranks - 1 - rank) if zigzag else (2 * rank, 2 * rank + 1)
    return [index * chunk for index in order]


def positions_of(rank, ranks, length, zigzag):
    """The positions ``rank`` holds of a sequence of ``length`` tokens."""
    if length % (2 * ranks):
        raise ValueError(f"a sequence of {length} tokens does not cut into {2 * ranks} equal "
                         f"chunks for {ranks} ranks: pad it to a multiple of {2 * ranks}")
    chunk = length // (2 * ranks)
    return torch.cat([torch.arange(start, start + chunk)
                      for start in chunk_starts(rank, ranks, chunk, zigzag)])


def pass_along(tensor, group):
    """Send ``tensor`` to the next rank of ``group``, receive the previous rank's: started,
    not waited for. Returns ``(works, received)``."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(tensor)
    to_next = dist.get_global_rank(group, (rank + 1) % ranks)
    from_previous = dist.get_global_rank(group, (rank - 1) % ranks)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, to_next, group),
                                    dist.P2POp(dist.irecv, received, from_previous, group)])
    return works, received


class RingAttention(torch.autograd.Function):
    """``RingAttention.apply(q, k, v, group, zigzag)``: this rank's causal attention output
    over the whole sequence; backward passes K, V and their gradients around the ring."""

    @staticmethod
    def forward(ctx, q, k, v, group, zigzag):
        rank, ranks = dist.get_rank(group), dist.get_world_size(group)
        chunk = q.shape[-2] // 2
        mine = chunk_starts(rank, ranks, chunk, zigzag)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        kv = torch.stack([k, v])  # one message per step
        for step in range(ranks):
            if step < ranks - 1:
                works, incoming = pass_along(kv, group)  # overlaps the blocks below
            owner = (rank - step) % ranks
            for i, q_start in enumerate(mine):
                rows = slice(i * chunk, (i + 1) * chunk)
                for j, k_start in enumerate(chunk_starts(owner, ranks, chunk, zigzag)):
                    cols = slice(j * chunk, (j + 1) * chunk)
                    block = attend(q[..., rows, :], kv[0, ..., cols, :], kv[1, ..., cols, :],
                                   q_start, k_start)
                    if block is not None:
                        out[..., rows, :], lse[..., rows] = merge(
                            out[..., rows, :], lse[..., rows], *block)
            if step < ranks - 1:
                for work in works:
                    work.wait()
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.zigzag = group, zigzag
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        rank, ranks = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        chunk, scale = q.shape[-2] // 2, 1 / math.sqrt(q.shape[-1])
        mine = chunk_starts(rank, ranks, chunk, ctx.zigzag)
        d_q = torch.zeros_like(q)
        D = (d_out * out).sum(-1)
        # K, V and their gradients so far travel together, and are home after `ranks` steps
        travelling = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])
        for step in range(ranks):
            k_b, v_b, d_k, d_v = travelling
            owner = (rank - step) % ranks
            for i, q_start in enumerate(mine):
                rows = slice(i * chunk, (i + 1) * chunk)
                for j, k_start in enumerate(chunk_starts(owner, ranks, chunk, ctx.zigzag)):
                    cols = slice(j * chunk, (j + 1) * chunk)
                    if k_start > q_start + chunk - 1:
                        continue
                    scores = q[..., rows, :] @ k_b[..., cols, :].transpose(-2, -1) * scale
                    later = torch.arange(k_start, k_start + chunk, device=q.device) > \
                        torch.arange(q_start, q_start + chunk, device=q.device)[:, None]
                    P = torch.exp(scores.masked_fill(later, float("-inf"))
                                  - lse[..., rows].unsqueeze(-1))
                    d_v[..., cols, :] += P.transpose(-2, -1) @ d_out[..., rows, :]
                    d_S = P * (d_out[..., rows, :] @ v_b[..., cols, :].transpose(-2, -1)
                               - D[..., rows].unsqueeze(-1))
                    d_q[..., rows, :] += d_S @ k_b[..., cols, :] * scale
                    d_k[..., cols, :] += d_S.transpose(-2, -1) @ q[..., rows, :] * scale
            if ranks > 1:  # on to the next rank; after the last step, home
                works, travelling = pass_along(travelling, ctx.group)
                for work in works:
                    work.wait()
        return d_q, travelling[2], travelling[3], None, None
