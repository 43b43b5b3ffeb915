"""Chapter 07's ablation: training throughput with each optimisation switched off in turn.

The tuned configuration switches every optimisation on; each variant switches exactly
one off. Every run is :func:`mgpu_helpers.throughput.timed_epoch` (chapter 04's DDP
pipeline) on the ranks `measure` is given (2 CPU ranks by default).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace

from .launch import launch
from .throughput import TrainingOptions, timed_epoch

# The tuned configuration: every optimisation on.
TUNED = TrainingOptions(workers=1, pin_memory=True, amp="auto", channels_last=True,
                        bucket_cap_mb=100, gradient_as_bucket_view=True, static_graph=True,
                        accumulate=4)


# What "off" means for each optimisation, and why it may only pay on GPUs.
SWITCHED_OFF = {
    "loader workers": ({"workers": 0}, None),
    "pinned memory": ({"pin_memory": False},
                      "only with a GPU: pinning speeds up host-to-GPU copies; without one "
                      "there is no copy, and PyTorch ignores it"),
    "mixed precision": ({"amp": None},
                        "pays on GPUs with tensor cores (bf16, or fp16 with a scaler on "
                        "older GPUs); on CPUs without native bf16 instructions the "
                        "conversions cost more than they save"),
    "channels_last": ({"channels_last": False},
                      "pays mostly on GPUs (tensor cores want NHWC); on CPUs it depends on "
                      "the convolution kernels"),
    "one big DDP bucket": ({"bucket_cap_mb": 25}, None),
    "gradient_as_bucket_view": ({"gradient_as_bucket_view": False}, None),
    "static_graph": ({"static_graph": False}, None),
    "gradient accumulation x4": ({"accumulate": 1}, None),
}


def variants() -> dict[str, TrainingOptions]:
    """The tuned configuration, then one variant per optimisation switched off."""
    return {"all on (tuned)": TUNED} | {
        f"without {name}": replace(TUNED, **change) for name, (change, _) in
        SWITCHED_OFF.items()}


def measure(per_rank_samples: int = 256, batch_size: int = 32, repeats: int = 1,
            warmup_batches: int = 4, nprocs: int = 2, backend: str = "gloo",
            progress=None) -> dict:
    """Throughput of every variant (round-robin over ``repeats`` rounds; medians).

    Returns ``{"rows": [{"variant", "options", "runs", "samples_per_s",
    "relative_to_tuned", "gpu_only"}], settings...}``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    runs = {name: [] for name in variants()}
    for round_index in range(repeats):
        for name, options in variants().items():
            runs[name].append(launch(timed_epoch, options, per_rank_samples, batch_size,
                                     warmup_batches, nprocs=nprocs, backend=backend))
            if progress is not None:
                progress(round_index, name, runs[name][-1])
    tuned = statistics.median(runs["all on (tuned)"])
    reasons = {f"without {name}": reason for name, (_, reason) in SWITCHED_OFF.items()}
    rows = [{"variant": name, "options": asdict(options), "runs": runs[name],
             "samples_per_s": statistics.median(runs[name]),
             "relative_to_tuned": statistics.median(runs[name]) / tuned,
             "gpu_only": reasons.get(name)} for name, options in variants().items()]
    return {"rows": rows, "per_rank_samples": per_rank_samples, "batch_size": batch_size,
            "repeats": repeats, "ranks": nprocs}


def plot(result: dict, ax=None):
    """Horizontal bars: each variant's throughput relative to the tuned run."""
    import matplotlib.pyplot as plt

    rows = result["rows"]
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.2))
    positions = list(range(len(rows)))[::-1]
    for y, row in zip(positions, rows, strict=True):
        value = row["relative_to_tuned"]
        colour = "#9aa5b1" if row["variant"].startswith("all on") else (
            "#c0392b" if value < 0.97 else "#2a7ab0" if value <= 1.03 else "#7aa95c")
        ax.barh(y, value, color=colour)
        ax.annotate(f"{row['samples_per_s']:.0f}/s", (value, y), xytext=(4, 0),
                    textcoords="offset points", va="center", fontsize=8)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_yticks(positions, [row["variant"] for row in rows], fontsize=8)
    ax.set_xlabel("throughput relative to the tuned configuration "
                  "(red: switching it off hurts; green: it helps)")
    ax.set_xlim(0, max(row["relative_to_tuned"] for row in rows) * 1.2)
    ax.set_title(f"Ablation: {result['ranks']} DDP ranks, batch {result['batch_size']} "
                 f"per rank, median of {result['repeats']}", fontsize=10)
    return ax
