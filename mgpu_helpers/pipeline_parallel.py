"""Pipeline parallelism from send/recv: a model cut into stages, one stage per rank,
micro-batches flowing through them (GPipe), with a recorded timeline.

Chapter 06 builds its understanding on these pieces:

* :func:`split_sequential` cuts an ``nn.Sequential`` into stages;
* :func:`layer_costs` and :func:`balanced_cuts` measure each layer (parameters, FLOPs,
  activation size, time) and choose the cuts that balance the stages;
* :func:`gpipe_step` runs one training step of the stage this rank holds: all forward
  passes of the micro-batches, then all backward passes (GPipe's schedule), activations
  sent to the next rank and gradients to the previous one with non-blocking sends;
* :class:`Timeline` records when each stage computed what, for a Gantt chart and the
  measured bubble fraction, compared with the theory (K-1)/(M+K-1).

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
    stage: int
    kind: str          # "forward" or "backward"
    micro_batch: int
    start: float       # seconds, time.perf_counter (one clock for all processes of a host)
    end: float


class Timeline:
    """Records a stage's compute intervals. Idle time is what lies between them."""

    def __init__(self, stage: int):
        self.stage = stage
        self.events: list[Event] = []

    @contextmanager
    def record(self, kind: str, micro_batch: int):
        start = time.perf_counter()
        yield
        self.events.append(Event(self.stage, kind, micro_batch, start, time.perf_counter()))


def bubble_fraction(events: Sequence[Event]) -> float:
    """Measured idle share of the pipeline: 1 - busy time / (stages x span), where span
    runs from the first start to the last end over all stages."""
    if not events:
        raise ValueError("no events recorded")
    stages = {e.stage for e in events}
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1 - busy / (len(stages) * span)


def theoretical_bubble(stages: int, micro_batches: int) -> float:
    """GPipe's idle share with equal stages and free communication: (K-1)/(M+K-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def ideal_speedup(stages: int, micro_batches: int) -> float:
    """Speed-up of M micro-batches over the naive split (M = 1): K*M/(M+K-1)."""
    return stages * micro_batches / (micro_batches + stages - 1)


def plot_timeline(events: Sequence[Event], ax=None, title: str | None = None):
    """Gantt chart: one row per stage, forward and backward boxes labelled by
    micro-batch; gaps are the bubble."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.7 * len({e.stage for e in events}) + 1.2))
    origin = min(e.start for e in events)
    colours = {"forward": "#2a7ab0", "backward": "#e3863b"}
    for e in events:
        start, width = (e.start - origin) * 1e3, (e.end - e.start) * 1e3
        ax.broken_barh([(start, width)], (e.stage - 0.4, 0.8), color=colours[e.kind],
                       edgecolor="white")
        ax.text(start + width / 2, e.stage, str(e.micro_batch), ha="center", va="center",
                color="white", fontsize=7)
    stages = sorted({e.stage for e in events})
    ax.set_yticks(stages, [f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.legend(handles=[Patch(color=colour, label=kind) for kind, colour in colours.items()],
              loc="upper right", fontsize=8, ncols=2)
    ax.set_title(title or f"bubble {bubble_fraction(events):.0%} of the time")
    return ax


# ------------------------------------------------------------ activation memory


class ActivationMeter:
    """Counts the bytes autograd keeps for the backward pass (saved activations), now
    and at their peak, while the ``with`` block runs forward passes.

    Tensors that share storage with ``exclude`` (a model's parameters, which autograd
    also saves but which exist anyway) are not counted. A saved tensor stops counting
    when autograd frees it, after its backward has run; a tensor saved by two layers
    (a ReLU's output is also the next layer's input) counts once.
    """

    def __init__(self, exclude=()):
        self.current = 0
        self.peak = 0
        self._live: dict[int, list[int]] = {}  # storage -> [references, bytes]
        self._excluded = {p.untyped_storage().data_ptr() for p in exclude}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info):
        self._hooks.__exit__(*exc_info)

    def _pack(self, tensor: torch.Tensor):
        if tensor.untyped_storage().data_ptr() in self._excluded:
            return tensor
        return _Saved(tensor, self)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved


class _Saved:
    """A saved tensor that tells its meter when autograd lets go of it."""

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter):
        self.tensor, self.meter = tensor, meter
        self.storage = tensor.untyped_storage().data_ptr()
        entry = meter._live.setdefault(self.storage, [0, tensor.untyped_storage().nbytes()])
        entry[0] += 1
        if entry[0] == 1:
            meter.current += entry[1]
            meter.peak = max(meter.peak, meter.current)

    def __del__(self):
        entry = self.meter._live[self.storage]
        entry[0] -= 1
        if entry[0] == 0:
            self.meter.current -= entry[1]
            del self.meter._live[self.storage]


# --------------------------------------------------------------- communication


def _send_header(tensor: torch.Tensor, dst: int) -> None:
    """Tell the next stage the shape and dtype of every micro-batch's activation."""
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"can send at most {MAX_DIMS}-dimensional tensors")
    header = torch.zeros(MAX_DIMS + 2, dtype=torch.int64)
    header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
    header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
    dist.send(header, dst)


def _recv_header(src: int) -> tuple[list[int], torch.dtype]:
    header = torch.zeros(MAX_DIMS + 2, dtype=torch.int64)
    dist.recv(header, src)
    dims = int(header[0])
    return header[2:2 + dims].tolist(), _DTYPES[int(header[1])]


def _send(tensor: torch.Tensor, dst: int, overlap: bool) -> tuple:
    """Send ``tensor``: non-blocking with ``overlap`` (the buffer and its work, to be
    waited on later), else blocking until the receiver has it (the buffer, None)."""
    data = tensor.detach().contiguous()
    if overlap:
        return data, dist.isend(data, dst)
    dist.send(data, dst)
    return data, None


def _post_receives(shapes: Sequence, dtype: torch.dtype, src: int) -> list:
    """Post every receive at once, before the data is needed: (buffer, work) pairs.

    A message that arrives before its receive is posted waits for the sender to
    transmit it later, and on a busy CPU the sender may be slow to do so (gloo); with
    receives posted early, data flows as soon as it is sent."""
    buffers = [torch.empty(shape, dtype=dtype) for shape in shapes]
    return [(buffer, dist.irecv(buffer, src)) for buffer in buffers]


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
    not overlap with computation.
    """
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
