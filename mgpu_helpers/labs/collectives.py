"""The collectives chapter's ring all-reduce, its cost model, and its measurement.

:func:`ring_all_reduce` builds an all-reduce from point-to-point sends and receives.

A ring all-reduce over N ranks takes 2(N-1) steps (N-1 of reduce-scatter, N-1 of
all-gather), and each rank sends 2(N-1)/N of the tensor's bytes. So its time is about

    t(bytes) = alpha * 2(N-1) + 2(N-1)/N * bytes / bandwidth

with ``alpha`` the fixed cost of one step (latency, call overhead) and ``bandwidth`` the
bytes per second one rank's link moves. A ring all-gather or reduce-scatter is one of the
two halves: N-1 steps and (N-1)/N of the bytes (the whole tensor: the all-gather's
output, the reduce-scatter's input). :func:`collective_seconds` measures ``t`` inside the
ranks, :func:`fit` finds ``alpha`` and ``bandwidth`` from those measurements, and
:func:`predict` applies them to other sizes, collectives and numbers of ranks (chapter 03
predicts the tutorial CNN's gradient all-reduce in DDP with it; ``benchmarks/allreduce_cost.py``
stores a run).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from ..runtime.ranks import device

#: 64 B to 64 MiB in steps of 4x: where the fixed cost dominates, and where bytes do.
SIZES = tuple(64 * 4 ** k for k in range(11))


#: The collectives the model covers, and how many of the ring's N-1-step phases each runs.
PHASES = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}


def steps_and_volume(nbytes: float, world: int,
                     collective: str = "all_reduce") -> tuple[int, float]:
    """A ring collective's number of steps and the bytes each rank sends, for a tensor of
    ``nbytes`` (the all-gather's output, the reduce-scatter's input)."""
    if collective not in PHASES:
        raise ValueError(f"unknown collective {collective!r}: use one of {', '.join(PHASES)}")
    if world < 2:
        raise ValueError(f"a collective needs at least 2 ranks, got {world}")
    phases = PHASES[collective]
    return phases * (world - 1), phases * (world - 1) / world * nbytes


def bus_bandwidth(nbytes: float, seconds: float, world: int,
                  collective: str = "all_reduce") -> tuple[float, float]:
    """``(algbw, busbw)`` in bytes/s as nccl-tests reports them: the tensor's bytes per
    second, and the bytes each rank's link carried per second (algbw times 2(N-1)/N for an
    all-reduce, (N-1)/N for an all-gather or a reduce-scatter)."""
    _, volume = steps_and_volume(nbytes, world, collective)
    return nbytes / seconds, volume / seconds


def ring_all_reduce(tensor: torch.Tensor) -> None:
    """Inside a rank: sum ``tensor`` over all ranks, in place, with a ring of sends and
    receives (reduce-scatter, then all-gather)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = list(tensor.tensor_split(n))  # views: writing a chunk writes the tensor

    def exchange(send_index, receive_index):
        incoming = torch.empty_like(chunks[receive_index])
        request = dist.isend(chunks[send_index], right)
        dist.recv(incoming, left)
        request.wait()
        return incoming

    for step in range(n - 1):  # 1. reduce-scatter: add what arrives
        send, receive = (rank - step) % n, (rank - step - 1) % n
        chunks[receive] += exchange(send, receive)
    # now this rank holds the complete sum of chunk (rank + 1) % n
    for step in range(n - 1):  # 2. all-gather: pass the complete chunks on
        send, receive = (rank + 1 - step) % n, (rank - step) % n
        chunks[receive].copy_(exchange(send, receive))


def _timings(work, repeats: int, calls: int = 1) -> list[float]:
    """Inside a rank: ``repeats`` timings of ``calls`` runs of ``work`` (each divided by
    ``calls``), every rank starting together; on a GPU the clock stops only once the
    queued work has run."""
    finish = torch.cuda.synchronize if device().type == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats):
        dist.barrier()
        finish()
        start = time.perf_counter()
        for _ in range(calls):
            work()
        finish()
        times.append((time.perf_counter() - start) / calls)
    return times


def collective_call(collective: str, nbytes: int):
    """One call of ``collective`` on a float32 tensor of ``nbytes`` (whole tensor), on
    the rank's device: the flat forms FSDP uses for the two halves (chapter 07 also
    times its steps' broadcasts with it)."""
    world = dist.get_world_size()
    elements = max(world, nbytes // 4 // world * world)  # a multiple of N, as FSDP pads
    whole = torch.ones(elements, device=device())
    shard = torch.ones(elements // world, device=device())
    if collective == "all_reduce":
        return lambda: dist.all_reduce(whole)
    if collective == "all_gather":
        return lambda: dist.all_gather_single(whole, shard)
    if collective == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(shard, whole)
    if collective == "broadcast":
        return lambda: dist.broadcast(whole, src=0)
    raise ValueError(f"unknown collective {collective!r}: use one of "
                     f"{', '.join(PHASES)} or broadcast")


def collective_seconds(collective: str = "all_reduce", sizes=SIZES,
                       repeats: int = 5) -> dict[str, list[float]]:
    """Inside a rank: the time of one ``collective`` of a float32 tensor of each size in
    bytes, on the rank's device: ``{"median": [...], "fastest": [...]}`` over ``repeats``
    timings, after a warm-up. Each timing runs several calls back to back (up to 16 for
    small tensors, so that a late wake-up of one process is spread over many calls) and
    divides."""
    medians, fastest = [], []
    for nbytes in sizes:
        call = collective_call(collective, nbytes)
        call()  # warm-up: connections, buffers
        times = _timings(call, repeats, max(1, min(16, 2 ** 24 // nbytes)))
        medians.append(statistics.median(times))
        fastest.append(min(times))
    return {"median": medians, "fastest": fastest}


def allreduce_seconds(sizes=SIZES, repeats: int = 5) -> list[float]:
    """Inside a rank: the median time of one ``dist.all_reduce`` of a float32 tensor of
    each size in bytes (:func:`collective_seconds`)."""
    return collective_seconds("all_reduce", sizes, repeats)["median"]


def fit(sizes, seconds, world: int, collective: str = "all_reduce") -> tuple[float, float]:
    """``(alpha, bandwidth)`` of the model above, fitted by least squares on the relative
    error (each size counts alike)."""
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError("fit needs at least 2 sizes, one time each")
    rows = np.array([steps_and_volume(n, world, collective) for n in sizes], dtype=float)
    times = np.asarray(seconds, dtype=float)
    weights = 1.0 / times
    (alpha, seconds_per_byte), *_ = np.linalg.lstsq(rows * weights[:, None], times * weights,
                                                    rcond=None)
    if alpha <= 0 or seconds_per_byte <= 0:
        raise ValueError(f"the times do not fit the model (alpha {alpha:.3g} s, "
                         f"{seconds_per_byte:.3g} s/byte): measure again on a quieter machine")
    return float(alpha), float(1.0 / seconds_per_byte)


def predict(nbytes: float, alpha: float, bandwidth: float, world: int,
            collective: str = "all_reduce") -> float:
    """The model's time for one ``collective`` of ``nbytes``."""
    steps, volume = steps_and_volume(nbytes, world, collective)
    return alpha * steps + volume / bandwidth


def buckets_seconds(bucket_bytes: list[int], repeats: int = 5) -> float:
    """Inside a rank: the median time of all-reducing one float32 tensor per bucket (sizes
    in bytes), one after the other, as DDP does once per step (here without a backward
    pass to overlap with)."""
    tensors = [torch.ones(nbytes // 4, device=device()) for nbytes in bucket_bytes]
    for tensor in tensors:
        dist.all_reduce(tensor)  # warm-up

    def all_buckets():
        for tensor in tensors:
            dist.all_reduce(tensor)

    return statistics.median(_timings(all_buckets, repeats))
