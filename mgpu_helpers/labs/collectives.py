"""The collectives chapter's ring all-reduce, its cost model, and its measurement.

:func:`ring_all_reduce` builds an all-reduce from point-to-point sends and receives.

A ring all-reduce over N ranks takes 2(N-1) steps (N-1 of reduce-scatter, N-1 of
all-gather), and each rank sends 2(N-1)/N of the tensor's bytes. So its time is about

    t(bytes) = alpha * 2(N-1) + 2(N-1)/N * bytes / bandwidth

with ``alpha`` the fixed cost of one step (latency, call overhead) and ``bandwidth`` the
bytes per second one rank's link moves. :func:`allreduce_seconds` measures ``t`` inside
the ranks, :func:`fit` finds ``alpha`` and ``bandwidth`` from those measurements, and
:func:`predict` applies them to other sizes (chapter 03 predicts the seed CNN's gradient
all-reduce in DDP with it; ``benchmarks/allreduce_cost.py`` stores a run).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from ..ranks import device

#: 64 B to 64 MiB in steps of 4x: where the fixed cost dominates, and where bytes do.
SIZES = tuple(64 * 4 ** k for k in range(11))


def steps_and_volume(nbytes: float, world: int) -> tuple[int, float]:
    """A ring all-reduce's number of steps and the bytes each rank sends."""
    if world < 2:
        raise ValueError(f"an all-reduce needs at least 2 ranks, got {world}")
    return 2 * (world - 1), 2 * (world - 1) / world * nbytes


def ring_all_reduce(tensor: torch.Tensor) -> dict:
    """Inside a rank: sum ``tensor`` over all ranks, in place, with a ring of sends and
    receives (reduce-scatter, then all-gather). Returns the messages and bytes this rank
    sent."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = list(tensor.tensor_split(n))  # views: writing a chunk writes the tensor
    sent = {"messages": 0, "bytes": 0}

    def exchange(send_index, receive_index):
        incoming = torch.empty_like(chunks[receive_index])
        request = dist.isend(chunks[send_index], right)
        dist.recv(incoming, left)
        request.wait()
        sent["messages"] += 1
        sent["bytes"] += chunks[send_index].numel() * chunks[send_index].element_size()
        return incoming

    for step in range(n - 1):  # 1. reduce-scatter: add what arrives
        send, receive = (rank - step) % n, (rank - step - 1) % n
        chunks[receive] += exchange(send, receive)
    # now this rank holds the complete sum of chunk (rank + 1) % n
    for step in range(n - 1):  # 2. all-gather: pass the complete chunks on
        send, receive = (rank + 1 - step) % n, (rank - step) % n
        chunks[receive].copy_(exchange(send, receive))
    return sent


def _median_seconds(work, repeats: int, calls: int = 1) -> float:
    """Inside a rank: the median over ``repeats`` timings of ``calls`` runs of ``work``
    (divided by ``calls``), every rank starting together; on a GPU the clock stops only
    once the queued work has run."""
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
    return statistics.median(times)


def allreduce_seconds(sizes=SIZES, repeats: int = 5) -> list[float]:
    """Inside a rank: the time of one ``dist.all_reduce`` of a float32 tensor of each size
    in bytes, on the rank's device. Each timing runs several all-reduces back to back
    (up to 16 for small tensors, so that the ranks run in step and a late wake-up of one
    process is spread over many calls) and divides; the median of ``repeats`` timings,
    after a warm-up."""
    seconds = []
    for nbytes in sizes:
        tensor = torch.ones(max(1, nbytes // 4), device=device())
        dist.all_reduce(tensor)  # warm-up: connections, buffers
        calls = max(1, min(16, 2 ** 24 // nbytes))
        seconds.append(_median_seconds(lambda t=tensor: dist.all_reduce(t), repeats, calls))
    return seconds


def fit(sizes, seconds, world: int) -> tuple[float, float]:
    """``(alpha, bandwidth)`` of the model above, fitted by least squares on the relative
    error (each size counts alike, from 64 B to 64 MiB)."""
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError("fit needs at least 2 sizes, one time each")
    rows = np.array([steps_and_volume(n, world) for n in sizes], dtype=float)
    times = np.asarray(seconds, dtype=float)
    weights = 1.0 / times
    (alpha, seconds_per_byte), *_ = np.linalg.lstsq(rows * weights[:, None], times * weights,
                                                    rcond=None)
    if alpha <= 0 or seconds_per_byte <= 0:
        raise ValueError(f"the times do not fit the model (alpha {alpha:.3g} s, "
                         f"{seconds_per_byte:.3g} s/byte): measure again on a quieter machine")
    return float(alpha), float(1.0 / seconds_per_byte)


def predict(nbytes: float, alpha: float, bandwidth: float, world: int) -> float:
    """The model's time for one all-reduce of ``nbytes``."""
    steps, volume = steps_and_volume(nbytes, world)
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

    return _median_seconds(all_buckets, repeats)
