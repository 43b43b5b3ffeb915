"""Chapter 06's pipeline measurements on CPU ranks: step time and idle share of GPipe
for 1 to M micro-batches (the naive split is M = 1); GPipe, 1F1B and interleaved 1F1B
side by side, each with its steps' timelines; overlapped against blocking transfers in
interleaved rounds; and what rank 0's first backward pass of a step costs (CPU time,
page faults).

The pipeline itself (``split_sequential``, ``gpipe_step``, ``interleaved_1f1b_step``,
``Timeline``...) is the core package :mod:`mgpu_helpers.parallel.pipeline`; this module
only builds a model made for the measurements and times it. The measurements' results
are plain dicts (the benchmark writes them to JSON); a pipeline to time is a
:class:`PipelineConfig`, its schedule a :class:`Schedule`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..launcher import launch
from ..parallel.pipeline import (
    Event,
    Timeline,
    balanced_cuts,
    bubble_fraction,
    bubble_to_compute,
    gpipe_step,
    ideal_speedup,
    instant_transfers,
    interleaved_1f1b_step,
    interleaved_order,
    layer_costs,
    micro_batch_size,
    split_sequential,
    theoretical_bubble,
)

try:
    import resource
except ImportError:  # Windows: no page-fault counts
    resource = None


def pipeline_convnet(channels: int = 64, depth: int = 9, image_size: int = 16,
                     classes: int = 10, seed: int = 0) -> nn.Sequential:
    """``depth`` equal 3x3 convolutions (each with its ReLU), then average pooling and a
    linear classifier, for ``3 x image_size x image_size`` inputs.

    Easy to cut into equal stages, and made for pipelining on CPUs: a convolution reuses
    its small weights at every pixel, so splitting a batch into micro-batches costs
    little. (A wide MLP does not pipeline well on CPUs: every micro-batch streams all of
    its megabytes of weights through memory again.)
    """
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Conv2d(3 if i == 0 else channels, channels, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(channels, classes))


def example_batch(model_kwargs: dict, batch_size: int, seed: int = 1) -> tuple:
    """Random images and labels for :func:`pipeline_convnet` with these settings."""
    generator = torch.Generator().manual_seed(seed)
    size = model_kwargs.get("image_size", 16)
    inputs = torch.randn(batch_size, 3, size, size, generator=generator)
    targets = torch.randint(0, model_kwargs.get("classes", 10), (batch_size,),
                            generator=generator)
    return inputs, targets


@dataclass(frozen=True)
class ProfiledEvent:
    """One pass of a profiled step: which, when, and the CPU time and minor page faults
    its thread spent in it."""

    kind: str          # "forward" or "backward"
    micro_batch: int
    start: float
    end: float
    cpu_seconds: float
    page_faults: int


class ProfiledTimeline(Timeline):
    """A :class:`Timeline` that also notes, for every event, the CPU time this thread
    spent in it and the minor page faults it took (memory the kernel had to map and
    zero on first touch): ``profile[i]`` is ``(cpu_seconds, page_faults)`` of
    ``events[i]``. Wall time well above CPU time means the thread was not running
    (waiting, or its core taken by another process)."""

    def __init__(self, rank: int):
        super().__init__(rank)
        self.profile: list[tuple[float, int]] = []

    @contextmanager
    def record(self, kind: str, micro_batch: int, virtual_stage: int | None = None):
        faults, cpu = _page_faults(), time.thread_time()
        with super().record(kind, micro_batch, virtual_stage):
            yield
        self.profile.append((time.thread_time() - cpu, _page_faults() - faults))

    def profiled_events(self) -> list[ProfiledEvent]:
        """Each event with what it cost its thread."""
        return [ProfiledEvent(e.kind, e.micro_batch, e.start, e.end, cpu, faults)
                for e, (cpu, faults) in zip(self.events, self.profile, strict=True)]


def _page_faults() -> int:
    """Minor page faults of this thread so far (of the process where threads are not
    counted apart; 0 without the ``resource`` module)."""
    if resource is None:
        return 0
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_minflt


def _equal_flop_cuts(model_kwargs: dict, pieces: int) -> list[int]:
    """Where to cut :func:`pipeline_convnet` into ``pieces`` of equal forward FLOPs."""
    model = pipeline_convnet(**model_kwargs)
    costs = layer_costs(model, example_batch(model_kwargs, 2)[0], repeats=1)
    return balanced_cuts([cost.flops for cost in costs], pieces)


@dataclass(frozen=True)
class Schedule:
    """How a pipeline runs its passes: ``kind`` "gpipe" or "1f1b" (interleaved where
    each rank holds ``virtual_stages`` > 1 pieces)."""

    kind: str
    virtual_stages: int = 1


GPIPE = Schedule("gpipe")
SCHEDULES = {"gpipe": GPIPE, "1f1b": Schedule("1f1b"), "interleaved": Schedule("1f1b", 2)}


@dataclass(frozen=True)
class PipelineConfig:
    """One pipeline to time: where :func:`pipeline_convnet` is cut (``ranks x
    virtual_stages`` pieces), its schedule, and whether transfers overlap computation."""

    cuts: tuple[int, ...]
    schedule: Schedule = GPIPE
    overlap: bool = True


def _stage_runner(model_kwargs: dict, cuts: Sequence[int], batch_size: int,
                  schedule: Schedule = GPIPE) -> Callable:
    """Inside a rank: this rank's stage modules of :func:`pipeline_convnet`, and a
    function that runs one training step of them with ``schedule``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pieces = split_sequential(pipeline_convnet(**model_kwargs), cuts)
    mine = [pieces[chunk * world + rank] for chunk in range(schedule.virtual_stages)]
    inputs, targets = example_batch(model_kwargs, batch_size)
    inputs = inputs if rank == 0 else None
    targets = targets if rank == world - 1 else None

    def step(micro_batches: int, timeline: Timeline, overlap: bool = True) -> None:
        for piece in mine:
            piece.zero_grad(set_to_none=True)
        if schedule.kind == "gpipe":
            gpipe_step(mine[0], micro_batches, inputs, targets, timeline=timeline,
                       overlap=overlap)
        else:
            interleaved_1f1b_step(mine, micro_batches, inputs, targets, timeline=timeline)

    return step


def _time_steps(step: Callable, micro_batches: int, steps: int, overlap: bool = True,
                timeline_type: type = Timeline) -> tuple[list[float], list[Timeline]]:
    """Inside a rank: a warm-up step, then ``steps`` timed ones, each starting together
    on all ranks (a barrier): their seconds and timelines."""
    seconds, timelines = [], []
    for index in range(steps + 1):  # step 0 warms up
        timeline = timeline_type(dist.get_rank())
        dist.barrier()
        start = time.perf_counter()
        step(micro_batches, timeline, overlap)
        if index:
            seconds.append(time.perf_counter() - start)
            timelines.append(timeline)
    return seconds, timelines


def _timed_steps(model_kwargs: dict, configs: dict[str, PipelineConfig], batch_size: int,
                 micro_batch_counts: list[int], steps: int) -> dict:
    """Inside a rank: ``steps`` timed steps of every pipeline in ``configs`` (by name)
    for each micro-batch count, taken in turns (one step of each, then the next round),
    so that a burst of load elsewhere on the machine hits them all alike."""
    runners = {name: _stage_runner(model_kwargs, config.cuts, batch_size, config.schedule)
               for name, config in configs.items()}
    cases = [(name, m) for name in configs for m in micro_batch_counts]
    results = {name: {m: {"seconds": [], "events": [], "cpu": []} for m in micro_batch_counts}
               for name in configs}
    for index in range(steps + 1):  # round 0 warms up
        for name, m in cases:
            timeline = ProfiledTimeline(dist.get_rank())
            dist.barrier()
            start = time.perf_counter()
            runners[name](m, timeline, configs[name].overlap)
            if index:
                results[name][m]["seconds"].append(time.perf_counter() - start)
                results[name][m]["events"].append(timeline.events)
                results[name][m]["cpu"].append([cpu for cpu, _ in timeline.profile])
    return results


def _median_index(values: Sequence[float]) -> int:
    """The index of the median (the upper one for an even count)."""
    return sorted(range(len(values)), key=values.__getitem__)[len(values) // 2]


def _as_long_as_their_cpu_time(events: Sequence[Event], cpu: Sequence[float]) -> list:
    """The events, each lasting as long as the CPU time its thread spent in it: without
    the time a rank waited for a core that another process held."""
    return [Event(e.rank, e.kind, e.micro_batch, e.start, e.start + seconds,
                  e.virtual_stage) for e, seconds in zip(events, cpu, strict=True)]


def _summarise(per_rank: list[dict], m: int) -> dict:
    """One micro-batch count's runs (a step lasts as long as its slowest rank), and the
    idle share of every step, measured and with instant transfers (each pass as long as
    its CPU time); ``events`` is the timeline of the step with the median idle share."""
    runs = [max(times) for times in zip(*(r[m]["seconds"] for r in per_rank), strict=True)]
    steps = [[event for r in per_rank for event in r[m]["events"][index]]
             for index in range(len(runs))]
    cpu = [[seconds for r in per_rank for seconds in r[m]["cpu"][index]]
           for index in range(len(runs))]
    bubbles = [bubble_fraction(events) for events in steps]
    instant = [bubble_fraction(instant_transfers(_as_long_as_their_cpu_time(events, seconds)))
               for events, seconds in zip(steps, cpu, strict=True)]
    middle = _median_index(bubbles)
    return {"runs": runs, "seconds": sorted(runs)[len(runs) // 2], "bubbles": bubbles,
            "bubble": bubbles[middle], "events": steps[middle],
            "bubbles_instant_transfers": instant,
            "bubble_instant_transfers": statistics.median(instant)}


def _model_kwargs(channels: int, depth: int, image_size: int) -> dict:
    return {"channels": channels, "depth": depth, "image_size": image_size}


def measure_gpipe(micro_batch_counts: Sequence[int] = (1, 2, 4, 8, 16), ranks: int = 2,
                  batch_size: int = 64, channels: int = 64, depth: int = 9,
                  image_size: int = 16, steps: int = 5, overlap: bool = True) -> dict:
    """Step time of the naive split (M = 1) and of GPipe for each M, on ``ranks`` CPU
    ranks, with the idle share of every step (the counts are timed in turns).

    Returns ``{micro_batches: {"seconds": median step time, "runs": [...], "speedup":
    over M = 1, "ideal_speedup", "bubble": the median step's idle share, "bubbles": every
    step's, "bubble_instant_transfers": the median with instant transfers
    (:func:`~mgpu_helpers.parallel.pipeline.instant_transfers`), "theoretical_bubble",
    "events": the median step's timeline}}`` plus the settings under ``"settings"``.
    """
    counts = sorted(set(micro_batch_counts))
    if 1 not in counts:
        counts.insert(0, 1)  # the naive split is the reference
    for m in counts:
        micro_batch_size(batch_size, m)
    model_kwargs = _model_kwargs(channels, depth, image_size)
    cuts = _equal_flop_cuts(model_kwargs, ranks)
    configs = {"gpipe": PipelineConfig(tuple(cuts), GPIPE, overlap)}
    # CPU ranks on every machine: the stage modules, their tensors and the timings are the
    # CPU pipeline this measurement explains (a GPU pipeline would send through NCCL).
    per_rank = launch(_timed_steps, model_kwargs, configs, batch_size, counts, steps,
                      nprocs=ranks, backend="gloo", return_all=True)
    per_rank = [r["gpipe"] for r in per_rank]
    result: dict = {"settings": {"ranks": ranks, "batch_size": batch_size, **model_kwargs,
                                 "steps": steps, "cuts": cuts, "overlap": overlap}}
    for m in counts:
        result[m] = {**_summarise(per_rank, m),
                     "theoretical_bubble": theoretical_bubble(ranks, m),
                     "ideal_speedup": ideal_speedup(ranks, m)}
    for m in counts:
        result[m]["speedup"] = result[1]["seconds"] / result[m]["seconds"]
    return result


def compare_schedules(micro_batch_counts: Sequence[int] = (2, 4, 8, 16), ranks: int = 2,
                      schedules: Sequence[str] = ("gpipe", "1f1b", "interleaved"),
                      batch_size: int = 64, channels: int = 64, depth: int = 9,
                      image_size: int = 16, steps: int = 5) -> dict:
    """GPipe, 1F1B and interleaved 1F1B (2 virtual stages per rank) on ``ranks`` CPU
    ranks, in one launch, their steps taken in turns: :func:`pipeline_convnet` cut into
    pieces of equal FLOPs, ``ranks`` pieces for GPipe and 1F1B, twice as many for the
    interleaved schedule (rank r holds pieces r and r + K).

    Returns ``{"settings", name: {micro_batches: {"seconds", "runs", "bubble", "bubbles",
    "bubble_instant_transfers", "bubbles_instant_transfers", "events",
    "theoretical_bubble": (K-1)/(v·M+K-1), "bubble_to_compute": the measured idle share b
    as b/(1-b), "theoretical_bubble_to_compute": (K-1)/(v·M)}}}`` for each schedule.
    """
    unknown = [name for name in schedules if name not in SCHEDULES]
    if unknown or not schedules:
        raise ValueError(f"unknown schedules {unknown}: choose from {sorted(SCHEDULES)}")
    counts = sorted(set(micro_batch_counts))
    for m in counts:
        micro_batch_size(batch_size, m)
        for name in schedules:
            interleaved_order(0, ranks, SCHEDULES[name].virtual_stages, m)  # a count it accepts
    model_kwargs = _model_kwargs(channels, depth, image_size)
    configs = {}
    for name in schedules:
        schedule = SCHEDULES[name]
        cuts = _equal_flop_cuts(model_kwargs, ranks * schedule.virtual_stages)
        configs[name] = PipelineConfig(tuple(cuts), schedule)
    # CPU ranks on every machine, as in measure_gpipe: the CPU pipeline it explains.
    per_rank = launch(_timed_steps, model_kwargs, configs, batch_size, counts, steps,
                      nprocs=ranks, backend="gloo", return_all=True)
    result: dict = {"settings": {"ranks": ranks, "batch_size": batch_size, **model_kwargs,
                                 "steps": steps, "micro_batches": counts,
                                 "cuts": {name: list(c.cuts) for name, c in configs.items()},
                                 "virtual_stages": {name: c.schedule.virtual_stages
                                                    for name, c in configs.items()}}}
    for name, config in configs.items():
        result[name] = {}
        for m in counts:
            row = _summarise([r[name] for r in per_rank], m)
            virtual = config.schedule.virtual_stages
            row["theoretical_bubble"] = theoretical_bubble(ranks, m, virtual)
            row["bubble_to_compute"] = row["bubble"] / (1 - row["bubble"])
            row["theoretical_bubble_to_compute"] = bubble_to_compute(ranks, m, virtual)
            result[name][m] = row
    return result


# ----------------------------------------------------- overlap, in interleaved rounds


def _overlap_rounds(model_kwargs: dict, cuts: list[int], batch_size: int,
                    micro_batch_counts: list[int], steps: int, rounds: int) -> list:
    """Inside a rank: per round, per M, both kinds of transfer in turn (the order
    alternates between rounds): the seconds of every timed step."""
    step = _stage_runner(model_kwargs, cuts, batch_size)
    measured = []
    for index in range(rounds):
        kinds = ("overlapped", "blocking") if index % 2 == 0 else ("blocking", "overlapped")
        row = {}
        for m in micro_batch_counts:
            row[m] = {kind: _time_steps(step, m, steps, kind == "overlapped")[0]
                      for kind in kinds}
        measured.append(row)
    return measured


def measure_overlap_rounds(micro_batch_counts: Sequence[int] = (8, 16), rounds: int = 5,
                           steps: int = 5, ranks: int = 2, batch_size: int = 64,
                           channels: int = 64, depth: int = 9, image_size: int = 16) -> dict:
    """GPipe with overlapped (non-blocking) against blocking transfers, measured in
    ``rounds`` interleaved rounds in one launch, so that both meet the same load.

    Returns ``{"settings", "rounds": [{M: {"overlapped": median step seconds,
    "blocking": ..., "overlapped_runs": [...], "blocking_runs": [...]}}, ...],
    "summary": {M: {"overlapped": median over rounds, "blocking": ..., "blocking_slower_in":
    rounds where blocking was slower, "median_ratio": the median round's blocking /
    overlapped}}}``.
    """
    for name, value in (("rounds", rounds), ("steps", steps)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    counts = sorted(set(micro_batch_counts))
    for m in counts:
        micro_batch_size(batch_size, m)
    model_kwargs = _model_kwargs(channels, depth, image_size)
    cuts = _equal_flop_cuts(model_kwargs, ranks)
    # CPU ranks on every machine, as in measure_gpipe: the CPU pipeline it explains.
    per_rank = launch(_overlap_rounds, model_kwargs, cuts, batch_size, counts, steps,
                      rounds, nprocs=ranks, backend="gloo", return_all=True)
    table = []
    for index in range(rounds):
        row = {}
        for m in counts:
            row[m] = {}
            for kind in ("overlapped", "blocking"):
                runs = [max(times) for times in
                        zip(*(r[index][m][kind] for r in per_rank), strict=True)]
                row[m][kind] = statistics.median(runs)
                row[m][f"{kind}_runs"] = runs
        table.append(row)
    summary = {m: {"overlapped": statistics.median(row[m]["overlapped"] for row in table),
                   "blocking": statistics.median(row[m]["blocking"] for row in table),
                   "blocking_slower_in": sum(row[m]["blocking"] > row[m]["overlapped"]
                                             for row in table),
                   "median_ratio": statistics.median(row[m]["blocking"] / row[m]["overlapped"]
                                                     for row in table)}
               for m in counts}
    return {"settings": {"ranks": ranks, "batch_size": batch_size, **model_kwargs,
                         "steps": steps, "rounds": rounds, "cuts": cuts},
            "rounds": table, "summary": summary}


# -------------------------------------------------- rank 0's first backward pass


def keep_freed_memory() -> None:
    """Ask glibc's allocator to keep the memory this process frees (Linux): no heap
    trimming, no separate mappings for large blocks, so a freed block is reused without
    new page faults. Raises RuntimeError where that is not possible."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        raise RuntimeError("keep_freed_memory needs glibc's mallopt (Linux): this C "
                           "library has none; run the measurement without keep_memory")
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    if not (libc.mallopt(m_trim_threshold, 2**30) and libc.mallopt(m_mmap_threshold, 2**25)):
        raise RuntimeError("glibc refused the mallopt settings; run the measurement "
                           "without keep_memory")


def _profiled_steps(model_kwargs: dict, cuts: list[int], batch_size: int,
                    micro_batches: int, steps: int, keep_memory: bool) -> list:
    """Inside a rank: the process's first GPipe step, then a warm-up and ``steps`` timed
    ones, with a :class:`ProfiledTimeline`: per step, its :class:`ProfiledEvent` list."""
    if keep_memory:
        keep_freed_memory()
    step = _stage_runner(model_kwargs, cuts, batch_size)
    first = ProfiledTimeline(dist.get_rank())
    dist.barrier()
    step(micro_batches, first)
    _, timelines = _time_steps(step, micro_batches, steps, timeline_type=ProfiledTimeline)
    return [t.profiled_events() for t in [first, *timelines]]


def _median_costs(events: Sequence[ProfiledEvent]) -> dict:
    return {"wall_ms": 1e3 * statistics.median(e.end - e.start for e in events),
            "cpu_ms": 1e3 * statistics.median(e.cpu_seconds for e in events),
            "page_faults": statistics.median(e.page_faults for e in events)}


def first_backward_costs(micro_batches: int = 8, steps: int = 9, keep_memory: bool = False,
                         ranks: int = 2, batch_size: int = 64, channels: int = 64,
                         depth: int = 9, image_size: int = 16) -> dict:
    """What each rank's first backward pass of a GPipe step costs, against its other
    backward passes and its forward passes: medians over ``steps`` timed steps (after a
    warm-up) of the wall time, the CPU time and the page faults of each; with
    ``keep_memory`` the allocator keeps what it frees (:func:`keep_freed_memory`).

    Returns ``{"settings", "ranks": [{"first_backward": {"wall_ms", "cpu_ms",
    "page_faults"}, "other_backwards", "forwards", "first_to_other": wall-time ratio,
    "process_first_backward": the same for the first backward pass the process ever ran
    (in its first step, which the timed steps leave out)}, one per rank], "gradient_gap_ms",
    "gradient_gap_min_ms"}``, the gap (median and smallest over the steps) being how long
    after rank 1 finished its first backward pass of a step rank 0 started its own:
    the gradient's way from one to the other, idle time. A gap above 0 shows that rank
    0's box starts after the gradient it needs exists: the wait is not in the box.
    """
    micro_batch_size(batch_size, micro_batches)
    if micro_batches < 2:
        raise ValueError("first_backward_costs compares the first backward pass with the "
                         "others: use at least 2 micro-batches")
    model_kwargs = _model_kwargs(channels, depth, image_size)
    cuts = _equal_flop_cuts(model_kwargs, ranks)
    # CPU ranks on every machine, as in measure_gpipe: the CPU pipeline it explains.
    per_rank = launch(_profiled_steps, model_kwargs, cuts, batch_size, micro_batches, steps,
                      keep_memory, nprocs=ranks, backend="gloo", return_all=True)
    summary = []
    for process_first, *rank_steps in per_rank:
        backwards = [[e for e in events if e.kind == "backward"] for events in rank_steps]
        first = _median_costs([b[0] for b in backwards])
        others = _median_costs([e for b in backwards for e in b[1:]])
        summary.append({
            "first_backward": first, "other_backwards": others,
            "forwards": _median_costs([e for events in rank_steps for e in events
                                       if e.kind == "forward"]),
            "first_to_other": first["wall_ms"] / others["wall_ms"],
            "process_first_backward": _median_costs(
                [next(e for e in process_first if e.kind == "backward")])})
    gaps = [next(e for e in zero if e.kind == "backward").start
            - next(e for e in one if e.kind == "backward").end
            for zero, one in zip(per_rank[0][1:], per_rank[1][1:], strict=True)]
    return {"settings": {"ranks": ranks, "micro_batches": micro_batches, "steps": steps,
                         "keep_memory": keep_memory, "batch_size": batch_size,
                         **model_kwargs, "cuts": cuts},
            "ranks": summary, "gradient_gap_ms": 1e3 * statistics.median(gaps),
            "gradient_gap_min_ms": 1e3 * min(gaps)}


# ------------------------------------------------------ the library's interleaving


LIBRARY_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")


def interleaved_step(images: torch.Tensor, labels: torch.Tensor, cuts: list[int],
                     micro_batches: int, seed: int = 0,
                     schedule: str = "Interleaved1F1B") -> tuple[float, dict]:
    """Inside one of K ranks: one training step of the tutorial CNN cut at ``cuts`` into 2K
    stages, run by ``torch.distributed.pipelining``'s ``Schedule<schedule>``. Rank r
    holds two *virtual* stages: r and r + K (round-robin, for ``Interleaved1F1B`` and
    ``InterleavedZeroBubble``), or r and 2K - 1 - r (the V shape of ``ZBVZeroBubble``,
    which puts the first and the last stage on rank 0). Returns the batch's mean loss
    (on every rank) and this rank's gradients by parameter name, to compare with the
    unsplit model."""
    import torch.nn.functional as F
    from torch.distributed import pipelining

    from ..models import SeedCNN, as_sequential

    rank, world = dist.get_rank(), dist.get_world_size()
    if len(cuts) + 1 != 2 * world:
        raise ValueError(f"{world} ranks with 2 virtual stages each need {2 * world - 1} "
                         f"cuts, got {len(cuts)}")
    if schedule not in LIBRARY_SCHEDULES:
        raise ValueError(f"schedule must be one of {LIBRARY_SCHEDULES}, got {schedule!r}")
    torch.manual_seed(seed)
    model = SeedCNN()
    pieces = split_sequential(as_sequential(model), cuts)
    mine = (rank, 2 * world - 1 - rank) if schedule == "ZBVZeroBubble" else (rank, rank + world)
    stages = [pipelining.PipelineStage(pieces[index], index, len(pieces), torch.device("cpu"))
              for index in mine]
    runner = getattr(pipelining, f"Schedule{schedule}")(
        stages, n_microbatches=micro_batches, loss_fn=F.cross_entropy)
    first, last = 0 in mine, len(pieces) - 1 in mine
    losses = []
    runner.step(*([images] if first else []), **({"target": labels, "losses": losses}
                                                 if last else {}))
    loss = torch.tensor(sum(x.item() for x in losses) / micro_batches if losses else 0.0)
    owner = torch.tensor(rank if last else -1)
    dist.all_reduce(owner, op=dist.ReduceOp.MAX)  # the rank holding the last stage
    dist.broadcast(loss, src=int(owner))
    return loss.item(), {name: p.grad for name, p in model.named_parameters()
                         if p.grad is not None}
