"""One timed epoch of chapter 05's DDP pipeline under given options: the measurement
behind chapter 05's scaling plot (``scaling``) and chapter 08's ablation (``ablation``).

The pipeline: ``DistributedSampler``, augmenting ``DataLoader``, ``DistributedDataParallel``
(also for one rank, so comparisons are like for like), ``train_one_epoch`` with its global
metrics; timed over one epoch of ``per_rank_samples`` per rank after a short warm-up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ..data import ImageDataset, loader_generator, prepare_digits, seed_worker
from ..models import SeedCNN
from ..runtime.precision import AMP_CHOICES, amp_dtype
from ..runtime.ranks import device as rank_device
from ..runtime.ranks import rank, world_size
from ..training.recipe import AUGMENT, spread_subset
from ..training.train import classification_loss, train_one_epoch


def _keep_local_gradients(state, bucket):
    """A DDP communication hook that communicates nothing: each rank keeps its own
    gradients. Not training anyone should do; it measures what the hardware allows
    ranks without any gradient exchange (the ceiling for the scaling efficiency)."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


COMM_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "none": _keep_local_gradients}


@dataclass(frozen=True)
class TrainingOptions:
    """What a timed epoch switches on. The defaults are plain DDP as chapter 05 runs it."""

    workers: int = 0                      # DataLoader worker processes per rank
    pin_memory: bool = False              # page-locked batches (only used with a GPU)
    amp: str | None = None                # autocast: "auto", "bfloat16", "float16"; None: fp32
    channels_last: bool = False           # NHWC memory layout for convolutions
    bucket_cap_mb: int = 25               # DDP bucket size (PyTorch's default)
    gradient_as_bucket_view: bool = False  # gradients live in the buckets: no copy
    static_graph: bool = False            # DDP may cache its bookkeeping after step 1
    accumulate: int = 1                   # batches per all-reduce and optimizer step
    comm_hook: str | None = None          # "fp16": compressed gradients; "none": no exchange

    def __post_init__(self):
        if self.workers < 0 or self.bucket_cap_mb < 1 or self.accumulate < 1:
            raise ValueError("workers must be >= 0, bucket_cap_mb and accumulate >= 1")
        if self.amp is not None and self.amp not in AMP_CHOICES:
            raise ValueError(f"amp must be None or one of {', '.join(AMP_CHOICES)}")
        if self.comm_hook is not None and self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook must be None or one of {sorted(COMM_HOOKS)}, "
                             f"got {self.comm_hook!r}")


class _StartedLoader:
    """A ``DataLoader`` whose iterator is created now, and handed out when the epoch
    iterates it.

    Creating the iterator starts the loader's workers and their prefetching. Calling
    ``iter(loader)`` before the clock and then letting the epoch iterate ``loader`` again
    would not keep that head start: with ``persistent_workers`` the second ``iter``
    resets the workers (``_ResumeIteration``) and drains the batches they had prefetched,
    inside the timed region; without workers it simply starts over.
    """

    def __init__(self, loader: DataLoader):
        self._length = len(loader)
        self._iterator = iter(loader)

    def __len__(self) -> int:
        return self._length

    def __iter__(self):
        return self._iterator


def timed_epoch(options: TrainingOptions, per_rank_samples: int, batch_size: int,
                warmup_batches: int) -> float:
    """Inside a rank: samples/s (all ranks together) over one epoch with these options."""
    device = rank_device()
    dataset = ImageDataset(prepare_digits(progress=False) / "train", transform=AUGMENT)
    total = per_rank_samples * world_size()
    if total > len(dataset):
        raise ValueError(f"{per_rank_samples} samples per rank x {world_size()} ranks is more "
                         f"than the {len(dataset)} training images")
    dataset = spread_subset(dataset, total)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    torch.manual_seed(0)
    model = SeedCNN().to(device)
    if options.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=options.bucket_cap_mb,
                gradient_as_bucket_view=options.gradient_as_bucket_view,
                static_graph=options.static_graph)
    if options.comm_hook is not None:
        model.register_comm_hook(None, COMM_HOOKS[options.comm_hook])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader_args = {"batch_size": batch_size, "num_workers": options.workers,
                   "pin_memory": options.pin_memory and device.type == "cuda",
                   "worker_init_fn": seed_worker,
                   "persistent_workers": options.workers > 0}
    low_precision = amp_dtype(options.amp, device)
    epoch_args = {"progress": False, "accumulate": options.accumulate,
                  "amp_dtype": low_precision,
                  "loss_fn": partial(classification_loss, channels_last=options.channels_last),
                  "scaler": (torch.amp.GradScaler(device.type)
                             if low_precision == torch.float16 else None)}
    warmup = Subset(dataset, range(rank() * warmup_batches * batch_size,
                                   (rank() + 1) * warmup_batches * batch_size))
    # static_graph records the graph in the first iteration, which must synchronise:
    # warm up without accumulation (no_sync in a first iteration trips DDP's reducer).
    # The warm-up warms the model, DDP and the allocator, not the loader: read in this
    # process (a worker started for one batch would cost more than the timed epoch).
    warmup_loader = DataLoader(warmup, **(loader_args | {"num_workers": 0,
                                                         "persistent_workers": False}))
    train_one_epoch(model, warmup_loader, optimizer, **(epoch_args | {"accumulate": 1}))
    loader = DataLoader(dataset, sampler=sampler, generator=loader_generator(0, rank()),
                        **loader_args)
    batches = _StartedLoader(loader)  # the workers start (and prefetch) before the clock
    dist.barrier()
    started = time.perf_counter()
    metrics = train_one_epoch(model, batches, optimizer, **epoch_args)  # ends in all_reduce
    return metrics.samples / (time.perf_counter() - started)
