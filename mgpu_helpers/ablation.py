"""Chapter 07's ablation: training throughput with each optimisation switched off in turn.

The tuned configuration switches every optimisation on; each variant switches exactly
one off. Every run is chapter 04's DDP pipeline (DistributedSampler, augmenting
DataLoader, DDP, ``train_one_epoch`` with global metrics) on 2 ranks, timed over one
epoch of ``per_rank_samples`` per rank after a short warm-up.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from .data import ImageDataset, loader_generator, prepare_digits, seed_worker
from .dist import device as rank_device
from .dist import rank, world_size
from .launch import launch
from .models import SeedCNN
from .recipe import AMP_DTYPES, AUGMENT, spread_subset
from .train import train_one_epoch


@dataclass(frozen=True)
class Options:
    """The optimisations, all on by default (the tuned configuration)."""

    workers: int = 1                     # DataLoader worker processes per rank
    pin_memory: bool = True              # page-locked batches: faster, async copies to GPU
    amp: str | None = "bfloat16"         # autocast dtype, None for float32
    channels_last: bool = True           # NHWC memory layout for convolutions
    bucket_cap_mb: int = 100             # DDP bucket size: one bucket for all gradients
    gradient_as_bucket_view: bool = True  # gradients live in the buckets: no copy
    static_graph: bool = True            # DDP may cache its bookkeeping after step 1
    accumulate: int = 4                  # batches per all-reduce and optimizer step

    def __post_init__(self):
        if self.workers < 0 or self.bucket_cap_mb < 1 or self.accumulate < 1:
            raise ValueError("workers must be >= 0, bucket_cap_mb and accumulate >= 1")
        if self.amp is not None and self.amp not in AMP_DTYPES:
            raise ValueError(f"amp must be None or one of {sorted(AMP_DTYPES)}")


# What "off" means for each optimisation, and why it may only pay on GPUs.
SWITCHED_OFF = {
    "loader workers": ({"workers": 0}, None),
    "pinned memory": ({"pin_memory": False},
                      "only with a GPU: pinning speeds up host-to-GPU copies; without one "
                      "there is no copy, and PyTorch ignores it"),
    "mixed precision (bf16)": ({"amp": None},
                               "pays on GPUs with tensor cores; on CPUs without native bf16 "
                               "instructions the conversions cost more than they save"),
    "channels_last": ({"channels_last": False},
                      "pays mostly on GPUs (tensor cores want NHWC); on CPUs it depends on "
                      "the convolution kernels"),
    "one big DDP bucket": ({"bucket_cap_mb": 25}, None),
    "gradient_as_bucket_view": ({"gradient_as_bucket_view": False}, None),
    "static_graph": ({"static_graph": False}, None),
    "gradient accumulation x4": ({"accumulate": 1}, None),
}


def variants() -> dict[str, Options]:
    """The tuned configuration, then one variant per optimisation switched off."""
    tuned = Options()
    return {"all on (tuned)": tuned} | {
        f"without {name}": replace(tuned, **change) for name, (change, _) in
        SWITCHED_OFF.items()}


def _throughput(options: Options, per_rank_samples: int, batch_size: int,
                warmup_batches: int) -> float:
    """Inside a rank: samples/s (all ranks) over one epoch with these options."""
    device = rank_device()
    dataset = ImageDataset(prepare_digits(progress=False) / "train", transform=AUGMENT)
    dataset = spread_subset(dataset, per_rank_samples * world_size())
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    torch.manual_seed(0)
    model = SeedCNN().to(device)
    if options.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=options.bucket_cap_mb,
                gradient_as_bucket_view=options.gradient_as_bucket_view,
                static_graph=options.static_graph)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader_args = {"batch_size": batch_size, "num_workers": options.workers,
                   "pin_memory": options.pin_memory and device.type == "cuda",
                   "worker_init_fn": seed_worker,
                   "persistent_workers": options.workers > 0}
    epoch_args = {"progress": False, "accumulate": options.accumulate,
                  "amp_dtype": AMP_DTYPES.get(options.amp),
                  "channels_last": options.channels_last}
    warmup = Subset(dataset, range(rank() * warmup_batches * batch_size,
                                   (rank() + 1) * warmup_batches * batch_size))
    # static_graph records the graph in the first iteration, which must synchronise:
    # warm up without accumulation (no_sync in a first iteration trips DDP's reducer)
    train_one_epoch(model, DataLoader(warmup, **loader_args), optimizer,
                    **(epoch_args | {"accumulate": 1}))
    loader = DataLoader(dataset, sampler=sampler, generator=loader_generator(0, rank()),
                        **loader_args)
    iter(loader)  # start the workers before the clock
    dist.barrier()
    started = time.perf_counter()
    metrics = train_one_epoch(model, loader, optimizer, **epoch_args)
    return metrics.samples / (time.perf_counter() - started)


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
            runs[name].append(launch(_throughput, options, per_rank_samples, batch_size,
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
