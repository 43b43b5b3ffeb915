"""Chapter 03's exercises: collectives built from point-to-point messages.

Each case draws its inputs afresh on every rank (whole numbers from ``os.urandom``: no
code can know another rank's values without a message, and every order of adding them
gives the same float sum); the expected result is reduced by the checker after the
reader's function has returned, so no sum exists in a rank while it runs. What a rank
sends is counted by :func:`mgpu_helpers.measure.traffic.traffic_measured`: in Python, where every
``send`` passes (the process group's and the backend's), for the per-peer rule, the
rings' least and most traffic and, in 03.1 (two rings that turn opposite ways), the
order of the messages to the two neighbours; and, on Linux, by the kernel on the
process's sockets, which no call can bypass: bytes on the rendezvous store's sockets or
on a socket opened during the call are refused, and the backend's sockets may carry no
more than the counted messages and gloo's headers (gloo's flight recorder keeps the
collectives only, no entry for a send or a receive). Files written and shared memory
made or written during the call (:func:`mgpu_helpers.measure.traffic.side_channels`) are refused
too. Off Linux the kernel's and /proc's counts are missing and the rest decide."""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from ..measure.flight_recorder import collectives_so_far
from ..measure.traffic import traffic_measured
from .core import Case, Exercise, as_number, beyond, count

_INPUT_BOUND = 2 ** 20  # sums of 4 ranks stay below 2**24: exact in float32
# gloo's headers per message, measured on the backend's sockets (PyTorch 2.14): 96 bytes
# written per send (a send-ready notice and the data's header), 48 per receive (a
# receive-ready notice); the allowance adds a third, and room for one stray notice
_HEADER_PER_SEND, _HEADER_PER_RECEIVE, _HEADER_SLACK = 128, 64, 128


def fresh_input(length: int) -> torch.Tensor:
    """Whole numbers in [-2**20, 2**20], drawn from ``os.urandom`` in each rank for each
    case: unpredictable to the code under test, exact however they are summed."""
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
    return torch.randint(-_INPUT_BOUND, _INPUT_BOUND + 1, (length,),
                         generator=generator).float()


def _collectives_since(before: int) -> list[str]:
    # gloo records no point-to-point message, so every entry here is a collective; the
    # is_p2p test keeps this right on a backend that records them too (NCCL does)
    return sorted({entry["profiling_name"] for entry in collectives_so_far()[before:]
                   if not entry.get("is_p2p", False)})


def ring_bounds(elements: int, world: int, phases: int) -> tuple[int, int]:
    """The fewest and the most elements one rank of a correct ring sends, to its one
    neighbour: in each phase every chunk but one, a different one in each phase (the
    chunk a rank finishes reducing is not the one it receives last when gathering), each
    chunk at most ceil(elements / world) long (``tensor_split``'s and ``chunk``'s)."""
    largest = math.ceil(elements / world)
    return (phases * elements - min(phases * largest, elements),
            phases * (world - 1) * largest)


def _summary(traffic, elements: int, phases: int, element_size: int) -> dict:
    """What this rank sent (and how), with the ring's least and most, in elements."""
    rank, world = dist.get_rank(), dist.get_world_size()
    least, most = ring_bounds(elements, world, phases)
    kernel = traffic.kernel
    return {"elements": sum(message[1] for message in traffic.sent),
            "bytes": sum(message[2] for message in traffic.sent),
            "peers": sorted({message[0] for message in traffic.sent}),
            "least": least, "budget": most, "element_size": element_size,
            "neighbours": ((rank + 1) % world, (rank - 1) % world),
            "store_calls": sorted(set(traffic.store_calls)),
            "side_channels": list(dict.fromkeys(traffic.side_channels)),
            "kernel": None if kernel is None else vars(kernel).copy(),
            "allowance": (_HEADER_PER_SEND * len(traffic.sent)
                          + _HEADER_PER_RECEIVE * len(traffic.received) + _HEADER_SLACK)}


def _kept(tensor: torch.Tensor) -> tuple[bytes, torch.Size]:
    # immutable: code that finds the checker's objects cannot change what it compares to
    return tensor.detach().cpu().contiguous().numpy().tobytes(), tensor.shape


def _restored(kept: tuple[bytes, torch.Size]) -> torch.Tensor:
    data, shape = kept
    return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)


def _unchanged(tensor: torch.Tensor, kept: tuple[bytes, torch.Size]) -> bool:
    return (tensor.dtype == torch.float32 and tensor.shape == kept[1]
            and _kept(tensor)[0] == kept[0])


def _ring_trial(fn, length: int):
    tensor = fresh_input(length)
    kept, size = _kept(tensor), tensor.element_size()
    before = len(collectives_so_far())
    with traffic_measured() as traffic:
        returned = fn(tensor)
    collectives = _collectives_since(before)
    expected = _restored(kept)
    dist.all_reduce(expected)  # after the call: no sum existed while it ran
    got = {"result": tensor, "collectives": collectives, "into": "the input tensor",
           "unchanged": _unchanged(tensor, kept),
           "returned": returned if isinstance(returned, torch.Tensor) else None,
           "traffic": _two_ring_summary(traffic, length, size)}
    return got, expected


def _two_ring_summary(traffic, length: int, element_size: int) -> dict:
    """What this rank sent, for the two rings of 03.1: every message in the order sent
    (peer, elements, bytes), the halves' lengths (``tensor_split(2)``'s), and what the channel
    judge needs."""
    rank, world = dist.get_rank(), dist.get_world_size()
    summary = _summary(traffic, length, 2, element_size)
    summary.update(messages=list(traffic.sent),
                   halves=((length + 1) // 2, length // 2), world=world,
                   neighbours=((rank + 1) % world, (rank - 1) % world))
    return summary


def _reduce_scatter_trial(fn, length: int):
    world = dist.get_world_size()
    source = fresh_input(length * world)
    kept = _kept(source)
    output = torch.full((length,), float("nan"))
    before = len(collectives_so_far())
    with traffic_measured() as traffic:
        returned = fn(output, source.clone())
    collectives = _collectives_since(before)
    expected = _restored(kept)
    dist.all_reduce(expected)  # after the call: no sum existed while it ran
    expected = expected.chunk(world)[dist.get_rank()].clone()
    got = {"result": output, "collectives": collectives, "into": "`output`",
           "unchanged": bool(output.isnan().all()),
           "returned": returned if isinstance(returned, torch.Tensor) else None,
           "traffic": _summary(traffic, length * world, 1, source.element_size())}
    return got, expected


def _value(value: float) -> str:
    return f"{value:.9g}"


def _position(flat_index: int, shape: torch.Size) -> str:
    if len(shape) <= 1:
        return str(flat_index)
    return str(tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), shape)))


def same_tensor(got, expected: torch.Tensor) -> str | None:
    """None when ``got`` has ``expected``'s shape and values, else what differs: how many
    values, and the first that does, with its index, the expected value and the one got."""
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor, got {type(got).__name__}"
    if got.shape != expected.shape:
        return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    got, expected = got.double(), expected.double()  # any float dtype compares
    differs = ~torch.isclose(got, expected, rtol=1e-5, atol=1e-5, equal_nan=False)
    if differs.any():
        wrong = int(differs.sum())
        first = int(differs.flatten().nonzero()[0])
        where = "at" if wrong == 1 else "the first at"
        return (f"{wrong} of {count(got.numel(), 'value')} "
                f"{'differs' if wrong == 1 else 'differ'}, {where} index "
                f"{_position(first, got.shape)}: expected "
                f"{_value(expected.flatten()[first].item())}, "
                f"got {_value(got.flatten()[first].item())}")
    return None


def _elements(n: int) -> str:
    return f"{n:,} element{'' if n == 1 else 's'}"


def _judge_channels(traffic: dict) -> str | None:
    """What went around send/recv: the store, a connection of its own, or sends the
    Python-level count did not see."""
    kernel = traffic["kernel"] or {}
    if traffic["store_calls"] or kernel.get("store"):
        used = (f" (it called {', '.join(traffic['store_calls'])})"
                if traffic["store_calls"] else
                f" ({kernel['store']:,} bytes went through the store's connection)")
        return ("it exchanged data through a store (the rendezvous TCPStore, or one of its "
                f"own), not through messages{used}: the data must go through send/recv (or "
                "isend/irecv) between ranks; the store is only for the ranks to find each "
                "other")
    if traffic.get("side_channels"):
        return (f"data can pass between the ranks outside messages, and this rank "
                f"{'; '.join(traffic['side_channels'][:3])} during the call: the ranks must "
                "exchange data through send/recv (or isend/irecv) only, not through files "
                "or shared memory")
    if kernel.get("new_sockets"):
        return (f"{kernel['new_sockets']:,} bytes went through a connection opened during "
                "the call, not through the process group: the data must go through "
                "send/recv (or isend/irecv)")
    counted = traffic["bytes"] + traffic["allowance"]
    if kernel.get("peer_written", 0) > counted:
        return (f"this rank's connections to the other ranks carried "
                f"{kernel['peer_written']:,} bytes, but its send calls account for "
                f"{traffic['bytes']:,} (with gloo's headers, at most {counted:,}): send "
                "through torch.distributed's send or isend (or P2POp), so that each "
                "message is counted")
    return None


def _judge_ring_traffic(traffic: dict) -> str | None:
    """One neighbour, and between the ring's least and most bytes (the tensor's elements:
    a message in another dtype counts by its bytes)."""
    right, left = traffic["neighbours"]
    peers = set(traffic["peers"])
    size, sent = traffic["element_size"], traffic["bytes"]
    neighbour = (f"rank {right}" if right == left else
                 f"rank {right}, or rank {left} for a ring that turns the other way")
    ranks = ", ".join(map(str, traffic["peers"]))
    to = (f" to rank{'s' if len(peers) > 1 else ''} {ranks}" if peers else "")
    what = (f"the sums are right, but this rank sent {_elements(traffic['elements'])} "
            f"({sent:,} bytes){to}")
    if sent > traffic["budget"] * size or not (peers <= {right} or peers <= {left}):
        return (f"{what}; a ring sends at most {traffic['budget'] * size:,} bytes "
                f"({_elements(traffic['budget'])}), to one neighbour only "
                f"({neighbour}): pass chunks along the ring, not whole tensors to every rank")
    if sent < traffic["least"] * size:
        return (f"{what}; in a ring each rank sends at least {_elements(traffic['least'])} "
                f"({traffic['least'] * size:,} bytes) to its neighbour: the values of every "
                "rank must reach the others in messages, chunk by chunk")
    return None


_HALF = ("first", "second")  # the halves of tensor_split(2): to rank + 1, to rank - 1
_TURN = ("rank + 1", "rank − 1")


def _judge_two_rings(traffic: dict) -> str | None:
    """03.1's traffic: to the two neighbours only; each message one chunk of a half; each
    half's ring between its least and most bytes, in its own direction; and the two
    rings advancing together (judged from the order of the messages, where each
    direction carries at least two that hold data). Sizes count by bytes, so that a
    message in another dtype counts for what it carries."""
    world, size = traffic["world"], traffic["element_size"]
    right, left = traffic["neighbours"]
    halves = traffic["halves"]
    messages = [tuple(message) for message in traffic["messages"]]  # (peer, elements, bytes)
    sent = "the sums are right, but this rank sent"
    strays = sorted({peer for peer, _, _ in messages} - {right, left})
    if strays:
        ranks = ", ".join(map(str, strays))
        only = (f"its neighbour, rank {right} (both rings)" if right == left else
                f"its two neighbours, rank {right} (rank + 1, the first half's ring) and "
                f"rank {left} (rank − 1, the second half's)")
        return (f"{sent} messages to rank{'s' if len(strays) > 1 else ''} {ranks}; each "
                f"rank sends only to {only}: pass chunks along the rings, not whole "
                "tensors to every rank")
    ring = {right: 0, left: 1} if right != left else {right: None}  # peer -> its half
    to = {peer: sum(nbytes for p, _, nbytes in messages if p == peer) for peer in ring}
    if right != left:
        for k, (peer, other) in enumerate(((right, left), (left, right))):
            if halves[k] and not to[peer]:
                return (f"{sent} all its data to rank {other} ({to[other]:,} bytes) and "
                        f"none to rank {peer}: the {_HALF[k]} half goes round the ring "
                        f"that turns the other way, to {_TURN[k]} (rank {peer}); a one-way "
                        "ring leaves that direction of every link idle")
    for peer, elements, nbytes in messages:
        k = ring[peer]
        half = halves[0] if k is None else halves[k]  # on 2 ranks: the larger half's
        largest = math.ceil(half / world)
        if nbytes > largest * size:
            which = "the larger half" if k is None else f"the {_HALF[k]} half"
            return (f"{sent} a message of {_elements(elements)} ({nbytes:,} bytes) to rank "
                    f"{peer}; a message holds one chunk of one half, at most "
                    f"{_elements(largest)} here ({which} has {_elements(half)}, in {world} "
                    "chunks): split the tensor with tensor_split(2), each half into N "
                    "chunks, and send one chunk of each half per step")
    for peer, k in ring.items():
        lengths = halves if k is None else halves[k:k + 1]
        name = ("the two halves' rings" if k is None else
                f"the {_HALF[k]} half's ring (to {_TURN[k]}, {_elements(halves[k])})")
        bounds = [ring_bounds(h, world, 2) for h in lengths]
        least, most = sum(b[0] for b in bounds) * size, sum(b[1] for b in bounds) * size
        if not least <= to[peer] <= most:
            limit = (f"at most {_elements(most // size)} ({most:,} bytes)"
                     if to[peer] > most else
                     f"at least {_elements(least // size)} ({least:,} bytes)")
            why = ("pass chunks along the ring, each once per phase" if to[peer] > most else
                   "the values of every rank must reach the others in messages, chunk by "
                   "chunk")
            elements = sum(e for p, e, _ in messages if p == peer)
            return (f"{sent} {_elements(elements)} ({to[peer]:,} bytes) to rank {peer}; "
                    f"{name} sends it {limit}: {why}")
    return None if right == left else _judge_together(messages, right, left, halves,
                                                      world)


def _judge_together(messages: list, right: int, left: int, halves: tuple,
                    world: int) -> str | None:
    """The two rings advance together: some message to each neighbour comes before the
    last to the other (where each gets at least two that hold data: a ring that skips
    its empty chunks may send one only); and, where no chunk is empty (every step sends
    one chunk each way), neither ring is ever two messages ahead of the other."""
    order = [peer for peer, _, nbytes in messages if nbytes]
    at = {peer: [i for i, p in enumerate(order) if p == peer] for peer in (right, left)}
    advance = "the two rings must advance together, one chunk each way per step"
    if len(at[right]) >= 2 and len(at[left]) >= 2:  # fewer: the order says nothing
        for early, late in ((right, left), (left, right)):
            if at[early][-1] < at[late][0]:
                return (f"the sums are right, but this rank sent all {len(at[early])} "
                        f"messages to rank {early} before the first to rank {late}: "
                        f"{advance}")
    if min(halves) >= world:
        done = {right: 0, left: 0}
        for peer in order:
            done[peer] += 1
            other = left if peer == right else right
            if done[peer] >= done[other] + 2:
                so_far = f"only {done[other]}" if done[other] else "none"
                return (f"the sums are right, but this rank had sent {done[peer]} messages "
                        f"to rank {peer} and {so_far} to rank {other}: {advance}")
    return None


def _judge_point_to_point(got, expected) -> str | None:
    traffic = got["traffic"]
    if got["collectives"]:
        return (f"it called {', '.join(got['collectives'])}: build it from send/recv "
                "(or isend/irecv) only")
    through = _judge_channels(traffic)
    if through:
        return through
    wrong = same_tensor(got["result"], expected)
    returned = got["returned"]
    if wrong and returned is not None and (
            got["unchanged"] or same_tensor(returned, expected) is None):
        state = ("was left unchanged" if got["unchanged"] else "does not hold the result")
        return (f"{got['into']} {state} and a new tensor was returned: the result must be "
                f"written into {got['into']}, in place (the caller reads the tensor it "
                "passed; what the function returns is ignored)")
    if wrong:
        return wrong
    if "messages" in traffic:  # 03.1: two rings that turn opposite ways
        return _judge_two_rings(traffic)
    return _judge_ring_traffic(traffic)


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
        key="03.1", difficulty=3, minutes=60,
        title="an all-reduce on two rings that turn opposite ways",
        function="my_bidirectional_all_reduce",
        # lengths no N divides; on 4 ranks, 5 elements: both halves shorter than N
        cases=[Case(f"{world} ranks, {length} elements", (length,), world)
               for world, length in ((2, 9), (3, 7), (4, 10), (4, 5), (3, 1000))],
        trial=_ring_trial, judge=_judge_point_to_point,
        hint=("write one ring step as a function of the step, the ring's chunks and its "
              "neighbours (section 2's exchange, with the neighbour it sends to and the one "
              "it receives from as arguments); in each step, start it for both halves, "
              "then wait for both",
              "a blocking send can wait until its receiver is ready: if every rank sends "
              "first, nobody receives, so start both sends with isend (or "
              "batch_isend_irecv) before receiving; the ring that turns the other way "
              "mirrors section 2's chunk indices (where it has r - s - 1, that ring has "
              "r + s + 1); on 2 ranks both neighbours are one rank, so receive the two "
              "halves' chunks in the order they were sent"),
    ),
    Exercise(
        key="03.2", difficulty=2, minutes=30,
        title="a reduce-scatter from send and recv",
        function="my_reduce_scatter",
        cases=[Case(f"{world} ranks, {length} element{'s' if length > 1 else ''} out",
                    (length,), world)
               for world, length in ((2, 4), (3, 5), (4, 1))],
        trial=_reduce_scatter_trial, judge=_judge_point_to_point,
        hint="rank r must end with chunk r of the sum: in the ring's N-1 steps, the chunk "
             "a rank sends first decides which one it finishes with",
    ),
    Exercise(
        key="03.3", difficulty=1, minutes=15,
        title="where latency and bandwidth cost the same",
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
