"""The schedules: one training step of a rank's stage modules, GPipe's way (all forward
passes, then all backward passes) or 1F1B's (interleaved where a rank holds several
virtual stages), and the order in which 1F1B runs a rank's passes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .p2p import (
    message_tag,
    post_header_receive,
    post_receives,
    read_header,
    recv_header,
    require_cpu,
    send,
    send_header,
)
from .split import split_batch
from .timeline import Timeline, check_counts


def _mean_loss(losses: Sequence[torch.Tensor], ranks: int) -> float:
    """The batch's mean loss on every rank: the last rank's micro-batch losses (each
    already divided by M) summed, and broadcast from it; the other ranks pass none."""
    loss = torch.tensor(sum(x.item() for x in losses), dtype=torch.float64)
    dist.broadcast(loss, src=ranks - 1)
    return loss.item()


def gpipe_step(stage_module: nn.Module, micro_batches: int,
               inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None,
               loss_fn: Callable = F.cross_entropy, timeline: Timeline | None = None,
               overlap: bool = True) -> float:
    """One GPipe training step of this rank's ``stage_module``; gradients land in its
    parameters (call the optimizer afterwards). Returns the batch's mean loss on every
    rank.

    Rank 0 holds the model's first piece and needs ``inputs``; the last rank holds the
    last piece and needs ``targets``; the ranks in between need neither. The loss of
    each micro-batch is divided by the number of micro-batches, so the gradients are
    those of the mean loss over the whole batch, as without pipelining.

    With ``overlap`` (the default) sends are non-blocking, so a rank goes on computing
    while its output travels, and receives are posted ahead. Without it every transfer
    blocks both sides until it is done: what a pipeline loses when communication does
    not overlap with computation. CPU stage modules only (gloo; see
    :func:`~mgpu_helpers.parallel.pipeline.p2p.require_cpu`).
    """
    require_cpu([stage_module], "gpipe_step")
    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    input_chunks, target_chunks = split_batch(inputs, targets, micro_batches, rank, world)
    timeline = timeline or Timeline(rank)
    sends, stage_inputs, stage_outputs = [], [], []

    if not first:  # all micro-batches have the shape the previous rank announces
        shape, dtype = recv_header(rank - 1)
        arriving = post_receives([shape] * micro_batches, dtype, rank - 1) if overlap else None
    for m in range(micro_batches):  # forward: every micro-batch through this stage module
        if first:
            x = input_chunks[m]
        elif overlap:
            x, work = arriving[m]
            work.wait()
            x.requires_grad_()
        else:
            x = torch.empty(shape, dtype=dtype)
            dist.recv(x, rank - 1)
            x.requires_grad_()
        with timeline.record("forward", m):
            y = stage_module(x)
            if last:
                y = loss_fn(y, target_chunks[m]) / micro_batches
        if not last:
            if m == 0:
                send_header(y, rank + 1)
            sends.append(send(y, rank + 1, overlap))
        stage_inputs.append(x)
        stage_outputs.append(y)

    if not last and overlap:  # gradients come back in reverse order, shaped like outputs
        returning = post_receives([y.shape for y in reversed(stage_outputs)],
                                  stage_outputs[0].dtype, rank + 1)
    for i, m in enumerate(reversed(range(micro_batches))):  # backward, last first
        grad = None
        if not last and overlap:
            grad, work = returning[i]
            work.wait()
        elif not last:
            grad = torch.empty_like(stage_outputs[m])
            dist.recv(grad, rank + 1)
        with timeline.record("backward", m):
            stage_outputs[m].backward(grad)
        if not first:
            sends.append(send(stage_inputs[m].grad, rank - 1, overlap))

    for _, work in sends:
        if work is not None:
            work.wait()
    return _mean_loss(stage_outputs if last else [], world)


# --------------------------------------------------- 1F1B, interleaved or not


def interleaved_order(rank: int, ranks: int, virtual_stages: int,
                      micro_batches: int) -> list[tuple[str, int, int]]:
    """The order in which ``rank`` of ``ranks`` runs its passes in 1F1B with
    ``virtual_stages`` model pieces per rank (Narayanan et al., 2021, as Megatron-LM
    orders them): a list of ``(kind, chunk, micro_batch)``, ``chunk`` being the index of
    the rank's piece (piece ``chunk * ranks + rank`` of the model).

    Warm-up: forward passes only, enough to fill the pipeline (the last rank starts its
    backward passes soonest); then one forward, one backward; then the remaining
    backward passes. Forward passes go through micro-batches in groups of ``ranks``:
    micro-batches 0..K-1 through the rank's first piece, the same through its second
    piece, then the next K micro-batches. With one piece per rank this is plain 1F1B.
    """
    check_counts(ranks, micro_batches, virtual_stages)
    if not isinstance(rank, int) or not 0 <= rank < ranks:
        raise ValueError(f"rank {rank!r} is not one of the {ranks} ranks 0..{ranks - 1}")
    if virtual_stages > 1 and micro_batches % ranks:
        raise ValueError(f"interleaving runs micro-batches in groups of the {ranks} ranks: "
                         f"{micro_batches} micro-batches is not a multiple of {ranks}; use "
                         f"{ranks * max(1, micro_batches // ranks)} or "
                         f"{ranks * (micro_batches // ranks + 1)}")
    group, total = ranks * virtual_stages, micro_batches * virtual_stages

    def action(kind: str, k: int) -> tuple[str, int, int]:
        chunk = k % group // ranks
        if kind == "backward":  # backward passes start from the rank's last piece
            chunk = virtual_stages - 1 - chunk
        return kind, chunk, k // group * ranks + k % ranks

    if virtual_stages == 1:
        warmup = ranks - rank - 1
    else:
        warmup = (ranks - rank - 1) * 2 + (virtual_stages - 1) * ranks
    warmup = min(warmup, total)
    order = [action("forward", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [action("forward", warmup + k), action("backward", k)]
    order += [action("backward", k) for k in range(total - warmup, total)]
    return order


def interleaved_1f1b_step(stage_modules: Sequence[nn.Module], micro_batches: int,
                          inputs: torch.Tensor | None = None,
                          targets: torch.Tensor | None = None,
                          loss_fn: Callable = F.cross_entropy,
                          timeline: Timeline | None = None) -> float:
    """One 1F1B training step of this rank's stage modules, ``stage_modules[c]`` being
    piece ``c * K + rank`` of a model cut into ``v * K`` pieces (K ranks, v =
    ``len(stage_modules)`` virtual stages per rank): rank 0 holds the first piece, rank
    K - 1 the last. With v = 1 this is plain 1F1B. Gradients land in the parameters;
    returns the batch's mean loss on every rank.

    Rank 0 needs ``inputs``, rank K - 1 ``targets``. Every transfer is non-blocking and
    every receive is posted ahead, so a rank waits only for data it needs now; the
    ``timeline`` records the computation of each piece (``virtual_stage``), not the waits.
    Messages between two ranks are told apart by tag
    (:func:`~mgpu_helpers.parallel.pipeline.p2p.message_tag`: the activation's shape,
    the activations and their gradients, for each cut). CPU stage modules only (gloo;
    see :func:`~mgpu_helpers.parallel.pipeline.p2p.require_cpu`).
    """
    require_cpu(stage_modules, "interleaved_1f1b_step")
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = len(stage_modules)
    if chunks > 1 and world < 2:
        raise ValueError("interleaving needs at least 2 ranks: a single rank runs its "
                         "pieces one after the other, use one piece (or gpipe_step)")
    order = interleaved_order(rank, world, chunks, micro_batches)
    pieces = chunks * world
    input_chunks, target_chunks = split_batch(inputs, targets, micro_batches, rank, world)
    timeline = timeline or Timeline(rank)
    after, before = (rank + 1) % world, (rank - 1) % world

    def piece(chunk: int) -> int:
        return chunk * world + rank

    headers = {chunk: post_header_receive(before, message_tag(piece(chunk) - 1, "header"))
               for chunk in range(chunks) if piece(chunk) > 0}  # the shapes to receive
    arriving: dict[int, list] = {}   # chunk -> (buffer, work) per micro-batch: activations
    returning: dict[int, list] = {}  # chunk -> the same for the gradients coming back
    held: dict[tuple[int, int], tuple] = {}  # (chunk, m) -> (input, output) until backward
    sends, losses = [], []

    for kind, chunk, m in order:
        p = piece(chunk)
        if kind == "forward":
            if p == 0:
                x = input_chunks[m]
            else:
                if chunk not in arriving:  # the first activation: learn its shape
                    buffer, work = headers[chunk]
                    work.wait()
                    shape, dtype = read_header(buffer)
                    arriving[chunk] = post_receives([shape] * micro_batches, dtype, before,
                                                    tag=message_tag(p - 1, "activation"))
                x, work = arriving[chunk][m]
                work.wait()
                x.requires_grad_()
            with timeline.record("forward", m, virtual_stage=p):
                y = stage_modules[chunk](x)
                if p == pieces - 1:
                    y = loss_fn(y, target_chunks[m]) / micro_batches
            if p == pieces - 1:
                losses.append(y.detach())
            else:
                if m == 0:
                    sends.append(send_header(y, after, True, tag=message_tag(p, "header")))
                    returning[chunk] = post_receives([y.shape] * micro_batches, y.dtype,
                                                     after, tag=message_tag(p, "gradient"))
                sends.append(send(y, after, True, tag=message_tag(p, "activation")))
            held[chunk, m] = (x, y)
        else:
            x, y = held.pop((chunk, m))
            grad = None
            if p < pieces - 1:
                grad, work = returning[chunk][m]
                work.wait()
            with timeline.record("backward", m, virtual_stage=p):
                y.backward(grad)
            if p > 0:
                sends.append(send(x.grad, before, True, tag=message_tag(p - 1, "gradient")))

    for _, work in sends:
        work.wait()
    return _mean_loss(losses, world)
