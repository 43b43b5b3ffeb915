"""Chapter 07's memory anatomy: what each data-parallel strategy keeps on a rank.

:func:`rank_memory` trains a stack of equal feed-forward blocks for a few Adam steps
under one strategy and measures, on this rank, the bytes of the distinct storages
behind its parameters, gradients, Adam state and (DDP) bucket buffers after a step; the
**peak** during a step, in each of its phases: the most bytes the allocator held on top
of those, read from ``torch.profiler``'s memory events; and the collectives of that
step with their volume, read from the flight recorder, optionally timed.
:func:`formula` gives what the ZeRO paper predicts for the same model. The strategies:

* ``"DDP"``: every rank holds everything, plus the bucket buffers DDP all-reduces;
* ``"DDP, bucket views"``: ``gradient_as_bucket_view=True``, the gradients live in the
  buckets;
* ``"ZeRO-1"``: DDP with ``ZeroRedundancyOptimizer``: Adam's state split between ranks;
* ``"FSDP2, keep after forward"``: ``fully_shard(reshard_after_forward=False)``, ZeRO-2's
  traffic: a layer's gathered weights stay from its forward to its backward;
* ``"FSDP2"``: ``fully_shard`` (ZeRO-3): gathered for the forward, freed, gathered again
  for the backward.

Activation checkpointing (each layer recomputed in backward) can be switched on for any.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..measure.flight_recorder import collectives_so_far
from ..runtime.private_apis import is_allocation, profiler_event_tree
from ..runtime.ranks import rank, world_size
from .collectives import collective_call
from .native_stderr import native_stderr_silenced

STRATEGIES = ("DDP", "DDP, bucket views", "ZeRO-1", "FSDP2, keep after forward", "FSDP2")
FLOAT_BYTES = 4
ADAM_MOMENTS = 2


def feed_forward_blocks(width: int = 512, blocks: int = 4, seed: int = 0) -> nn.Sequential:
    """``blocks`` equal feed-forward blocks, ``Linear(d, 4d) -> ReLU -> Linear(4d, d)``
    as in a transformer: equal units, so that every strategy splits them evenly, and
    each block's inner activation is 4 times its input, which is what activation
    checkpointing saves."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(),
                                         nn.Linear(4 * width, width))
                           for _ in range(blocks)])


def formula(strategy: str, parameters: int, ranks: int) -> dict:
    """Bytes per rank after a step, the ZeRO paper's accounting applied to float32 Adam:
    4 bytes per parameter for the weights, 4 for the gradients, 8 for the two moments,
    each divided by the number of ranks where the strategy shards it. (The paper counts
    mixed-precision Adam: 2 + 2 bytes of 16-bit weights and gradients, and 12 of float32
    master weights and moments, which ZeRO-1 shards.)"""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    full = parameters * FLOAT_BYTES
    sharded = strategy.startswith("FSDP2")
    return {"parameters": full // ranks if sharded else full,
            "gradients": full // ranks if sharded else full,
            "optimizer state": ADAM_MOMENTS * full // (ranks if strategy != "DDP"
                                                       and strategy != "DDP, bucket views"
                                                       else 1),
            "bucket buffers": full if strategy in ("DDP", "ZeRO-1") else 0}


def storages(tensors) -> dict:
    """``{address: bytes}`` of the distinct storages behind ``tensors`` (a sharded
    DTensor: its local piece's): two views of one buffer count once, and a view counts
    its whole buffer."""
    found = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = (tensor.to_local() if hasattr(tensor, "to_local") else tensor).untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    return found


def record_bucket_buffers(ddp_model) -> dict:
    """Register a communication hook on ``ddp_model`` that all-reduces each bucket as DDP
    does by default (``allreduce_hook``) and keeps the flat buffer it was handed
    (``GradBucket.buffer()``): ``{bucket index: buffer}``, filled by each backward."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buffers = {}

    def hook(state, bucket):
        buffers[bucket.index()] = bucket.buffer()
        return allreduce_hook(state, bucket)

    ddp_model.register_comm_hook(None, hook)
    return buffers


def held_by_kind(params, optimizer, bucket_buffers) -> dict:
    """Bytes of the distinct storages this rank keeps for each kind: parameters,
    gradients, optimizer state (tensors of one or more dimensions) and bucket buffers
    not already counted as gradients (with bucket views the gradients live in them)."""
    optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's share
    kinds = {"parameters": storages(params),
             "gradients": storages([p.grad for p in params]),
             "optimizer state": storages([t for state in optimizer.state.values()
                                          for t in state.values() if t.dim() > 0])}
    kinds["bucket buffers"] = {address: size for address, size
                               in storages(bucket_buffers.values()).items()
                               if address not in kinds["gradients"]}
    return {kind: sum(found.values()) for kind, found in kinds.items()}


class _Checkpointed(nn.Module):
    """Runs ``layer`` under activation checkpointing: its input is kept, the rest is
    recomputed in backward."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.layer, x, use_reentrant=False)


def _wrap(strategy: str, model: nn.Sequential, checkpointing: bool):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    if checkpointing:
        for index, block in enumerate(model):
            model[index] = _Checkpointed(block)
    if strategy.startswith("FSDP2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size(),))
        keep = strategy == "FSDP2, keep after forward"
        for block in model:
            fully_shard(block, mesh=mesh, reshard_after_forward=not keep)
        wrapped = fully_shard(model, mesh=mesh, reshard_after_forward=not keep)
    else:
        wrapped = DDP(model, gradient_as_bucket_view=strategy == "DDP, bucket views")
    if strategy == "ZeRO-1":
        optimizer = ZeroRedundancyOptimizer(wrapped.parameters(),
                                            optimizer_class=torch.optim.Adam, lr=1e-3)
    else:
        optimizer = torch.optim.Adam(wrapped.parameters(), lr=1e-3)
    return wrapped, optimizer


PHASES = ("forward", "backward", "optimizer step")


def _extra_at_peak(profile) -> dict:
    """The most bytes the CPU allocator held during each phase of the profiled step
    beyond what it held when the step began, from its allocation and free events (each
    phase is a ``record_function`` range). Each event is matched to its address: a free
    of memory allocated before the step counts nothing, and an address allocated again
    was freed in between, even when the free ran on one of gloo's threads, where the
    profiler does not record it."""
    events, phases = [], {}

    def walk(nodes):
        for event in nodes:
            if is_allocation(event):
                fields = event.extra_fields
                events.append((event.start_time_ns, fields.ptr, fields.alloc_size))
            elif event.name in PHASES:
                phases[event.name] = (event.start_time_ns, event.end_time_ns)
            walk(event.children)

    walk(profiler_event_tree(profile))
    live, held, timeline = {}, 0, []
    for time, address, size in sorted(events, key=lambda event: event[0]):
        if size > 0:
            held += size - live.get(address, 0)
            live[address] = size
        else:
            held -= live.pop(address, 0)
        timeline.append((time, held))
    return {phase: max((total for time, total in timeline if start <= time <= end),
                       default=0)
            for phase, (start, end) in phases.items()}


def step_calls(entries: list[dict]) -> list[tuple[str, int]]:
    """``(collective, bytes)`` of each flight-recorder entry: an all-gather's output,
    the others' input, as the cost model counts a tensor."""
    calls = []
    for entry in entries:
        kind = entry["profiling_name"].split(":")[-1]
        sizes = entry["output_sizes"] if kind == "all_gather" else entry["input_sizes"]
        calls.append((kind, FLOAT_BYTES * sum(int(torch.Size(size).numel())
                                              for size in sizes)))
    return calls


def traffic_seconds(calls: list[tuple[str, int]], repeats: int = 5) -> float:
    """Inside a rank: the median time of running ``calls`` (``(collective, bytes)``, as
    :func:`step_calls` lists a step's) one after the other on float32 tensors of those
    sizes, every rank starting together, without a step's computation around them."""
    import statistics
    import time

    work = [collective_call(kind, nbytes) for kind, nbytes in calls]
    times = []
    for repeat in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        for call in work:
            call()
        if repeat:  # the first run is a warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


# How much each collective moves, in elements of its tensors, counted as the ZeRO paper
# and the Ultra-Scale Playbook count it: an all-reduce is a reduce-scatter plus an
# all-gather, twice the tensor; the others once.
_VOLUME = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1}


def collectives_volume(entries: list[dict]) -> dict:
    """Per kind of collective: how many ran and their volume in elements (an
    all-gather's is its output, the others' their input)."""
    volume: dict[str, dict] = {}
    for entry in entries:
        kind = entry["profiling_name"].split(":")[-1]
        sizes = entry["output_sizes"] if kind == "all_gather" else entry["input_sizes"]
        elements = sum(int(torch.Size(size).numel()) for size in sizes)
        row = volume.setdefault(kind, {"calls": 0, "elements": 0})
        row["calls"] += 1
        row["elements"] += _VOLUME.get(kind, 1) * elements
    return volume


def rank_memory(strategy: str, checkpointing: bool = False, steps: int = 3,
                width: int = 512, blocks: int = 4, batch: int = 256,
                time_traffic: bool = False) -> dict:
    """Inside a rank: train :func:`feed_forward_blocks` for ``steps`` Adam steps under
    ``strategy`` (its own random batch per rank), profiling the last step's memory.
    Returns the parameter count; the bytes of the storages behind each kind of state
    after the last step (:func:`held_by_kind`, ``"stored"``); the most bytes allocated
    on top of them in each phase of that step; the collectives it ran (from the flight
    recorder) as volumes and as ``(collective, bytes)`` calls, with
    :func:`traffic_seconds` of those calls and chapter 03's all-reduce model fitted on
    this machine (``"alpha, bandwidth"``) if ``time_traffic``; the time of the step
    before the profiled one; and the full weights (to compare strategies)."""
    import time

    from torch.profiler import ProfilerActivity, profile, record_function

    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    generator = torch.Generator().manual_seed(100 + rank())
    batches = [torch.randn(batch, width, generator=generator) for _ in range(steps)]

    def step(x):
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated between steps
        with record_function("forward"):
            loss = F.mse_loss(wrapped(x), x.flip(1))
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer step"):
            optimizer.step()

    model = feed_forward_blocks(width, blocks)
    parameters = sum(p.numel() for p in model.parameters())
    wrapped, optimizer = _wrap(strategy, model, checkpointing)
    buckets = {} if strategy.startswith("FSDP2") else record_bucket_buffers(wrapped)
    for x in batches[:-1]:
        dist.barrier()
        start = time.perf_counter()
        step(x)
        seconds = time.perf_counter() - start  # the last step before the profiled one
    recorded = len(collectives_so_far())
    with native_stderr_silenced():  # the profiler logs start and stop
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recording:
            step(batches[-1])
    entries = collectives_so_far()[recorded:]
    params = list(wrapped.parameters())
    weights = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params]
    result = {"parameter count": parameters,
              "stored": held_by_kind(params, optimizer, buckets),
              "extra at peak": _extra_at_peak(recording),
              "collectives": collectives_volume(entries), "calls": step_calls(entries),
              "step seconds": seconds,
              "weights": weights, "block bytes": parameters * FLOAT_BYTES // blocks,
              "hidden activation bytes": batch * 4 * width * FLOAT_BYTES}
    if time_traffic:  # the calls timed alone, and chapter 03's model fitted here
        from .collectives import allreduce_seconds, fit

        result["traffic seconds"] = traffic_seconds(result["calls"])
        sizes = (2**12, 2**16, 2**20, 2**24)
        result["alpha, bandwidth"] = fit(sizes, allreduce_seconds(sizes), world_size())
    dist.barrier()
    return result
