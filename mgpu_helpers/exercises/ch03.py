"""Chapter 03's exercises: collectives built from point-to-point messages."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..flight_recorder import collectives_so_far
from .core import Case, Exercise


def _rank_input(length: int) -> torch.Tensor:
    # whole numbers: every order of adding them gives the same float sum
    rank = dist.get_rank()
    return torch.arange(length, dtype=torch.float32) % 7 + 10 * (rank + 1)


def _point_to_point_only(before: int) -> list[str]:
    return sorted({entry["profiling_name"] for entry in collectives_so_far()[before:]
                   if not entry.get("is_p2p", False)})


def _ring_trial(fn, length: int):
    tensor = _rank_input(length)
    expected = tensor.clone()
    dist.all_reduce(expected)
    before = len(collectives_so_far())
    fn(tensor)
    return (tensor, _point_to_point_only(before)), expected


def _reduce_scatter_trial(fn, length: int):
    world = dist.get_world_size()
    source = _rank_input(length * world)
    expected = source.clone()
    dist.all_reduce(expected)
    expected = expected.chunk(world)[dist.get_rank()].clone()
    output = torch.full((length,), float("nan"))
    before = len(collectives_so_far())
    fn(output, source.clone())
    return (output, _point_to_point_only(before)), expected


def _show(tensor: torch.Tensor, limit: int = 8) -> str:
    values = [f"{v:g}" for v in tensor.flatten()[:limit].tolist()]
    return "[" + ", ".join(values) + (", ...]" if tensor.numel() > limit else "]")


def same_tensor(got, expected: torch.Tensor) -> str | None:
    """None when ``got`` has ``expected``'s shape and values, else what differs."""
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor, got {type(got).__name__}"
    if got.shape != expected.shape:
        return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5, equal_nan=False):
        wrong = int((~torch.isclose(got, expected, rtol=1e-5, atol=1e-5)).sum())
        return (f"{wrong} of {got.numel()} values differ: expected {_show(expected)}, "
                f"got {_show(got)}")
    return None


def _judge_point_to_point(got, expected) -> str | None:
    tensor, collectives = got
    if collectives:
        return (f"it called {', '.join(collectives)}: build it from send/recv "
                "(or isend/irecv) only")
    return same_tensor(tensor, expected)


def _crossover_trial(fn, alpha: float, bandwidth: float, world: int):
    # the size where the model's two terms are equal:
    # alpha * 2(N-1) = 2(N-1)/N * bytes / bandwidth
    return fn(alpha, bandwidth, world), alpha * bandwidth * world


def _judge_number(got, expected) -> str | None:
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return f"expected a number of bytes, got {type(got).__name__}"
    if abs(got - expected) > 1e-6 * abs(expected):
        return f"expected {expected:,.0f} bytes, got {got:,.0f}"
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
