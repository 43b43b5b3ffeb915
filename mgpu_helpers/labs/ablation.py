"""Chapter 08's ablation: training throughput with each optimisation switched off in turn,
judged against an A/A control instead of a fixed threshold.

The tuned configuration ("all on") switches every optimisation on; each variant switches
exactly one off. Every run is :func:`mgpu_helpers.labs.throughput.timed_epoch` (chapter 05's DDP
pipeline) on the ranks :func:`measure` is given (2 CPU ranks by default).

How a shared, drifting machine is kept from deciding the verdicts:

* **Interleaved rounds.** A round measures every variant once, in one launch of the
  ranks, in the order :func:`round_order` gives: even rounds forward, odd rounds
  reversed, each pair of rounds rotated. Slow drift then hits every variant alike
  instead of whichever happened to run last, and over a pair of rounds every variant's
  mean position in the round is the same.
* **An A/A control.** "All on" is measured twice per round, half a round apart
  (:data:`BASELINE` and :data:`CONTROL`): the same configuration, so the two runs differ
  by noise alone.
* **The noise band.** ``h = max over rounds of |log(control / baseline)|``, the largest
  disagreement of the two identical runs in any round; the band is
  ``[exp(-h), exp(h)]`` around 1.0x (:func:`noise_band`).
* **Ratios.** In each round, a variant's throughput over the geometric mean of that
  round's two "all on" runs (:func:`round_ratios`).
* **Verdicts** (:func:`verdict`), about the optimisation the variant switches off:
  "pays" when the ratio is below the band in *every* round (switching it off was slower,
  by more than the A/A control ever differed from itself), "costs" when it is above the
  band in every round, and "within noise" otherwise: inside the band in some round, or
  on different sides in different rounds.

Not ablated, for the reasons given under :data:`SWITCHED_OFF`: the overlap of DDP's
buckets, ``gradient_as_bucket_view`` and ``static_graph`` (all three stay on in "all on").

What "without gradient accumulation" compares: every variant keeps the micro-batch
(``batch_size`` per rank and forward pass), so "all on", which accumulates 4
micro-batches per optimizer step, trains with a 4 times larger global batch and takes a
quarter of the optimizer steps (and gradient all-reduces) per epoch. Its verdict measures
fewer steps per sample, not a free speed-up; at a fixed global batch, accumulation is a
memory workaround (and a changed global batch needs its learning rate tuned again).

:func:`profile_phases` reads chapter 08's ``torch.profiler`` record of a few steps.
"""

from __future__ import annotations

import fnmatch
import gc
import math
import random
import statistics
from dataclasses import asdict, replace

from ..data import prepare_digits
from ..launcher import launch
from .throughput import TrainingOptions, timed_epoch

# The tuned configuration: every optimisation on. bucket_cap_mb=25 is DDP's default bucket
# size (in MiB, despite the name): the tutorial CNN's gradients fall into two buckets (the fc
# layers' 32.0 MiB first, then the convolutions' 0.15 MiB), so the fc bucket's all-reduce
# overlaps the convolutions' backward. DDP never splits a tensor: fc1.weight alone is
# 32 MiB, over the cap, and closes the first bucket. (Passed explicitly, 25 also caps DDP's
# first bucket, which is 1 MiB by default; for this model both give the same two buckets.)
TUNED = TrainingOptions(workers=1, pin_memory=True, amp="auto", channels_last=True,
                        bucket_cap_mb=25, gradient_as_bucket_view=True, static_graph=True,
                        accumulate=4)

BASELINE = "all on (tuned)"
CONTROL = "all on again (A/A control)"

# What "off" means for each optimisation, and why it may only pay on GPUs.
SWITCHED_OFF = {
    "loader workers": ({"workers": 0}, None),
    "pinned memory": ({"pin_memory": False},
                      "only with a GPU: pinning speeds up host-to-GPU copies; without one "
                      "there is no copy and PyTorch ignores it, so this variant behaves "
                      "exactly like all on (a second A/A control)"),
    "mixed precision": ({"amp": None},
                        "pays on GPUs with tensor cores (bf16, or fp16 with a scaler on "
                        "older GPUs); on a CPU it can pay where the CPU has native bf16 "
                        "instructions (the flags avx512_bf16 or amx_bf16 in /proc/cpuinfo); "
                        "without them amp='auto' trains in float32 (emulated bf16 would be "
                        "about 18x slower), so this variant changes nothing there"),
    "channels_last": ({"channels_last": False},
                      "pays mostly on GPUs (tensor cores want NHWC); on CPUs it depends on "
                      "the convolution kernels"),
    "gradient accumulation x4": ({"accumulate": 1}, None),
}
# Not in variants(): the overlap of DDP's buckets, gradient_as_bucket_view and
# static_graph act once per all-reduce or per optimizer step, and "all on" accumulates 4
# batches per step: chapter 08's quick run (3 batches per rank) times a single
# all-reduce, make bench's (12 batches) three. ddp_option_variants() times them without
# accumulation instead (`python benchmarks/ablation.py --ddp-options`); on the 2-core
# machine none came out of the A/A band: gloo's all-reduce runs on the same 2 cores as
# the backward it would overlap, and the copy that gradient_as_bucket_view saves (32 MiB
# per step) and static_graph's bookkeeping are small against a step.
DDP_OPTIONS_OFF = {
    # one bucket is only ready when the whole backward has finished: its all-reduce
    # cannot overlap any of the backward
    "overlap (one 100 MB bucket)": {"bucket_cap_mb": 100},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": False},
    "static_graph": {"static_graph": False},
}


def variants() -> dict[str, TrainingOptions]:
    """The tuned configuration, its A/A control (the same options, measured again), then
    one variant per optimisation switched off. The control sits in the middle, so that
    within a round it runs half a round after the baseline."""
    off = {f"without {name}": replace(TUNED, **change)
           for name, (change, _) in SWITCHED_OFF.items()}
    names = list(off)
    half = len(names) // 2
    return ({BASELINE: TUNED} | {name: off[name] for name in names[:half]}
            | {CONTROL: TUNED} | {name: off[name] for name in names[half:]})


def ddp_option_variants() -> dict[str, TrainingOptions]:
    """"All on" without accumulation (one all-reduce per batch), its A/A control, and one
    variant per DDP option of :data:`DDP_OPTIONS_OFF` switched off, in the order of
    :func:`variants`."""
    tuned = replace(TUNED, accumulate=1)
    off = {f"without {name}": replace(tuned, **change)
           for name, change in DDP_OPTIONS_OFF.items()}
    names = list(off)
    half = len(names) // 2
    return ({BASELINE: tuned} | {name: off[name] for name in names[:half]}
            | {CONTROL: tuned} | {name: off[name] for name in names[half:]})


def round_order(names: list[str], round_index: int, rounds: int) -> list[str]:
    """The order in which round ``round_index`` (of ``rounds``) measures ``names``.

    Rounds come in pairs: the second of a pair runs the first's order backwards, so over
    the pair every name's mean position is the same (linear drift cancels); each pair is
    rotated further, so that different names open the round.
    """
    if rounds < 1 or not 0 <= round_index < rounds:
        raise ValueError(f"round_index must be in 0..{rounds - 1}, got {round_index}")
    pairs = (rounds + 1) // 2
    shift = (round_index // 2) * len(names) // pairs
    order = list(names[shift:]) + list(names[:shift])
    return order[::-1] if round_index % 2 else order


def noise_band(baseline: list[float], control: list[float]) -> float:
    """``h``: the largest ``|log(control / baseline)|`` over the rounds (the A/A spread).
    The band is ``[exp(-h), exp(h)]``."""
    if len(baseline) != len(control) or len(baseline) < 2:
        raise ValueError("the A/A control needs at least 2 rounds, with one baseline and "
                         f"one control run each; got {len(baseline)} and {len(control)}")
    if min(baseline + control) <= 0:
        raise ValueError("throughputs must be positive")
    return max(abs(math.log(c / b)) for b, c in zip(baseline, control, strict=True))


def round_ratios(runs: list[float], baseline: list[float],
                 control: list[float]) -> list[float]:
    """Per round: ``runs[r]`` over the geometric mean of that round's two all-on runs."""
    if not len(runs) == len(baseline) == len(control):
        raise ValueError("one run per round for the variant, the baseline and the control")
    return [v / math.sqrt(b * c) for v, b, c in zip(runs, baseline, control, strict=True)]


def verdict(ratios: list[float], half_width: float) -> str:
    """"pays" if every ratio is below ``exp(-half_width)``, "costs" if every ratio is above
    ``exp(half_width)``, else "within noise". (For a variant that switches an
    optimisation off: below the band means the optimisation pays.)"""
    if not ratios or half_width < 0:
        raise ValueError("need at least one ratio and a band half-width >= 0")
    low, high = math.exp(-half_width), math.exp(half_width)
    if all(r < low for r in ratios):
        return "pays"
    if all(r > high for r in ratios):
        return "costs"
    return "within noise"


def judge(runs: dict[str, list[float]]) -> tuple[float, list[dict]]:
    """From every name's runs (one per round, same round order): the band's half-width
    ``h`` and a row per name (baseline, control, then the variants) with its per-round
    ratios, median ratio and verdict (None for the baseline and the control, which
    define the band)."""
    h = noise_band(runs[BASELINE], runs[CONTROL])
    rows = []
    names = [BASELINE, CONTROL] + [name for name in runs if name not in (BASELINE, CONTROL)]
    for name in names:
        values = runs[name]
        ratios = round_ratios(values, runs[BASELINE], runs[CONTROL])
        rows.append({"variant": name, "runs": values, "ratios": ratios,
                     "samples_per_s": statistics.median(values),
                     "relative_to_tuned": statistics.median(ratios),
                     "verdict": None if name in (BASELINE, CONTROL) else verdict(ratios, h)})
    return h, rows


def false_verdict_rate(rounds: int, trials: int = 20_000, seed: int = 0,
                       variants: int = 1) -> float:
    """How often :func:`verdict` calls a variant that changes nothing "pays" or "costs";
    with ``variants`` > 1, how often at least one of that many such variants, judged
    against the same band, gets a verdict (the multiple-comparison effect).

    Simulated: in every round the baseline, the control and the variants share one drift
    factor and each gets its own independent log-normal noise. Both cancel out of the
    rule's scale (the band and the ratios are ratios), so the rate depends on the number
    of rounds (and variants) only, not on how noisy the machine is.
    """
    if rounds < 2 or trials < 1 or variants < 1:
        raise ValueError("need rounds >= 2, trials >= 1 and variants >= 1")
    rng = random.Random(seed)
    false = 0
    for _ in range(trials):
        drift = [math.exp(rng.gauss(0, 0.2)) for _ in range(rounds)]
        baseline, control, *nulls = ([d * math.exp(rng.gauss(0, 0.05)) for d in drift]
                                     for _ in range(2 + variants))
        h = noise_band(baseline, control)
        false += any(verdict(round_ratios(variant, baseline, control), h) != "within noise"
                     for variant in nulls)
    return false / trials


def _timed_round(options: list[TrainingOptions], per_rank_samples: int, batch_size: int,
                 warmup_batches: int) -> list[float]:
    """Inside a rank: one timed epoch per entry of ``options``, in that order."""
    rates = []
    for choice in options:
        rates.append(timed_epoch(choice, per_rank_samples, batch_size, warmup_batches))
        gc.collect()  # the previous run's loader workers are gone before the next starts
    return rates


def measure(per_rank_samples: int = 256, batch_size: int = 32, rounds: int = 3,
            warmup_batches: int = 4, nprocs: int = 2, backend: str = "gloo",
            progress=None, options: dict[str, TrainingOptions] | None = None) -> dict:
    """Throughput of every variant over ``rounds`` interleaved rounds, and the verdicts.

    Each round is one launch of ``nprocs`` ranks that runs every variant once, in
    :func:`round_order`. ``progress(round_index, order, rates)`` is called after each
    round. ``options`` (default :func:`variants`) names what is measured; it must hold
    :data:`BASELINE` and :data:`CONTROL`. Returns ``{"rows": [{"variant", "options",
    "runs", "ratios", "samples_per_s", "relative_to_tuned", "verdict", "gpu_only"}],
    "band": {"half_width_log", "low", "high"}, "orders": [...], "rounds",
    "per_rank_samples", "batch_size", "ranks"}``.
    """
    if rounds < 2:
        raise ValueError(f"rounds must be >= 2 (the A/A noise band needs two), got {rounds}")
    if warmup_batches * batch_size > per_rank_samples:
        raise ValueError(f"the warm-up ({warmup_batches} x {batch_size}) must fit in the "
                         f"{per_rank_samples} samples per rank")
    options = variants() if options is None else options
    if not {BASELINE, CONTROL} <= options.keys():
        raise ValueError(f"options must hold {BASELINE!r} and {CONTROL!r} (the A/A pair)")
    prepare_digits(progress=False)  # once, here: the ranks inherit it instead of each round
    names = list(options)
    runs = {name: [] for name in names}
    orders = []
    for round_index in range(rounds):
        order = round_order(names, round_index, rounds)
        rates = launch(_timed_round, [options[name] for name in order], per_rank_samples,
                       batch_size, warmup_batches, nprocs=nprocs, backend=backend)
        measured = dict(zip(order, rates, strict=True))
        for name in names:
            runs[name].append(measured[name])
        orders.append(order)
        if progress is not None:
            progress(round_index, order, measured)
    h, rows = judge(runs)
    reasons = {f"without {name}": reason for name, (_, reason) in SWITCHED_OFF.items()}
    for row in rows:
        row["options"] = asdict(options[row["variant"]])
        row["gpu_only"] = reasons.get(row["variant"])
    return {"rows": rows, "band": {"half_width_log": h, "low": math.exp(-h),
                                   "high": math.exp(h)},
            "orders": orders, "rounds": rounds, "per_rank_samples": per_rank_samples,
            "batch_size": batch_size, "ranks": nprocs}


COLOURS = {None: "#5d6d7e", "pays": "#c0392b", "costs": "#7aa95c", "within noise": "#b8c2cc"}


def plot(result: dict, ax=None):
    """Horizontal bars: each variant's median ratio to all on; dots: each round's ratio;
    the shaded band: the A/A control's noise. Coloured by verdict."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows, band = result["rows"], result["band"]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.4 * len(rows) + 1.6))
    positions = list(range(len(rows)))[::-1]
    ax.axvspan(band["low"], band["high"], color="#f4d03f", alpha=0.35, lw=0)
    for y, row in zip(positions, rows, strict=True):
        ax.barh(y, row["relative_to_tuned"], color=COLOURS[row["verdict"]], height=0.6)
        ax.plot(row["ratios"], [y] * len(row["ratios"]), "o", color="black", ms=3)
        ax.annotate(f"{row['samples_per_s']:.0f}/s", (max(row["ratios"]), y), xytext=(5, 0),
                    textcoords="offset points", va="center", fontsize=8)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_yticks(positions, [row["variant"] for row in rows], fontsize=8)
    ax.set_xlabel("throughput relative to all on (bar: median over rounds; dots: each round)",
                  fontsize=9)
    largest = max(max(row["ratios"]) for row in rows)
    ax.set_xlim(0, max(largest, band["high"]) * 1.2)
    ax.legend(handles=[
        Patch(color="#f4d03f", alpha=0.35, label=f"A/A noise band {band['low']:.2f}-"
                                                f"{band['high']:.2f}x"),
        Patch(color=COLOURS["pays"], label="pays (off: slower in every round)"),
        Patch(color=COLOURS["costs"], label="costs (off: faster in every round)"),
        Patch(color=COLOURS["within noise"], label="within noise")],
        fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(f"Ablation: {result['ranks']} DDP ranks, batch {result['batch_size']} per "
                 f"rank, {result['rounds']} interleaved rounds", fontsize=10)
    return ax


def bucket_layouts(caps: list[int | None], steps: int = 3) -> list[list[dict]]:
    """Inside a rank: for each ``bucket_cap_mb`` in ``caps`` (None: DDP's own default),
    the tutorial CNN's gradient buckets in the order backward hands them to the all-reduce,
    as ``{"parameters": [names], "mib": size in MiB (2**20 bytes, the unit of
    bucket_cap_mb), "megabytes": size in MB (10**6 bytes)}``.

    Read by a communication hook in step ``steps`` (default: the 3rd): with
    ``static_graph`` (as in :data:`TUNED`) DDP rebuilds its buckets after two steps, in
    the order the gradients became ready.
    """
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..models import SeedCNN

    layouts = []
    for cap in caps:
        torch.manual_seed(0)
        module = SeedCNN()
        names = {id(p): name for name, p in module.named_parameters()}
        model = DDP(module, bucket_cap_mb=cap, static_graph=True,
                    gradient_as_bucket_view=True)
        seen = []

        def record(state, bucket, seen=seen, names=names):
            buffer = bucket.buffer()
            size = buffer.numel() * buffer.element_size()
            seen.append({"parameters": [names[id(p)] for p in bucket.parameters()],
                         "mib": size / 2**20, "megabytes": size / 1e6})
            return default_hooks.allreduce_hook(state, bucket)

        model.register_comm_hook(None, record)
        for _ in range(steps):
            seen.clear()
            model(torch.randn(4, 3, 32, 32)).sum().backward()
        layouts.append(list(seen))
    return layouts


# ------------------------------------------------------------------ the profile

#: What chapter 08's profile counts as the gradient all-reduce: on CPU ranks, gloo's work
#: item (``cpu_time_total``: from the call to its completion on gloo's thread, waiting for
#: the other ranks included); on GPUs, NCCL's kernels (``device_time_total``: the time the
#: kernels ran on the GPU; older NCCL names them ``ncclKernel_...``). The
#: ``nccl:all_reduce`` label is left out on purpose: it times only the CPU's enqueueing.
GLOO_ALL_REDUCE = "gloo:all_reduce"
NCCL_KERNEL_PREFIXES = ("ncclDevKernel", "ncclKernel")


def profile_phases(events, steps: int, on_gpu: bool,
                   labels: tuple[str, ...] = ("data", "forward", "backward", "optimizer")
                   ) -> dict[str, float]:
    """Milliseconds per step from a profiler's ``key_averages()`` over ``steps`` steps.

    Each of ``labels`` (a ``record_function`` range): its ``cpu_time_total``, the host's
    time in the range (on a GPU, the time to issue the work, not to run it). Then
    ``"all-reduce"``: with ``on_gpu``, the summed ``device_time_total`` of the NCCL
    kernels (events whose key starts with one of :data:`NCCL_KERNEL_PREFIXES`);
    otherwise the ``cpu_time_total`` of :data:`GLOO_ALL_REDUCE`.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    events = list(events)
    phases = {label: sum(e.cpu_time_total for e in events if e.key == label) / 1e3 / steps
              for label in labels}
    if on_gpu:
        total = sum(e.device_time_total for e in events
                    if e.key.startswith(NCCL_KERNEL_PREFIXES))
    else:
        total = sum(e.cpu_time_total for e in events if e.key == GLOO_ALL_REDUCE)
    phases["all-reduce"] = total / 1e3 / steps
    return phases


# ------------------------------------------------------------------ exact resume

def checkpoint_differences(a, b, ignore: tuple[str, ...] = (), where: str = "") -> list[str]:
    """Where two checkpoints (as ``torch.load`` returns them) differ, bitwise: a list of
    paths such as ``"/model/fc1.weight"`` or ``"/rng/1/torch"``, empty when they are equal.

    Dicts must have the same keys, lists and tuples the same length, tensors the same
    dtype, shape and bytes (so ``-0.0`` differs from ``0.0`` and a NaN equals itself),
    anything else must compare equal with ``==``. A list or tuple of plain values (such as
    Python's random state) is reported once, by its own path. Paths matching one of
    ``ignore`` (``fnmatch`` patterns, e.g. ``"/rng/*/python"``) are skipped.

    Chapter 08 compares the last checkpoint of a run that was stopped and resumed with an
    uninterrupted run's: weights, optimizer state, LR schedule, epoch, sampler epoch and
    every rank's random-number states.
    """
    import torch

    if any(fnmatch.fnmatchcase(where, pattern) for pattern in ignore):
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where or '/'}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [found for key in a
                for found in checkpoint_differences(a[key], b[key], ignore, f"{where}/{key}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        found = [inner for index, (x, y) in enumerate(zip(a, b, strict=True))
                 for inner in checkpoint_differences(x, y, ignore, f"{where}/{index}")]
        plain = not any(isinstance(x, (dict, list, tuple, torch.Tensor)) for x in a)
        return [where] if found and plain else found
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = (a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.detach().cpu().reshape(-1).contiguous().view(torch.uint8),
                                b.detach().cpu().reshape(-1).contiguous().view(torch.uint8)))
        return [] if same else [where]
    return [] if type(a) is type(b) and a == b else [where]
