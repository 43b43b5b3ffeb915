"""Chapter 06's GPipe measurement: step time and idle share of a pipeline on CPU ranks,
for 1 to M micro-batches (the naive split is M = 1), with each step's timeline.

The pipeline itself (``split_sequential``, ``gpipe_step``, ``Timeline``...) is the core
module :mod:`mgpu_helpers.pipeline_parallel`; this module only builds a model made for
the measurement and times it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..launcher import launch
from ..pipeline_parallel import (
    Timeline,
    balanced_cuts,
    bubble_fraction,
    gpipe_step,
    ideal_speedup,
    layer_costs,
    micro_batch_size,
    split_sequential,
    theoretical_bubble,
)


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


def _timed_steps(model_kwargs: dict, cuts: list[int], batch_size: int,
                 micro_batch_counts: list[int], steps: int, overlap: bool) -> dict:
    """Inside a rank: time ``steps`` GPipe steps for each micro-batch count."""
    model = pipeline_convnet(**model_kwargs)
    stage = split_sequential(model, cuts)[dist.get_rank()]
    first, last = dist.get_rank() == 0, dist.get_rank() == dist.get_world_size() - 1
    inputs, targets = example_batch(model_kwargs, batch_size)
    results = {}
    for micro_batches in micro_batch_counts:
        seconds, timeline = [], None
        for step in range(steps + 1):  # step 0 warms up
            timeline = Timeline(dist.get_rank())
            stage.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            gpipe_step(stage, micro_batches, inputs if first else None,
                       targets if last else None, timeline=timeline, overlap=overlap)
            if step:
                seconds.append(time.perf_counter() - start)
        results[micro_batches] = {"seconds": seconds, "events": timeline.events}
    return results


def measure_gpipe(micro_batch_counts: Sequence[int] = (1, 2, 4, 8, 16), stages: int = 2,
                  batch_size: int = 64, channels: int = 64, depth: int = 9,
                  image_size: int = 16, steps: int = 5, overlap: bool = True) -> dict:
    """Step time of the naive split (M = 1) and of GPipe for each M, on ``stages`` CPU
    ranks, with the timeline of each M's last step.

    Returns ``{micro_batches: {"seconds": median step time, "runs": [...], "speedup":
    over M = 1, "ideal_speedup", "bubble": measured, "theoretical_bubble", "events"}}``
    plus the settings under ``"settings"``.
    """
    counts = sorted(set(micro_batch_counts))
    if 1 not in counts:
        counts.insert(0, 1)  # the naive split is the reference
    for m in counts:
        micro_batch_size(batch_size, m)
    model_kwargs = {"channels": channels, "depth": depth, "image_size": image_size}
    model = pipeline_convnet(**model_kwargs)
    costs = layer_costs(model, example_batch(model_kwargs, 2)[0], repeats=1)
    cuts = balanced_cuts([cost.flops for cost in costs], stages)  # equal FLOPs per stage
    # CPU ranks on every machine: the stages, their tensors and the timings are the CPU
    # pipeline this measurement explains (a GPU pipeline would send through NCCL).
    per_rank = launch(_timed_steps, model_kwargs, cuts, batch_size, counts, steps, overlap,
                      nprocs=stages, backend="gloo", return_all=True)
    result: dict = {"settings": {"stages": stages, "batch_size": batch_size, **model_kwargs,
                                 "steps": steps, "cuts": cuts, "overlap": overlap}}
    for m in counts:
        runs = [max(times) for times in zip(*(r[m]["seconds"] for r in per_rank), strict=True)]
        events = [event for r in per_rank for event in r[m]["events"]]
        result[m] = {"runs": runs, "seconds": sorted(runs)[len(runs) // 2], "events": events,
                     "bubble": bubble_fraction(events),
                     "theoretical_bubble": theoretical_bubble(stages, m),
                     "ideal_speedup": ideal_speedup(stages, m)}
    for m in counts:
        result[m]["speedup"] = result[1]["seconds"] / result[m]["seconds"]
    return result


def interleaved_step(images: torch.Tensor, labels: torch.Tensor, cuts: list[int],
                     micro_batches: int, seed: int = 0) -> tuple[float, dict]:
    """Inside one of K ranks: one training step of the seed CNN cut at ``cuts`` into 2K
    stages, run by ``torch.distributed.pipelining.ScheduleInterleaved1F1B``. Rank r holds
    stages r and r + K (two *virtual* stages), so the first and the last stage live on
    ranks 0 and K - 1. Returns the batch's mean loss (on every rank) and this rank's
    gradients by parameter name, to compare with the unsplit model."""
    import torch.nn.functional as F
    from torch.distributed import pipelining

    from ..models import SeedCNN, as_sequential

    rank, world = dist.get_rank(), dist.get_world_size()
    if len(cuts) + 1 != 2 * world:
        raise ValueError(f"{world} ranks with 2 virtual stages each need {2 * world - 1} "
                         f"cuts, got {len(cuts)}")
    torch.manual_seed(seed)
    model = SeedCNN()
    pieces = split_sequential(as_sequential(model), cuts)
    stages = [pipelining.PipelineStage(pieces[index], index, len(pieces), torch.device("cpu"))
              for index in (rank, rank + world)]
    schedule = pipelining.ScheduleInterleaved1F1B(stages, n_microbatches=micro_batches,
                                                  loss_fn=F.cross_entropy)
    losses = []
    if rank == 0:
        schedule.step(images)
    elif rank == world - 1:
        schedule.step(target=labels, losses=losses)
    else:
        schedule.step()
    loss = torch.tensor(sum(x.item() for x in losses) / micro_batches if losses else 0.0)
    dist.broadcast(loss, src=world - 1)
    return loss.item(), {name: p.grad for name, p in model.named_parameters()
                         if p.grad is not None}
