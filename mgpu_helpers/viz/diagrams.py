"""Diagrams drawn by code: the ring, DDP's overlap, an FSDP unit's life, the tensor-parallel
splits and a 2-D device mesh.

Each ``*_schedule`` / ``*_shards`` / ``*_groups`` function computes what its diagram shows
(which chunk a rank sends, when a bucket's all-reduce may start, which rows a rank holds),
and the drawing function draws only that data. The timelines (:func:`ddp_overlap`,
:func:`fsdp_unit_life`) are schematics: their durations are in units of one layer's
compute, chosen to show an order of events, not measured. Every drawing function returns
the matplotlib ``Figure`` and shows nothing; a notebook calls ``plt.show()``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

#: One colour per rank (up to 10), as the chapters' plots colour ranks.
_RANK_COLOURS = plt.get_cmap("tab10")
_KIND_COLOURS = {"backward": "#e3863b", "forward": "#2a7ab0", "all-gather": "#7b4fa0",
                 "all-reduce": "#7b4fa0", "reduce-scatter": "#3a9a5b", "optimizer": "#555555",
                 "held": "#d9d9d9"}


# ----------------------------------------------------------------- checking arguments


def _whole(function: str, what: str, value, low: int, high: int, why: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or not low <= value <= high:
        raise ValueError(f"{function} needs {low} to {high} {what}, got {value!r}: {why}")


def _amount(function: str, what: str, value, low: float, high: float, why: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{function} needs {what} between {low} and {high}, got {value!r}: "
                         f"{why}")


# ----------------------------------------------------------------- the ring (chapter 03)


@dataclass(frozen=True)
class RingStep:
    """One step of the ring all-reduce (chapter 03, section 2) on N ranks.

    Args:
        phase: ``"reduce-scatter"`` or ``"all-gather"``.
        step: 1 to N-1 within the phase.
        sends: ``sends[r]`` is the chunk rank r sends to its right neighbour, (r + 1) mod N.
        receives: ``receives[r]`` is the chunk rank r receives from its left neighbour.
        holds: ``holds[r][c]``, after the step: the ranks whose piece of chunk c rank r's
            copy of chunk c has summed (all N once the chunk is complete).
    """

    phase: str
    step: int
    sends: tuple[int, ...]
    receives: tuple[int, ...]
    holds: tuple[tuple[frozenset[int], ...], ...]


def _check_ring(function: str, world) -> None:
    _whole(function, "ranks", world, 2, 8,
           "a ring needs 2 ranks, and beyond 8 the panels are too small to read")


def ring_start(world: int) -> tuple[tuple[frozenset[int], ...], ...]:
    """Before the ring: every rank's copy of every chunk holds its own piece only."""
    return tuple(tuple(frozenset({rank}) for _ in range(world)) for rank in range(world))


def ring_schedule(world: int = 4) -> list[RingStep]:
    """The 2(N-1) steps of a ring all-reduce on ``world`` ranks, with chapter 03's indexing
    (``mgpu_helpers/labs/collectives.py::ring_all_reduce``): in reduce-scatter step s
    (from 0) rank r sends chunk (r - s) mod N and adds the chunk (r - s - 1) mod N that
    arrives; in all-gather step s it sends chunk (r + 1 - s) mod N and copies the chunk
    (r - s) mod N that arrives."""
    _check_ring("ring_schedule", world)
    holds = ring_start(world)
    steps = []
    for phase, first in (("reduce-scatter", 0), ("all-gather", 1)):
        for s in range(world - 1):
            sends = tuple((r + first - s) % world for r in range(world))
            receives = tuple((r + first - s - 1) % world for r in range(world))
            before = holds
            holds = tuple(
                tuple(_arrived(before, r, c, world, phase) if c == receives[r] else before[r][c]
                      for c in range(world))
                for r in range(world))
            steps.append(RingStep(phase, s + 1, sends, receives, holds))
    return steps


def _arrived(before, rank: int, chunk: int, world: int, phase: str) -> frozenset[int]:
    incoming = before[(rank - 1) % world][chunk]  # what the left neighbour held
    return incoming | before[rank][chunk] if phase == "reduce-scatter" else incoming


def sum_label(ranks: frozenset[int], world: int) -> str:
    """How a ring cell names the ranks it has summed: ``0+1+2`` up to 4 ranks; beyond, to
    fit the cell, ``012``, and ``all`` for a complete sum."""
    if world <= 4:
        return "+".join(str(r) for r in sorted(ranks))
    return "all" if len(ranks) == world else "".join(str(r) for r in sorted(ranks))


def ring_steps(world: int = 4):
    """The ring all-reduce step by step: a grid of panels, the start and then one per step
    (reduce-scatter, then all-gather). In a panel, row r is rank r and column c is chunk c;
    a cell names the ranks whose pieces that copy of the chunk has summed, darker as it
    fills. The chunk each rank received in the step is outlined in orange, the one it sent
    to its right neighbour is dashed, and the row label says which chunk it sent."""
    _check_ring("ring_steps", world)
    steps = ring_schedule(world)
    ncols = min(world, 4)
    per_phase = -(-world // ncols)  # rows of panels per phase: the start + N-1 steps
    panels = [("start", None), *[(f"reduce-scatter {s.step}/{world - 1}", s)
                                 for s in steps[:world - 1]]]
    slots = panels + [None] * (per_phase * ncols - len(panels))  # all-gather k under r-s k
    slots += [None] + [(f"all-gather {s.step}/{world - 1}", s) for s in steps[world - 1:]]
    cell = 0.5 if world <= 4 else 0.42
    fig, axes = plt.subplots(2 * per_phase, ncols,
                             figsize=(ncols * (world * cell + 1.5),
                                      2 * per_phase * (world * cell + 0.8) + 0.8),
                             squeeze=False, layout="constrained")
    for slot, ax in enumerate(axes.flat):
        if slot >= len(slots) or slots[slot] is None:
            fig.delaxes(ax)
            continue
        title, step = slots[slot]
        _draw_ring_panel(ax, ring_start(world) if step is None else step.holds, step, world)
        ax.set_title(title, fontsize=9)
    fig.suptitle(f"Ring all-reduce on {world} ranks: {world - 1} steps of reduce-scatter, "
                 f"then {world - 1} of all-gather\nA cell names the ranks whose pieces that "
                 "copy of the chunk has summed; orange: received in this step; dashed: sent "
                 "to the right neighbour", fontsize=9)
    return fig


def _draw_ring_panel(ax, holds, step: RingStep | None, world: int) -> None:
    shades = plt.get_cmap("Blues")
    for r in range(world):
        for c in range(world):
            share = len(holds[r][c]) / world
            ax.add_patch(Rectangle((c, r), 1, 1, facecolor=shades(0.1 + 0.8 * share),
                                   edgecolor="white"))
            ax.text(c + 0.5, r + 0.5, sum_label(holds[r][c], world), ha="center",
                    va="center", fontsize=6 if world <= 4 else 5,
                    color="white" if share > 0.6 else "black", gid=f"cell {r} {c}")
        if step is not None:
            ax.add_patch(Rectangle((step.receives[r] + 0.04, r + 0.04), 0.92, 0.92, fill=False,
                                   edgecolor="#e8590c", linewidth=2, gid=f"received {r}"))
            ax.add_patch(Rectangle((step.sends[r] + 0.12, r + 0.12), 0.76, 0.76, fill=False,
                                   edgecolor="black", linestyle="--", linewidth=0.8,
                                   gid=f"sent {r}"))
    labels = [f"rank {r}" if step is None else f"rank {r} sends {step.sends[r]}"
              for r in range(world)]
    ax.set(xlim=(0, world), ylim=(world, 0), aspect="equal")
    ax.set_xticks([c + 0.5 for c in range(world)], [str(c) for c in range(world)])
    ax.set_yticks([r + 0.5 for r in range(world)], labels)
    ax.tick_params(length=0, labelsize=7)
    ax.set_xlabel("chunk", fontsize=7)


# ----------------------------------------------------------------- DDP (chapter 05)


@dataclass(frozen=True)
class Span:
    """One box of a schematic timeline: ``kind`` (``"backward"``, ``"all-reduce"``...),
    ``index`` (the layer, bucket or unit; -1 where there is one), and its start and end
    in schematic units."""

    kind: str
    index: int
    start: float
    end: float


@dataclass(frozen=True)
class DdpSchedule:
    """What :func:`ddp_overlap` draws: with overlap (DDP) and, for comparison, without
    (one all-reduce of every gradient after backward)."""

    layers: int
    buckets: tuple[tuple[int, ...], ...]  # the layers in each bucket, bucket 0 first
    backward: tuple[Span, ...]  # one per layer, the last layer first
    all_reduces: tuple[Span, ...]  # one per bucket
    optimizer: Span
    no_overlap_all_reduce: Span
    no_overlap_optimizer: Span

    @property
    def exposed(self) -> float:
        """Communication not hidden behind backward: from backward's end to the step."""
        return self.optimizer.start - self.backward[-1].end


#: Schematic length of the optimizer step, in units of one layer's backward.
OPTIMIZER_UNITS = 1.0


def ddp_schedule(buckets: int = 3, layers: int = 6, comm_per_layer: float = 0.5,
                 latency: float = 0.2) -> DdpSchedule:
    """DDP's backward on one GPU as a schematic (appendix DDP internals, section 2).

    Backward computes the layers' gradients last layer first, one unit of time each, on
    the compute stream. Bucket 0 holds the last layers (the first gradients to arrive),
    the next bucket the layers before them, and so on, the layers shared out as evenly as
    possible. A bucket's all-reduce starts once its last gradient has arrived and the
    previous bucket's all-reduce has finished (DDP starts them in bucket order, and NCCL
    runs them one after the other on its own stream); it takes ``latency + comm_per_layer
    x layers in the bucket``. The optimizer step waits for the last all-reduce.

    Args:
        buckets: DDP's buckets, 1 to ``layers``.
        layers: layers of the model, 1 to 24.
        comm_per_layer: the all-reduce time of one layer's gradients, in units of one
            layer's backward (0 to 10).
        latency: the fixed cost of one all-reduce (chapter 03's alpha), same units (0 to 10).
    """
    _whole("ddp_overlap", "layers", layers, 1, 24, "beyond 24 the boxes are too small to read")
    _whole("ddp_overlap", "buckets", buckets, 1, layers,
           "each bucket holds at least one layer's gradients")
    _amount("ddp_overlap", "comm_per_layer", comm_per_layer, 0, 10,
            "the all-reduce time of one layer's gradients, in units of one layer's backward")
    _amount("ddp_overlap", "latency", latency, 0, 10,
            "the fixed cost of one all-reduce, in units of one layer's backward")
    order = list(range(layers - 1, -1, -1))  # backward: the last layer first
    backward = tuple(Span("backward", layer, float(k), float(k + 1))
                     for k, layer in enumerate(order))
    base, extra = divmod(layers, buckets)
    groups, at = [], 0
    for b in range(buckets):
        size = base + (b < extra)
        groups.append(tuple(order[at:at + size]))
        at += size
    ready = {span.index: span.end for span in backward}
    all_reduces, free_at = [], 0.0
    for b, group in enumerate(groups):
        start = max(max(ready[layer] for layer in group), free_at)
        free_at = start + latency + comm_per_layer * len(group)
        all_reduces.append(Span("all-reduce", b, start, free_at))
    end = backward[-1].end
    step_start = max(end, free_at)
    alone = Span("all-reduce", 0, end, end + latency + comm_per_layer * layers)
    return DdpSchedule(layers, tuple(groups), backward, tuple(all_reduces),
                       Span("optimizer", -1, step_start, step_start + OPTIMIZER_UNITS),
                       alone, Span("optimizer", -1, alone.end, alone.end + OPTIMIZER_UNITS))


def ddp_overlap(buckets: int = 3, layers: int = 6, comm_per_layer: float = 0.5,
                latency: float = 0.2):
    """DDP overlapping the gradient all-reduces with backward on a GPU: a schematic
    timeline of two streams (:func:`ddp_schedule` says how it is computed), above the same
    step without overlap. The arguments are :func:`ddp_schedule`'s."""
    plan = ddp_schedule(buckets, layers, comm_per_layer, latency)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 3.6), sharex=True,
                                   layout="constrained")
    for span in plan.backward:
        _box(top, 1, span, f"L{span.index}")
        _box(bottom, 1, span, f"L{span.index}")
    for span, group in zip(plan.all_reduces, plan.buckets, strict=True):
        _box(top, 0, span, f"b{span.index}: L{group[0]}" +
             (f"-L{group[-1]}" if len(group) > 1 else ""))
    _box(top, 1, plan.optimizer, "step")
    _box(bottom, 0, plan.no_overlap_all_reduce, "all gradients")
    _box(bottom, 1, plan.no_overlap_optimizer, "step")
    end = plan.backward[-1].end
    for ax in (top, bottom):
        ax.axvline(end, color="#c92a2a", linestyle=":", linewidth=1)
        ax.set_yticks([1, 0], ["compute stream", "communication\nstream (NCCL)"], fontsize=8)
        ax.set_ylim(-0.6, 1.6)
    top.set_title(f"DDP, {layers} layers in {buckets} bucket{'s' * (buckets > 1)}: each "
                  f"bucket is all-reduced once its gradients are ready; exposed: "
                  f"{plan.exposed:.1f}", fontsize=9)
    bottom.set_title("without overlap: one all-reduce after backward; exposed: "
                     f"{plan.no_overlap_all_reduce.end - end:.1f}", fontsize=9)
    bottom.set_xlabel("schematic time, in units of one layer's backward (not measured); "
                      "dotted: backward ends", fontsize=8)
    bottom.legend(handles=[Patch(color=_KIND_COLOURS[k], label=k) for k in
                           ("backward", "all-reduce", "optimizer")],
                  loc="upper left", bbox_to_anchor=(1.005, 1.6), fontsize=7, frameon=False)
    fig.suptitle("Schematic: DDP's backward on one GPU (Lk: backward of layer k; "
                 "bn: bucket n)", fontsize=9)
    return fig


def _box(ax, row: float, span: Span, label: str, height: float = 0.7) -> None:
    ax.broken_barh([(span.start, span.end - span.start)], (row - height / 2, height),
                   color=_KIND_COLOURS[span.kind], edgecolor="white",
                   gid=f"{span.kind} {span.index}")
    if span.end - span.start >= 0.3:
        ax.text((span.start + span.end) / 2, row, label, ha="center", va="center",
                fontsize=6, color="white")


# ----------------------------------------------------------------- FSDP (chapter 07)

#: Schematic compute of one unit: forward 1, backward 2 (a backward costs about twice a
#: forward, chapter 07's rule of thumb).
FORWARD_UNITS, BACKWARD_UNITS = 1.0, 2.0


def fsdp_schedule(units: int = 3, comm: float = 0.6,
                  reshard_after_forward: bool = True) -> tuple[Span, ...]:
    """One training step of FSDP2 with ``units`` units (``fully_shard(block)`` per block;
    the root's own parameters left out), as a schematic.

    Each unit: all-gather its weights, compute, free them (``"held"`` spans the time its
    full weights exist); in backward all-gather again (unless ``reshard_after_forward`` is
    False: then the weights stay from forward to backward), compute the gradients, free
    the weights, and reduce-scatter the gradients. The next unit's all-gather starts when
    the current unit's compute starts (the prefetch: the all-gathers run on a stream of
    their own, so they overlap the compute), the reduce-scatters run one after the other on
    theirs, and the optimizer step waits for the last one.

    Args:
        units: FSDP units, 1 to 8.
        comm: the time of one unit's all-gather or reduce-scatter, in units of one unit's
            forward compute (0 to 10).
        reshard_after_forward: ``fully_shard``'s argument of that name.
    """
    _whole("fsdp_unit_life", "units", units, 1, 8, "beyond 8 the rows are too small to read")
    _amount("fsdp_unit_life", "comm", comm, 0, 10,
            "one unit's all-gather time, in units of one unit's forward compute")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError("fsdp_unit_life needs reshard_after_forward True or False, got "
                         f"{reshard_after_forward!r}")
    spans: list[Span] = []
    gathered_from: dict[int, float] = {}
    free = {"gather": 0.0, "compute": 0.0, "reduce": 0.0}  # when each stream is next free
    previous_compute_start = 0.0

    def gather_then_compute(unit: int, kind: str, duration: float, gather: bool) -> None:
        # the all-gather starts once its stream is free and the previous unit computes
        # (the prefetch); the compute once the weights are there and the last one is done
        nonlocal previous_compute_start
        if gather:
            start = max(free["gather"], previous_compute_start)
            gathered_from[unit] = start
            free["gather"] = start + comm
            spans.append(Span("all-gather", unit, start, free["gather"]))
        begin = max(free["gather"], free["compute"])
        free["compute"] = begin + duration
        spans.append(Span(kind, unit, begin, free["compute"]))
        previous_compute_start = begin

    for unit in range(units):
        gather_then_compute(unit, "forward", FORWARD_UNITS, gather=True)
        if reshard_after_forward:
            spans.append(Span("held", unit, gathered_from.pop(unit), free["compute"]))
    previous_compute_start = free["compute"]  # backward's first all-gather waits for the loss
    for unit in reversed(range(units)):
        gather_then_compute(unit, "backward", BACKWARD_UNITS, gather=reshard_after_forward)
        spans.append(Span("held", unit, gathered_from.pop(unit), free["compute"]))
        start = max(free["compute"], free["reduce"])
        free["reduce"] = start + comm
        spans.append(Span("reduce-scatter", unit, start, free["reduce"]))
    compute_free, reduce_free = free["compute"], free["reduce"]
    step = max(compute_free, reduce_free)
    spans.append(Span("optimizer", -1, step, step + OPTIMIZER_UNITS))
    return tuple(spans)


def most_held(spans: tuple[Span, ...]) -> int:
    """The most units whose full weights exist at one time in a schedule."""
    held = [s for s in spans if s.kind == "held"]
    return max(sum(h.start <= t < h.end for h in held) for t in {h.start for h in held})


def fsdp_unit_life(units: int = 3, comm: float = 0.6, reshard_after_forward: bool = True):
    """Each FSDP unit's life in one training step, a row per unit (all-gather, forward,
    free; all-gather, backward, free, reduce-scatter), above the number of units whose
    full weights exist at each moment. A schematic of :func:`fsdp_schedule`, whose
    arguments it takes."""
    spans = fsdp_schedule(units, comm, reshard_after_forward)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 1.2 + 0.55 * units + 1.4),
                                      sharex=True,
                                      gridspec_kw={"height_ratios": [units + 1, 2]},
                                      layout="constrained")
    for span in spans:
        if span.kind == "held":
            top.broken_barh([(span.start, span.end - span.start)], (span.index - 0.45, 0.9),
                            color=_KIND_COLOURS["held"], zorder=0,
                            gid=f"held {span.index}")
        elif span.kind == "optimizer":
            top.axvline(span.start, color=_KIND_COLOURS["optimizer"], linestyle="--",
                        linewidth=1, gid="optimizer")
        else:
            _box(top, span.index, span, {"all-gather": "AG", "forward": "F",
                                         "backward": "B", "reduce-scatter": "RS"}[span.kind],
                 height=0.55)
    top.set_yticks(range(units), [f"unit {u}" for u in range(units)], fontsize=8)
    top.set_ylim(units - 0.4, -0.6)
    top.legend(handles=[Patch(color=_KIND_COLOURS[k], label=label) for k, label in (
        ("all-gather", "all-gather (its own stream)"), ("forward", "forward (compute)"),
        ("backward", "backward (compute)"), ("reduce-scatter", "reduce-scatter (its own "
                                             "stream)"),
        ("held", "full weights held"))] + [plt.Line2D([], [], color="#555555",
                                                      linestyle="--",
                                                      label="optimizer step")],
        loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=7, frameon=False)
    times = sorted({t for s in spans if s.kind == "held" for t in (s.start, s.end)})
    held = [s for s in spans if s.kind == "held"]
    counts = [sum(h.start <= t < h.end for h in held) for t in times]
    bottom.step(times, counts, where="post", color="#333333", gid="held count")
    bottom.set_yticks(range(0, max(counts) + 1))
    bottom.set_ylabel("units held\nin full", fontsize=8)
    bottom.set_xlabel("schematic time, in units of one unit's forward compute (not measured)",
                      fontsize=8)
    mode = "" if reshard_after_forward else ", reshard_after_forward=False"
    most = most_held(spans)
    top.set_title(f"Schematic: FSDP2, {units} unit{'s' * (units > 1)}{mode}; at most "
                  f"{most} unit{'s' * (most > 1)}' full weights at once", fontsize=9)
    return fig


# ----------------------------------------------------------------- tensor parallel (ch. 07)


def tp_shards(ranks: int = 2, width: int = 4) -> list[dict[str, tuple[int, int]]]:
    """Which slices of ``Linear(width, 4 width) -> ReLU -> Linear(4 width, width)`` each rank
    holds, Megatron style (chapter 07, section 6): ``w1_rows`` (column-parallel: its rows
    of the first weight, i.e. its share of the hidden features, and the same slice of the
    first bias) and ``w2_columns`` (row-parallel: the same share of the second weight's
    input features). Slices are ``(start, stop)``; the second bias is whole on every rank."""
    _whole("tp_splits", "ranks", ranks, 2, 8, "tensor parallelism needs 2 ranks, and 8 "
           "(one node) is as many as the figure draws")
    _whole("tp_splits", "features of width", width, 1, 16, "beyond 16 the shapes do not fit")
    hidden = 4 * width
    if hidden % ranks:
        raise ValueError(f"tp_splits needs the hidden width 4 x {width} = {hidden} to be a "
                         f"multiple of ranks={ranks}: Megatron's split gives every rank the "
                         "same share; choose another width or number of ranks")
    share = hidden // ranks
    return [{"w1_rows": (r * share, (r + 1) * share), "w2_columns": (r * share, (r + 1) * share)}
            for r in range(ranks)]


def tp_splits(ranks: int = 2, width: int = 4, batch: int = 2):
    """The feed-forward block split over ``ranks`` ranks, column-parallel then row-parallel:
    the unsplit weights coloured by the rank that holds each slice (top), each rank's own
    computation with its shapes (a row per rank), and the one all-reduce that sums the
    partial outputs (right). Shapes are drawn to scale, in PyTorch's layout (a weight is
    out_features x in_features; ``x @ W.T``)."""
    shards = tp_shards(ranks, width)
    _whole("tp_splits", "rows of batch", batch, 1, 8, "beyond 8 the shapes do not fit")
    hidden, share = 4 * width, 4 * width // ranks
    mosaic = [["full", "full"]] + [[f"rank {r}", "all-reduce"] for r in range(ranks)]
    fig, axes = plt.subplot_mosaic(mosaic, figsize=(11, 2.6 + 1.7 * ranks),
                                   gridspec_kw={"width_ratios": [4, 1],
                                                "height_ratios": [1.5] + [1] * ranks},
                                   layout="constrained")
    full = axes["full"]
    for r, shard in enumerate(shards):
        a, b = shard["w1_rows"]
        _matrix(full, 0, hidden - b, width, b - a, _RANK_COLOURS(r),
                f"W1 rows {a}:{b} rank {r}")
        full.text(width / 2, hidden - (a + b) / 2, str(r), ha="center", va="center",
                  fontsize=7, color="white")
        a, b = shard["w2_columns"]
        _matrix(full, width + 4 + a, 0, b - a, width, _RANK_COLOURS(r),
                f"W2 columns {a}:{b} rank {r}")
        full.text(width + 4 + (a + b) / 2, width / 2, str(r), ha="center", va="center",
                  fontsize=7, color="white")
    full.text(width / 2, hidden + 0.6, f"W1: {hidden} x {width}\nsplit by rows "
              "(column-parallel)", ha="center", va="bottom", fontsize=7)
    full.text(width + 4 + hidden / 2, width + 0.6, f"W2: {width} x {hidden}\nsplit by columns "
              "(row-parallel)", ha="center", va="bottom", fontsize=7)
    full.set_title("The unsplit block Linear(d, 4d) -> ReLU -> Linear(4d, d), "
                   f"d = {width}: the rank that holds each slice", fontsize=9)
    _frame(full, width + 4 + hidden, hidden + 3)
    for r, shard in enumerate(shards):
        _rank_row(axes[f"rank {r}"], r, shard, batch, width, share)
    reduce = axes["all-reduce"]
    for r in range(ranks):
        _matrix(reduce, 0, (ranks - 1 - r) * (batch + 0.5), width, batch, _RANK_COLOURS(r),
                f"partial y rank {r}", hatch="//")
    top = ranks * (batch + 0.5)
    _matrix(reduce, width + 2, 0, width, batch, "#777777", "y")
    reduce.text(width + 1, batch / 2, "=", ha="center", va="center", fontsize=10)
    reduce.text((2 * width + 2) / 2, top + 0.3, f"all-reduce (sum over {ranks} ranks)\n"
                f"of {batch} x {width} values, + b2:\ny, the same on every rank",
                ha="center", va="bottom", fontsize=7)
    _frame(reduce, 2 * width + 2, top + 2.5)
    fig.suptitle(f"Tensor parallelism on {ranks} ranks: forward, 1 all-reduce of {batch} x "
                 f"{width} values; backward, 1 more (x's gradient) when x requires a gradient",
                 fontsize=9)
    return fig


def _rank_row(ax, rank: int, shard, batch: int, width: int, share: int) -> None:
    colour = _RANK_COLOURS(rank)
    a, b = shard["w1_rows"]
    items = [("x", batch, width, "#bbbbbb", "x"), "@",
             (f"W1[{a}:{b}].T", width, share, colour, f"W1[{a}:{b}].T"), "->",
             (f"h rank {rank}", batch, share, colour, "h"), "@",
             (f"W2[:, {a}:{b}].T", share, width, colour, f"W2[:, {a}:{b}].T"), "=",
             (f"partial y rank {rank}", batch, width, colour, "partial y")]
    x = 0.0
    tallest = max(width, share)
    for item in items:
        if isinstance(item, str):
            ax.text(x + 0.9, tallest / 2, item, ha="center", va="center", fontsize=8)
            x += 1.8
            continue
        name, rows, columns, fill, label = item
        _matrix(ax, x, (tallest - rows) / 2, columns, rows, fill, name,
                hatch="//" if name.startswith("partial") else None)
        ax.text(x + columns / 2, -0.4, f"{label}\n{rows} x {columns}", ha="center", va="top",
                fontsize=6)
        x += columns
    ax.set_title(f"rank {rank}: h = relu(x @ W1[{a}:{b}].T + b1[{a}:{b}]), partial y = "
                 f"h @ W2[:, {a}:{b}].T; no communication", fontsize=8, loc="left")
    _frame(ax, x, tallest, bottom=-3.2)


def _matrix(ax, x: float, y: float, columns: float, rows: float, fill, gid: str,
            hatch: str | None = None) -> None:
    ax.add_patch(Rectangle((x, y), columns, rows, facecolor=fill, edgecolor="black",
                           linewidth=0.6, hatch=hatch, gid=gid))


def _frame(ax, right: float, top: float, bottom: float = -0.5) -> None:
    ax.set(xlim=(-0.5, right + 0.5), ylim=(bottom, top + 0.5), aspect="equal")
    ax.axis("off")


# ----------------------------------------------------------------- 2-D mesh (chapter 07)


def mesh_groups(dp: int = 2, tp: int = 4) -> dict[str, list[list[int]]]:
    """The process groups of a ``(dp, tp)`` mesh, as ``init_device_mesh(device, (dp, tp),
    mesh_dim_names=("dp", "tp"))`` lays the ranks out: row-major, rank = i x tp + j, so a
    ``mesh["tp"]`` group is tp consecutive ranks (a row) and a ``mesh["dp"]`` group is the
    ranks tp apart (a column)."""
    _whole("mesh_2d", "ranks along dp", dp, 1, 16, "the figure draws up to 16 rows")
    _whole("mesh_2d", "ranks along tp", tp, 1, 16, "the figure draws up to 16 columns")
    if dp * tp < 2:
        raise ValueError("mesh_2d needs at least 2 devices, got dp=1, tp=1: make dp or tp "
                         "larger than 1")
    return {"tp": [[i * tp + j for j in range(tp)] for i in range(dp)],
            "dp": [[i * tp + j for i in range(dp)] for j in range(tp)]}


def mesh_2d(dp: int = 2, tp: int = 4, gpus_per_node: int | None = None):
    """The devices of a 2-D mesh, twice: once with the ``mesh["tp"]`` groups highlighted,
    once with the ``mesh["dp"]`` groups. A device shows its rank and its mesh coordinate
    (dp index, tp index); with ``gpus_per_node`` (ranks numbered node by node, as torchrun
    and SLURM do) also its node, and the title says whether every tensor-parallel group
    stays inside one node."""
    groups = mesh_groups(dp, tp)
    world = dp * tp
    if gpus_per_node is not None:
        _whole("mesh_2d", "GPUs per node", gpus_per_node, 1, world,
               "a node holds at least one of the mesh's devices")
        if world % gpus_per_node:
            raise ValueError(f"mesh_2d needs gpus_per_node to divide the {world} devices, got "
                             f"{gpus_per_node}: every node holds the same number of GPUs")
    size = 0.9
    fig, axes = plt.subplots(1, 2, figsize=(2 * (tp * size + 1.2), dp * size + 1.6),
                             squeeze=False, layout="constrained")
    for ax, dim in zip(axes[0], ("tp", "dp"), strict=True):
        for k, members in enumerate(groups[dim]):
            cells = [(rank // tp, rank % tp) for rank in members]
            rows, cols = [i for i, _ in cells], [j for _, j in cells]
            ax.add_patch(FancyBboxPatch(
                (min(cols) + 0.06, min(rows) + 0.06), max(cols) - min(cols) + 0.88,
                max(rows) - min(rows) + 0.88, boxstyle="round,pad=0,rounding_size=0.15",
                facecolor=_RANK_COLOURS(k % 10), alpha=0.35, edgecolor=_RANK_COLOURS(k % 10),
                linewidth=1.5, gid=f"{dim} group " + ",".join(map(str, members))))
        for rank in range(world):
            i, j = divmod(rank, tp)
            node = "" if gpus_per_node is None else f"\nnode {rank // gpus_per_node}"
            ax.text(j + 0.5, i + 0.5, f"rank {rank}\n({i}, {j}){node}", ha="center",
                    va="center", fontsize=6, gid=f"device {rank}")
        ax.set(xlim=(0, tp), ylim=(dp, 0), aspect="equal")
        ax.set_xticks([j + 0.5 for j in range(tp)], [str(j) for j in range(tp)])
        ax.set_yticks([i + 0.5 for i in range(dp)], [str(i) for i in range(dp)])
        ax.tick_params(length=0, labelsize=7)
        ax.set_xlabel("tp index", fontsize=7)
        ax.set_ylabel("dp index", fontsize=7)
        ax.set_title(f'mesh["{dim}"]: {len(groups[dim])} groups of {len(groups[dim][0])}',
                     fontsize=9)
    title = f'init_device_mesh(..., ({dp}, {tp}), mesh_dim_names=("dp", "tp"))'
    if gpus_per_node is not None:
        inside = all(len({rank // gpus_per_node for rank in g}) == 1 for g in groups["tp"])
        title += (f"\n{gpus_per_node} GPUs per node: " +
                  ("every tp group is inside one node" if inside else
                   "some tp groups span nodes: their all-reduces cross the network"))
    fig.suptitle(title, fontsize=9)
    return fig



def mesh_3d(groups: dict[str, list[list[int]]], shape: tuple[int, int, int],
            collectives: dict[str, str]):
    """A 3-D mesh's devices, one panel per dimension with that dimension's groups
    highlighted (chapter 14). ``groups[name]`` are the groups as the run reported them
    (lists of global ranks), ``shape`` the mesh's sizes outermost first, and
    ``collectives[name]`` what that dimension's groups run (the panel's subtitle). The
    devices are drawn as the outermost dimension's blocks side by side, each block a
    grid of the two inner dimensions."""
    names = list(groups)
    outer, middle, inner = shape
    if len(names) != 3 or outer * middle * inner < 2:
        raise ValueError(f"mesh_3d draws a mesh of 3 named dimensions, got {names} of "
                         f"shape {shape}")
    size = 0.8

    def place(rank: int) -> tuple[float, float]:  # (x, y) of a rank's cell
        block, rest = divmod(rank, middle * inner)
        row, column = divmod(rest, inner)
        return block * (inner + 0.6) + column, row

    width = outer * (inner + 0.6) - 0.6
    fig, axes = plt.subplots(1, 3, figsize=(3 * (width * size + 0.6), middle * size + 1.5),
                             layout="constrained")
    for ax, name in zip(axes, names, strict=True):
        for k, members in enumerate(groups[name]):
            colour = _RANK_COLOURS(k % 10)
            for rank in members:
                x, y = place(rank)
                ax.add_patch(FancyBboxPatch((x + 0.08, y + 0.08), 0.84, 0.84,
                                            boxstyle="round,pad=0,rounding_size=0.12",
                                            facecolor=colour, alpha=0.45, edgecolor=colour,
                                            gid=f"{name} group {k} rank {rank}"))
                ax.text(x + 0.5, y + 0.5, str(rank), ha="center", va="center", fontsize=8)
        ax.set(xlim=(0, width), ylim=(middle, 0), aspect="equal")
        ax.set_axis_off()
        ax.set_title(f'mesh["{name}"]: {len(groups[name])} groups of '
                     f"{len(groups[name][0])}\n{collectives.get(name, '')}", fontsize=8)
    fig.suptitle(f"{names[0]} x {names[1]} x {names[2]} = {' x '.join(map(str, shape))}: "
                 f"same colour, same group ({names[0]} blocks side by side)", fontsize=9)
    return fig


# ----------------------------------------------------------- DTensor placements (chapter 11)

PLACEMENTS = ("Shard(0)", "Shard(1)", "Replicate()", "Partial()")


def placement_pieces(placement: str, ranks: int = 2, rows: int = 4,
                     columns: int = 4) -> list[tuple[range, range]]:
    """The block of a ``rows x columns`` tensor each rank holds under ``placement`` (one
    of :data:`PLACEMENTS`) on a 1-D mesh: ``(row range, column range)`` by rank, as
    ``torch.chunk`` cuts (the last piece smaller when the size does not divide). Under
    ``Partial()`` every rank holds a whole-shaped tensor of addends; the tensor is their sum."""
    _whole("placements", "ranks", ranks, 1, 8, "the figure draws up to 8 ranks")
    _whole("placements", "rows", rows, 1, 16, "the figure draws up to 16 rows")
    _whole("placements", "columns", columns, 1, 16, "the figure draws up to 16 columns")
    if placement not in PLACEMENTS:
        raise ValueError(f"placements: unknown placement {placement!r}; expected one of "
                         f"{', '.join(PLACEMENTS)}")

    def cut(size: int, rank: int) -> range:
        step = -(-size // ranks)
        return range(min(rank * step, size), min((rank + 1) * step, size))

    return [(cut(rows, r) if placement == "Shard(0)" else range(rows),
             cut(columns, r) if placement == "Shard(1)" else range(columns))
            for r in range(ranks)]


def placements(ranks: int = 2, rows: int = 4, columns: int = 4):
    """A panel per placement of :data:`PLACEMENTS`: the global tensor, then
    what each rank holds of it, coloured by rank (hatched where the values are partial
    sums)."""
    size = 0.22
    fig, axes = plt.subplots(2, 2, figsize=(
        2 * (1.2 + (ranks + 1) * (columns + 2) * size), 2 * (rows + 2) * size + 0.4),
        layout="constrained")
    for ax, placement in zip(axes.flat, PLACEMENTS, strict=True):
        pieces = placement_pieces(placement, ranks, rows, columns)
        _matrix(ax, 0, 0, columns, rows, "#f2f2f2", f"{placement} global")
        ax.text(columns / 2, rows + 0.3, "global tensor", ha="center", fontsize=7)
        for rank, (row_range, column_range) in enumerate(pieces):
            x = (rank + 1) * (columns + 2)
            _matrix(ax, x, 0, columns, rows, "white", f"{placement} rank {rank} frame")
            if len(row_range) and len(column_range):
                _matrix(ax, x + column_range.start, rows - row_range.stop, len(column_range),
                        len(row_range), _RANK_COLOURS(rank % 10),
                        f"{placement} rank {rank} holds",
                        hatch="///" if placement == "Partial()" else None)
            ax.text(x + columns / 2, rows + 0.3, f"rank {rank}", ha="center", fontsize=7)
        ax.text(-0.8, rows / 2, placement, ha="right", va="center", fontsize=9)
        _frame(ax, (ranks + 1) * (columns + 2) - 2, rows + 0.8)
    fig.suptitle("What each rank holds of a DTensor, by placement (Partial: addends of "
                 "the whole tensor)", fontsize=9)
    return fig
