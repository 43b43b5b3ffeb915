"""Chapter 03's exercises: collectives built from point-to-point messages.

What a rank sends is counted where every point-to-point message goes through
(:func:`mgpu_helpers.traffic.sends_counted`): gloo's flight recorder keeps the
collectives only, no entry for a send or a receive. A ring sends to one neighbour only,
and no more bytes than the ring's steps carry."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..flight_recorder import collectives_so_far
from ..traffic import sends_counted
from .core import Case, Exercise, as_number, beyond, count


def _rank_input(length: int) -> torch.Tensor:
    # whole numbers: every order of adding them gives the same float sum
    rank = dist.get_rank()
    return torch.arange(length, dtype=torch.float32) % 7 + 10 * (rank + 1)


def _collectives_since(before: int) -> list[str]:
    # gloo records no point-to-point message, so every entry here is a collective; the
    # is_p2p test keeps this right on a backend that records them too (NCCL does)
    return sorted({entry["profiling_name"] for entry in collectives_so_far()[before:]
                   if not entry.get("is_p2p", False)})


def _traffic(sent: list, elements: int, phases: int, element_size: int) -> dict:
    """What this rank sent, and the most a ring may send: ``phases`` rounds of N-1 steps,
    each step one chunk of at most ceil(elements / N) elements, to one neighbour."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return {"bytes": sum(size for _, size in sent),
            "peers": sorted({peer for peer, _ in sent}),
            "budget": phases * (world - 1) * math.ceil(elements / world) * element_size,
            "neighbours": ((rank + 1) % world, (rank - 1) % world)}


def _ring_trial(fn, length: int):
    tensor = _rank_input(length)
    expected = tensor.clone()
    dist.all_reduce(expected)
    before = len(collectives_so_far())
    with sends_counted() as sent:
        fn(tensor)
    traffic = _traffic(sent, length, 2, tensor.element_size())
    return (tensor, _collectives_since(before), traffic), expected


def _reduce_scatter_trial(fn, length: int):
    world = dist.get_world_size()
    source = _rank_input(length * world)
    expected = source.clone()
    dist.all_reduce(expected)
    expected = expected.chunk(world)[dist.get_rank()].clone()
    output = torch.full((length,), float("nan"))
    before = len(collectives_so_far())
    with sends_counted() as sent:
        fn(output, source.clone())
    traffic = _traffic(sent, length * world, 1, source.element_size())
    return (output, _collectives_since(before), traffic), expected


def _show(tensor: torch.Tensor, limit: int = 8) -> str:
    values = [f"{v:g}" for v in tensor.flatten()[:limit].tolist()]
    return "[" + ", ".join(values) + (", ...]" if tensor.numel() > limit else "]")


def same_tensor(got, expected: torch.Tensor) -> str | None:
    """None when ``got`` has ``expected``'s shape and values, else what differs."""
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor, got {type(got).__name__}"
    if got.shape != expected.shape:
        return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    got, expected = got.double(), expected.double()  # any float dtype compares
    if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5, equal_nan=False):
        wrong = int((~torch.isclose(got, expected, rtol=1e-5, atol=1e-5)).sum())
        return (f"{wrong} of {count(got.numel(), 'value')} "
                f"{'differs' if wrong == 1 else 'differ'}: expected {_show(expected)}, "
                f"got {_show(got)}")
    return None


def _judge_point_to_point(got, expected) -> str | None:
    tensor, collectives, traffic = got
    if collectives:
        return (f"it called {', '.join(collectives)}: build it from send/recv "
                "(or isend/irecv) only")
    wrong = same_tensor(tensor, expected)
    if wrong:
        return wrong
    right, left = traffic["neighbours"]
    peers = set(traffic["peers"])
    if traffic["bytes"] > traffic["budget"] or not (peers <= {right} or peers <= {left}):
        ranks = ", ".join(map(str, traffic["peers"]))
        neighbour = (f"rank {right}" if right == left else
                     f"rank {right}, or rank {left} for a ring that turns the other way")
        return (f"the sums are right, but this rank sent {traffic['bytes']:,} bytes to "
                f"rank{'s' if len(peers) > 1 else ''} {ranks}; a ring sends at most "
                f"{traffic['budget']:,}, to one neighbour only ({neighbour}): pass chunks "
                "along the ring, not whole tensors to every rank")
    return None


def _crossover_trial(fn, alpha: float, bandwidth: float, world: int):
    # the size where the model's two terms are equal:
    # alpha * 2(N-1) = 2(N-1)/N * bytes / bandwidth
    return fn(alpha, bandwidth, world), alpha * bandwidth * world


def _judge_number(got, expected) -> str | None:
    value = as_number(got)  # a float, NumPy's scalar or a one-element tensor
    if value is None:
        return f"expected a number of bytes, got {type(got).__name__}"
    if beyond(abs(value - expected), 1e-6 * abs(expected)):
        finite = "" if math.isfinite(value) else " (not a finite number)"
        return f"expected {expected:,.0f} bytes, got {value:,.0f}{finite}"
    return None


EXERCISES = [
    Exercise(
        key="03.1", title="a ring all-reduce from send and recv",
        function="my_ring_all_reduce",
        cases=[Case(f"{world} ranks, {length} elements", (length,), world)
               for world, length in ((2, 8), (3, 7), (4, 4), (4, 2), (3, 1000))],
        trial=_ring_trial, judge=_judge_point_to_point,
        hint="split the tensor into world-size chunks (tensor_split allows lengths that "
             "do not divide); N-1 steps of adding the chunk that arrives from the left, "
             "then N-1 steps of copying; with blocking send and recv, not every rank may "
             "send first",
    ),
    Exercise(
        key="03.2", title="a reduce-scatter from send and recv",
        function="my_reduce_scatter",
        cases=[Case(f"{world} ranks, {length} element{'s' if length > 1 else ''} out",
                    (length,), world)
               for world, length in ((2, 4), (3, 5), (4, 1))],
        trial=_reduce_scatter_trial, judge=_judge_point_to_point,
        hint="rank r must end with chunk r of the sum: in the ring's N-1 steps, the chunk "
             "a rank sends first decides which one it finishes with",
    ),
    Exercise(
        key="03.3", title="where latency and bandwidth cost the same",
        function="crossover_bytes",
        cases=[Case(f"alpha {alpha * 1e6:g} us, {bandwidth / 1e9:g} GB/s, {world} ranks",
                    (alpha, bandwidth, world))
               for alpha, bandwidth, world in ((575e-6, 1.31e9, 2), (575e-6, 1.31e9, 8),
                                               (5e-6, 100e9, 8))],
        trial=_crossover_trial, judge=_judge_number,
        hint="write both terms of t(bytes) = alpha * 2(N-1) + 2(N-1)/N * bytes / bandwidth "
             "and solve for the bytes that make them equal; N does not cancel",
    ),
]
