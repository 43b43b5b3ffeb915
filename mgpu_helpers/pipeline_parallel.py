"""Pipeline parallelism from send/recv: a model cut into stages, one stage per rank,
micro-batches flowing through them (GPipe), with a recorded timeline.

Chapter 06 builds its understanding on these pieces:

* :func:`split_sequential` cuts an ``nn.Sequential`` into stages;
* :func:`layer_costs` and :func:`balanced_cuts` measure each layer (parameters, FLOPs,
  activation size, time) and choose the cuts that balance the stages;
* :func:`gpipe_step` runs one training step of the stage this rank holds: all forward
  passes of the micro-batches, then all backward passes (GPipe's schedule), activations
  sent to the next rank and gradients to the previous one with non-blocking sends;
* :func:`interleaved_1f1b_step` runs one training step of 1F1B, interleaved when a rank
  holds several *virtual* stages (Narayanan et al., 2021); :func:`interleaved_order` is
  the order in which each rank runs its forward and backward passes;
* :class:`Timeline` records when each stage computed what, for a Gantt chart and the
  measured idle share (:func:`bubble_fraction`), compared with the theory
  (:func:`theoretical_bubble`: (K-1)/(v·M+K-1) of the step, which is GPipe's
  (K-1)/(M+K-1) for v = 1; :func:`bubble_to_compute` gives the paper's form, the bubble
  over the ideal compute time, (K-1)/(v·M)).

With one micro-batch, :func:`gpipe_step` is the naive split: every stage waits for the
previous one, and K-1 of K ranks are idle at any time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .memory import ActivationMeter  # noqa: F401  (moved; re-exported)

MAX_DIMS = 6
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ------------------------------------------------------------------ splitting


def split_sequential(model: nn.Sequential, cuts: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``model`` before each index in ``cuts``: ``cuts=[3]`` gives ``model[:3]`` and
    ``model[3:]``. The stages share the model's layers (no copies)."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"split_sequential needs an nn.Sequential, got {type(model).__name__}")
    cuts = list(cuts)
    for cut in cuts:
        if not isinstance(cut, int) or not 1 <= cut <= len(model) - 1:
            raise ValueError(f"split point {cut!r} is out of range: a model of {len(model)} "
                             f"layers can be cut before layer 1 to {len(model) - 1}")
    if cuts != sorted(set(cuts)):
        raise ValueError(f"split points must be increasing and distinct, got {cuts}")
    bounds = [0, *cuts, len(model)]
    return [model[start:end] for start, end in zip(bounds, bounds[1:], strict=False)]


def micro_batch_size(batch_size: int, micro_batches: int) -> int:
    """The size of each micro-batch; the count must divide the batch."""
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro-batch count must be a whole number >= 1, got {micro_batches!r}")
    if batch_size % micro_batches:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise ValueError(f"{micro_batches} micro-batches do not divide the batch of "
                         f"{batch_size} samples: use one of {divisors}")
    return batch_size // micro_batches


# ------------------------------------------------------- costs and split points


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs, for one batch: the numbers that decide a split point."""

    index: int
    name: str
    parameters: int
    flops: int             # forward FLOPs (multiply and add counted separately)
    activation_bytes: int  # the layer's output: what a cut after it must send
    seconds: float         # measured forward + backward time (median)


def layer_costs(model: nn.Sequential, example: torch.Tensor, repeats: int = 5) -> list[LayerCost]:
    """Measure every layer of ``model`` on ``example`` (one batch)."""
    costs, x = [], example
    for index, layer in enumerate(model):
        x = x.detach().requires_grad_(x.is_floating_point())
        with FlopCounterMode(display=False) as counter:
            y = layer(x)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            out = layer(x)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            times.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        costs.append(LayerCost(index, type(layer).__name__,
                               sum(p.numel() for p in layer.parameters()),
                               int(counter.get_total_flops()),
                               y.numel() * y.element_size(), sorted(times[1:])[repeats // 2]))
        x = y
    return costs


def balanced_cuts(weights: Sequence[float], stages: int) -> list[int]:
    """Split points that minimise the heaviest stage (the pipeline's pace), for
    per-layer ``weights`` (seconds, FLOPs...). Exact, by dynamic programming."""
    n = len(weights)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the heaviest stage when the first i layers form k stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                heaviest = max(best[k - 1][j], prefix[i] - prefix[j])
                if heaviest <= best[k][i]:  # ties: the later cut (a layer keeps its ReLU)
                    best[k][i], choice[k][i] = heaviest, j
    cuts, i = [], n
    for k in range(stages, 1, -1):
        i = choice[k][i]
        cuts.append(i)
    return sorted(cuts)


# --------------------------------------------------------------------- timeline


@dataclass(frozen=True)
class Event:
    stage: int         # the rank (device) that computed: one row of the Gantt chart
    kind: str          # "forward" or "backward"
    micro_batch: int
    start: float       # seconds, time.perf_counter (one clock for all processes of a host)
    end: float
    virtual_stage: int | None = None  # the model piece, where a rank holds several


class Timeline:
    """Records a stage's compute intervals. Idle time is what lies between them: the
    pipeline steps record only the computation, never the wait for a message."""

    def __init__(self, stage: int):
        self.stage = stage
        self.events: list[Event] = []

    @contextmanager
    def record(self, kind: str, micro_batch: int, virtual_stage: int | None = None):
        start = time.perf_counter()
        yield
        self.events.append(Event(self.stage, kind, micro_batch, start, time.perf_counter(),
                                 virtual_stage))


def bubble_fraction(events: Sequence[Event]) -> float:
    """Measured idle share of the pipeline: 1 - busy time / (ranks x span), where span
    runs from the first start to the last end over all ranks (the rows of the chart,
    ``Event.stage``; a rank's virtual stages share its row)."""
    if not events:
        raise ValueError("no events recorded")
    stages = {e.stage for e in events}
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1 - busy / (len(stages) * span)


def instant_transfers(events: Sequence[Event]) -> list[Event]:
    """The same timeline as if every message arrived the moment it was sent: each rank
    runs the same passes in the same order, each taking as long as it took, and starts
    each as soon as the rank is free and the pass's input is ready (a forward pass needs
    the previous piece's forward of that micro-batch, a backward pass the next piece's
    backward). The difference in :func:`bubble_fraction` is what transfers cost."""
    if not events:
        raise ValueError("no events recorded")

    def piece(event: Event) -> int:
        return event.stage if event.virtual_stage is None else event.virtual_stage

    last = max(piece(e) for e in events)
    origin = min(e.start for e in events)
    queues = {rank: sorted((e for e in events if e.stage == rank), key=lambda e: e.start)
              for rank in sorted({e.stage for e in events})}
    free = dict.fromkeys(queues, origin)
    done: dict[tuple[str, int, int], float] = {}
    replayed: list[Event] = []
    progress = True
    while progress:
        progress = False
        for rank, queue in queues.items():
            while queue:
                event = queue[0]
                if event.kind == "forward":
                    needs = ("forward", piece(event) - 1, event.micro_batch)
                    needed = piece(event) > 0
                else:
                    needs = ("backward", piece(event) + 1, event.micro_batch)
                    needed = piece(event) < last
                if needed and needs not in done:
                    break
                start = max(free[rank], done[needs] if needed else origin)
                end = start + event.end - event.start
                replayed.append(Event(event.stage, event.kind, event.micro_batch, start, end,
                                      event.virtual_stage))
                done[event.kind, piece(event), event.micro_batch] = free[rank] = end
                queue.pop(0)
                progress = True
    if any(queues.values()):
        stuck = {rank: (queue[0].kind, piece(queue[0]), queue[0].micro_batch)
                 for rank, queue in queues.items() if queue}
        raise ValueError(f"these events are not a pipeline step: ranks wait for passes "
                         f"that never run first ({stuck}); pass all ranks' events of one step")
    return replayed


def _check_counts(stages: int, micro_batches: int, virtual_stages: int) -> None:
    for name, value in (("stages", stages), ("micro_batches", micro_batches),
                        ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def theoretical_bubble(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle share of the step with equal stages and free communication: (K-1)/(v·M+K-1)
    for K ranks holding v virtual stages each and M micro-batches, whatever the ratio of
    backward to forward time. For v = 1 (GPipe, 1F1B) it is (K-1)/(M+K-1)."""
    _check_counts(stages, micro_batches, virtual_stages)
    return (stages - 1) / (virtual_stages * micro_batches + stages - 1)


def bubble_to_compute(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The same bubble as Narayanan et al. (2021) state it: idle time over the ideal
    compute time (not over the whole step), (K-1)/(v·M). A measured idle share b
    converts to this form as b / (1 - b)."""
    _check_counts(stages, micro_batches, virtual_stages)
    return (stages - 1) / (virtual_stages * micro_batches)


def ideal_speedup(stages: int, micro_batches: int) -> float:
    """Speed-up of M micro-batches over the naive split (M = 1): K*M/(M+K-1)."""
    return stages * micro_batches / (micro_batches + stages - 1)


def plot_timeline(events: Sequence[Event], ax=None, title: str | None = None):
    """Gantt chart: one row per rank, forward and backward boxes labelled by
    micro-batch; gaps are the bubble. Where ranks hold several virtual stages, each
    virtual stage gets its own shade (darker: earlier in the model)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.7 * len({e.stage for e in events}) + 1.2))
    origin = min(e.start for e in events)
    pieces = sorted({e.virtual_stage for e in events if e.virtual_stage is not None})
    if pieces:
        shades = [0.9 - 0.5 * i / max(1, len(pieces) - 1) for i in range(len(pieces))]
        maps = {"forward": plt.get_cmap("Blues"), "backward": plt.get_cmap("Oranges")}
        colours = {(kind, piece): maps[kind](shade) for kind in maps
                   for piece, shade in zip(pieces, shades, strict=True)}
        handles = [Patch(color=colours[kind, piece], label=f"{kind[0].upper()} stage {piece}")
                   for kind in maps for piece in pieces]
    else:
        colours = {"forward": "#2a7ab0", "backward": "#e3863b"}
        handles = [Patch(color=colour, label=kind) for kind, colour in colours.items()]
    for e in events:
        start, width = (e.start - origin) * 1e3, (e.end - e.start) * 1e3
        colour = colours[e.kind, e.virtual_stage] if pieces else colours[e.kind]
        ax.broken_barh([(start, width)], (e.stage - 0.4, 0.8), color=colour,
                       edgecolor="white")
        dark = not pieces or shades[pieces.index(e.virtual_stage)] > 0.6
        ax.text(start + width / 2, e.stage, str(e.micro_batch), ha="center", va="center",
                color="white" if dark else "black", fontsize=7)
    stages = sorted({e.stage for e in events})
    ax.set_yticks(stages, [f"{'rank' if pieces else 'stage'} {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=7,
              ncols=2 if pieces else 1, frameon=False)
    ax.set_title(title or f"bubble {bubble_fraction(events):.0%} of the time")
    return ax


# --------------------------------------------------------------- communication


def _header(tensor: torch.Tensor) -> torch.Tensor:
    """The shape and dtype of ``tensor``, as a small tensor the next stage can receive."""
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"can send at most {MAX_DIMS}-dimensional tensors")
    header = torch.zeros(MAX_DIMS + 2, dtype=torch.int64)
    header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
    header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
    return header


def _read_header(header: torch.Tensor) -> tuple[list[int], torch.dtype]:
    dims = int(header[0])
    return header[2:2 + dims].tolist(), _DTYPES[int(header[1])]


def _send_header(tensor: torch.Tensor, dst: int) -> None:
    """Tell the next stage the shape and dtype of every micro-batch's activation."""
    dist.send(_header(tensor), dst)


def _recv_header(src: int) -> tuple[list[int], torch.dtype]:
    header = torch.zeros(MAX_DIMS + 2, dtype=torch.int64)
    dist.recv(header, src)
    return _read_header(header)


def _send(tensor: torch.Tensor, dst: int, overlap: bool, tag: int = 0) -> tuple:
    """Send ``tensor``: non-blocking with ``overlap`` (the buffer and its work, to be
    waited on later), else blocking until the receiver has it (the buffer, None)."""
    data = tensor.detach().contiguous()
    if overlap:
        return data, dist.isend(data, dst, tag=tag)
    dist.send(data, dst, tag=tag)
    return data, None


def _post_receives(shapes: Sequence, dtype: torch.dtype, src: int, tag: int = 0) -> list:
    """Post every receive at once, before the data is needed: (buffer, work) pairs.

    A message that arrives before its receive is posted waits for the sender to
    transmit it later, and on a busy CPU the sender may be slow to do so (gloo); with
    receives posted early, data flows as soon as it is sent."""
    buffers = [torch.empty(shape, dtype=dtype) for shape in shapes]
    return [(buffer, dist.irecv(buffer, src, tag=tag)) for buffer in buffers]


def _require_cpu(stages: Sequence[nn.Module], step: str) -> None:
    """The from-scratch steps are CPU code over gloo: their receive buffers are CPU
    tensors, and the interleaved step tells messages apart by tag, which NCCL does not
    match on. A stage on a GPU gets an error that says what to use instead."""
    for stage in stages:
        for name, parameter in stage.named_parameters():
            if parameter.device.type != "cpu":
                raise ValueError(
                    f"{step} runs stages on the CPU over gloo, but parameter {name!r} is on "
                    f"{parameter.device}; for GPU stages use torch.distributed.pipelining "
                    "(PipelineStage with a schedule such as ScheduleGPipe or Schedule1F1B)")


# ------------------------------------------------------------------- the step


def gpipe_step(stage: nn.Module, micro_batches: int, inputs: torch.Tensor | None = None,
               targets: torch.Tensor | None = None,
               loss_fn: Callable = F.cross_entropy, timeline: Timeline | None = None,
               overlap: bool = True) -> float:
    """One GPipe training step of this rank's ``stage``; gradients land in its
    parameters (call the optimizer afterwards). Returns the batch's mean loss on every
    rank.

    Rank 0 holds the first stage and needs ``inputs``; the last rank holds the last
    stage and needs ``targets``; the ranks in between need neither. The loss of each
    micro-batch is divided by the number of micro-batches, so the gradients are those
    of the mean loss over the whole batch, as without pipelining.

    With ``overlap`` (the default) sends are non-blocking, so a stage goes on computing
    while its output travels, and receives are posted ahead. Without it every transfer
    blocks both sides until it is done: what a pipeline loses when communication does
    not overlap with computation. CPU stages only (gloo; see :func:`_require_cpu`).
    """
    _require_cpu([stage], "gpipe_step")
    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    if first:
        if inputs is None:
            raise ValueError("rank 0 runs the first stage: pass inputs")
        input_chunks = inputs.split(micro_batch_size(len(inputs), micro_batches))
    if last:
        if targets is None:
            raise ValueError(f"rank {rank} runs the last stage: pass targets")
        target_chunks = targets.split(micro_batch_size(len(targets), micro_batches))
    timeline = timeline or Timeline(rank)
    sends, stage_inputs, stage_outputs = [], [], []

    if not first:  # all micro-batches have the shape the previous stage announces
        shape, dtype = _recv_header(rank - 1)
        arriving = _post_receives([shape] * micro_batches, dtype, rank - 1) if overlap else None
    for m in range(micro_batches):  # forward: every micro-batch through this stage
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
            y = stage(x)
            if last:
                y = loss_fn(y, target_chunks[m]) / micro_batches
        if not last:
            if m == 0:
                _send_header(y, rank + 1)
            sends.append(_send(y, rank + 1, overlap))
        stage_inputs.append(x)
        stage_outputs.append(y)

    if not last and overlap:  # gradients come back in reverse order, shaped like outputs
        returning = _post_receives([y.shape for y in reversed(stage_outputs)],
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
            sends.append(_send(stage_inputs[m].grad, rank - 1, overlap))

    for _, work in sends:
        if work is not None:
            work.wait()
    loss = torch.tensor(sum(y.item() for y in stage_outputs) if last else 0.0,
                        dtype=torch.float64)
    dist.broadcast(loss, src=world - 1)
    return loss.item()


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
    _check_counts(ranks, micro_batches, virtual_stages)
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


def interleaved_1f1b_step(stages: Sequence[nn.Module], micro_batches: int,
                          inputs: torch.Tensor | None = None,
                          targets: torch.Tensor | None = None,
                          loss_fn: Callable = F.cross_entropy,
                          timeline: Timeline | None = None) -> float:
    """One 1F1B training step of this rank's model pieces, ``stages[c]`` being piece
    ``c * K + rank`` of a model cut into ``v * K`` pieces (K ranks, v = ``len(stages)``
    virtual stages per rank): rank 0 holds the first piece, rank K - 1 the last. With
    v = 1 this is plain 1F1B. Gradients land in the parameters; returns the batch's mean
    loss on every rank.

    Rank 0 needs ``inputs``, rank K - 1 ``targets``. Every transfer is non-blocking and
    every receive is posted ahead, so a rank waits only for data it needs now; the
    ``timeline`` records the computation of each piece (``virtual_stage``), not the waits.
    Messages between two ranks are told apart by tag: three per cut between pieces p
    and p + 1 (the activation's shape, the activations, their gradients). CPU stages
    only (gloo; see :func:`_require_cpu`).
    """
    _require_cpu(stages, "interleaved_1f1b_step")
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = len(stages)
    if chunks > 1 and world < 2:
        raise ValueError("interleaving needs at least 2 ranks: a single rank runs its "
                         "pieces one after the other, use one piece (or gpipe_step)")
    order = interleaved_order(rank, world, chunks, micro_batches)
    pieces = chunks * world
    if rank == 0:
        if inputs is None:
            raise ValueError("rank 0 runs the first piece: pass inputs")
        input_chunks = inputs.split(micro_batch_size(len(inputs), micro_batches))
    if rank == world - 1:
        if targets is None:
            raise ValueError(f"rank {rank} runs the last piece: pass targets")
        target_chunks = targets.split(micro_batch_size(len(targets), micro_batches))
    timeline = timeline or Timeline(rank)
    after, before = (rank + 1) % world, (rank - 1) % world

    def piece(chunk: int) -> int:
        return chunk * world + rank

    headers = {}  # chunk -> (buffer, work): the shape of the activations it will receive
    for chunk in range(chunks):
        if piece(chunk) > 0:
            buffer = torch.zeros(MAX_DIMS + 2, dtype=torch.int64)
            headers[chunk] = buffer, dist.irecv(buffer, before, tag=3 * (piece(chunk) - 1))
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
                    shape, dtype = _read_header(buffer)
                    arriving[chunk] = _post_receives([shape] * micro_batches, dtype, before,
                                                     tag=3 * (p - 1) + 1)
                x, work = arriving[chunk][m]
                work.wait()
                x.requires_grad_()
            with timeline.record("forward", m, virtual_stage=p):
                y = stages[chunk](x)
                if p == pieces - 1:
                    y = loss_fn(y, target_chunks[m]) / micro_batches
            if p == pieces - 1:
                losses.append(y.detach())
            else:
                if m == 0:
                    header = _header(y)
                    sends.append((header, dist.isend(header, after, tag=3 * p)))
                    returning[chunk] = _post_receives([y.shape] * micro_batches, y.dtype,
                                                      after, tag=3 * p + 2)
                sends.append(_send(y, after, True, tag=3 * p + 1))
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
                sends.append(_send(x.grad, before, True, tag=3 * (p - 1) + 2))

    for _, work in sends:
        work.wait()
    loss = torch.tensor(sum(x.item() for x in losses), dtype=torch.float64)
    dist.broadcast(loss, src=world - 1)
    return loss.item()
