"""Weak-scaling measurement of DDP training: chapter 05's plot and ``benchmarks/ddp_scaling.py``.

Weak scaling keeps the work *per rank* fixed (same batch size, same number of samples
per rank) and adds ranks. Perfect scaling multiplies throughput by the number of ranks;
the efficiency ``throughput(N ranks) / (N x throughput(1 rank))`` says how much of that
survives gradient all-reduces, stragglers and shared hardware.

Every configuration runs the chapter's full pipeline,
:func:`mgpu_helpers.labs.throughput.timed_epoch` with plain DDP options.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..launcher import launch
from .throughput import COMM_HOOKS, TrainingOptions, timed_epoch


@dataclass(frozen=True)
class Setup:
    """One configuration: ``ranks`` processes with ``threads`` intra-op threads each,
    optionally with a DDP communication hook: ``"fp16"`` sends gradients as float16 (half
    the bytes) and averages them back into float32; ``"none"`` exchanges nothing, which
    measures the ceiling that the hardware alone sets for N processes."""

    ranks: int
    threads: int
    comm_hook: str | None = None
    accumulate: int = 1

    def __post_init__(self):
        if min(self.ranks, self.threads, self.accumulate) < 1:
            raise ValueError(f"ranks, threads and accumulate must be >= 1, got {self.ranks}, "
                             f"{self.threads}, {self.accumulate}")
        if self.comm_hook is not None and self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook must be None or one of {sorted(COMM_HOOKS)}, "
                             f"got {self.comm_hook!r}")

    @property
    def label(self) -> str:
        rank_word = "rank" if self.ranks == 1 else "DDP ranks"
        thread_word = "thread" if self.threads == 1 else "threads"
        each = " each" if self.ranks > 1 else ""
        hook = {None: "", "fp16": ", fp16 gradients",
                "none": ", no gradient exchange"}[self.comm_hook]
        if self.accumulate > 1:
            hook += f", no_sync x{self.accumulate}"
        return f"{self.ranks} {rank_word}, {self.threads} {thread_word}{each}{hook}"


DEFAULT_SETUPS = (Setup(1, 1), Setup(1, 2), Setup(2, 1), Setup(2, 1, "none"),
                  Setup(2, 1, "fp16"), Setup(1, 1, accumulate=4), Setup(2, 1, accumulate=4),
                  Setup(2, 1, "fp16", accumulate=4))


def measure(setups=DEFAULT_SETUPS, per_rank_samples: int = 512, batch_size: int = 32,
            repeats: int = 3, warmup_batches: int = 2, backend: str = "gloo",
            progress=None) -> dict:
    """Throughput (samples/s, all ranks together) of each setup, ``repeats`` times each.

    The default measures CPU ranks over gloo on any machine. On a GPU node pass
    ``backend="auto"`` (one GPU per rank: ranks <= GPUs; ``threads`` then only sets the
    CPU threads of each rank's data loading and Python side).

    The setups take turns (round-robin), so a slow spell of the machine hits all of them
    alike; the median of the repeats is reported.

    Returns:
        ``{"setups": [{"label", "ranks", "threads", "comm_hook", "runs", "samples_per_s",
        "efficiency"}], "per_rank_samples", "batch_size", "repeats"}``; efficiency
        per row (see :func:`add_efficiency`).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    runs = {setup: [] for setup in setups}
    for round_index in range(repeats):
        for setup in setups:
            options = TrainingOptions(accumulate=setup.accumulate, comm_hook=setup.comm_hook)
            runs[setup].append(launch(timed_epoch, options, per_rank_samples, batch_size,
                                      warmup_batches, nprocs=setup.ranks, backend=backend,
                                      cpu_threads=setup.threads))
            if progress is not None:
                progress(round_index, setup, runs[setup][-1])
    rows = [{"label": s.label, "ranks": s.ranks, "threads": s.threads,
             "comm_hook": s.comm_hook, "accumulate": s.accumulate, "runs": runs[s],
             "samples_per_s": statistics.median(runs[s])} for s in setups]
    add_efficiency(rows)
    return {"setups": rows, "per_rank_samples": per_rank_samples, "batch_size": batch_size,
            "repeats": repeats}


def _baseline(rows: list[dict], row: dict) -> dict | None:
    """The 1-rank, 1-thread, no-hook row with the same accumulation as ``row``."""
    for other in rows:
        if (other["ranks"], other["threads"], other.get("comm_hook")) == (1, 1, None) and \
                other.get("accumulate", 1) == row.get("accumulate", 1):
            return other
    return None


def add_efficiency(rows: list[dict]) -> None:
    """Set ``row["efficiency"]`` on every multi-rank, one-thread row: its throughput /
    (ranks x the throughput of 1 rank, 1 thread, no hook, same accumulation). Like for
    like: accumulation also saves optimizer steps, which helps one rank as well.

    With repeats, the ratio is taken within each round (the setups of one round ran
    back to back, under the same conditions) and the median of those ratios is
    reported, in ``row["efficiency"]``; the ratios themselves go in
    ``row["efficiency_runs"]``. None on other rows, or when the baseline is missing.
    """
    for row in rows:
        base = _baseline(rows, row)
        row["efficiency"] = None
        if base is None or row["ranks"] == 1 or row["threads"] != 1:
            continue
        if len(row["runs"]) == len(base["runs"]):
            ratios = [mine / (row["ranks"] * theirs)
                      for mine, theirs in zip(row["runs"], base["runs"], strict=True)]
        else:
            ratios = [row["samples_per_s"] / (row["ranks"] * base["samples_per_s"])]
        row["efficiency_runs"] = ratios
        row["efficiency"] = statistics.median(ratios)


def plot(result: dict, ax=None):
    """Horizontal bars: throughput per setup with the range of its repeats; for each
    multi-rank setup a tick at its ideal (ranks x its baseline) and its efficiency."""
    import matplotlib.pyplot as plt

    rows = result["setups"]
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.55 * len(rows) + 1.2))
    positions = list(range(len(rows)))[::-1]
    for y, row in zip(positions, rows, strict=True):
        value = row["samples_per_s"]
        colour = "#9aa5b1" if row["ranks"] == 1 else "#2a7ab0"
        if row.get("comm_hook") == "none":
            colour = "#d9a441"
        ax.barh(y, value, color=colour)
        ax.errorbar(value, y, xerr=[[value - min(row["runs"])], [max(row["runs"]) - value]],
                    color="black", capsize=3)
        text = f"{value:.0f}/s"
        base = _baseline(rows, row)
        if row.get("efficiency") is not None and base is not None:
            ideal = row["ranks"] * base["samples_per_s"]
            ax.plot([ideal, ideal], [y - 0.4, y + 0.4], color="#c0392b", lw=2)
            text += f"   efficiency {row['efficiency']:.2f}"
        ax.annotate(text, (max(row["runs"]), y), xytext=(6, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.plot([], [], color="#c0392b", lw=2, label="ideal: ranks x (1 rank, 1 thread)")
    ax.plot([], [], " ", label="efficiency: median of the rounds' ratios")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_yticks(positions, [row["label"] for row in rows], fontsize=8)
    ax.set_xlabel("training samples / s, all ranks together")
    ax.set_xlim(0, max(max(r["runs"]) for r in rows) * 1.45)
    ax.set_title(f"DDP weak scaling: tutorial CNN, batch {result['batch_size']} per rank, "
                 f"median of {result['repeats']}", fontsize=10)
    return ax
