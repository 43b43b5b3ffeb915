"""When each rank computed what: the recorded timeline of a pipeline step, its measured
idle share, how long each pass started after its input existed, the same step replayed
with instant transfers, and the theory's bubble.

K is the number of ranks, v the virtual stages (model pieces) each rank holds, M the
number of micro-batches.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    rank: int          # the rank that computed: one row of the Gantt chart
    kind: str          # "forward" or "backward"
    micro_batch: int
    start: float       # seconds, time.perf_counter (one clock for all processes of a host)
    end: float
    virtual_stage: int | None = None  # the model piece, where a rank holds several


class Timeline:
    """Records a rank's compute intervals. Idle time is what lies between them: the
    pipeline steps record only the computation, never the wait for a message."""

    def __init__(self, rank: int):
        self.rank = rank
        self.events: list[Event] = []

    @contextmanager
    def record(self, kind: str, micro_batch: int, virtual_stage: int | None = None):
        start = time.perf_counter()
        yield
        self.events.append(Event(self.rank, kind, micro_batch, start, time.perf_counter(),
                                 virtual_stage))


def bubble_fraction(events: Sequence[Event]) -> float:
    """Measured idle share of the pipeline: 1 - busy time / (ranks x span), where span
    runs from the first start to the last end over all ranks (the rows of the chart,
    ``Event.rank``; a rank's virtual stages share its row)."""
    if not events:
        raise ValueError("no events recorded")
    ranks = {e.rank for e in events}
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1 - busy / (len(ranks) * span)


def _piece(event: Event) -> int:
    """The model piece an event ran: its virtual stage, else its rank's one piece."""
    return event.rank if event.virtual_stage is None else event.virtual_stage


def _input_of(event: Event, last: int) -> tuple[str, int, int] | None:
    """The pass whose output ``event`` needs, as ``(kind, piece, micro_batch)``: the
    previous piece's forward of its micro-batch for a forward pass, the next piece's
    backward for a backward pass; None for the first piece's forward and the last
    piece's backward, which need no other piece."""
    piece = _piece(event)
    if event.kind == "forward":
        return ("forward", piece - 1, event.micro_batch) if piece > 0 else None
    return ("backward", piece + 1, event.micro_batch) if piece < last else None


def input_waits(events: Sequence[Event]) -> list[float]:
    """For every pass that needs another piece's output, how long after that output was
    computed the pass started, read from the ranks' own clocks (``time.perf_counter``,
    one clock for all processes of a host): a forward pass after the previous piece's
    forward of its micro-batch, a backward pass after the next piece's backward. All
    values above 0 show that each pass started once its input existed, so the wait for
    the message lies outside the pass's box.

    Raises ValueError when a pass appears twice or the pass another one needs is missing:
    the events are then not all ranks' events of one step."""
    if not events:
        raise ValueError("no events recorded")
    done: dict[tuple[str, int, int], Event] = {}
    for event in events:
        key = (event.kind, _piece(event), event.micro_batch)
        if key in done:
            raise ValueError(f"pass {key} appears twice: pass one step's events")
        done[key] = event
    last = max(_piece(e) for e in events)
    waits = []
    for event in events:
        needs = _input_of(event, last)
        if needs is None:
            continue
        if needs not in done:
            raise ValueError(f"pass {(event.kind, _piece(event), event.micro_batch)} needs "
                             f"{needs}, which is not among the events: pass all ranks' "
                             "events of one step")
        waits.append(event.start - done[needs].end)
    return waits


def instant_transfers(events: Sequence[Event]) -> list[Event]:
    """The same timeline as if every message arrived the moment it was sent: each rank
    runs the same passes in the same order, each taking as long as it took, and starts
    each as soon as the rank is free and the pass's input is ready (a forward pass needs
    the previous piece's forward of that micro-batch, a backward pass the next piece's
    backward). The difference in :func:`bubble_fraction` is what transfers cost."""
    if not events:
        raise ValueError("no events recorded")
    last = max(_piece(e) for e in events)
    origin = min(e.start for e in events)
    queues = {rank: sorted((e for e in events if e.rank == rank), key=lambda e: e.start)
              for rank in sorted({e.rank for e in events})}
    free = dict.fromkeys(queues, origin)
    done: dict[tuple[str, int, int], float] = {}
    replayed: list[Event] = []
    progress = True
    while progress:
        progress = False
        for rank, queue in queues.items():
            while queue:
                event = queue[0]
                needs = _input_of(event, last)
                if needs is not None and needs not in done:
                    break
                start = max(free[rank], origin if needs is None else done[needs])
                end = start + event.end - event.start
                replayed.append(Event(event.rank, event.kind, event.micro_batch, start, end,
                                      event.virtual_stage))
                done[event.kind, _piece(event), event.micro_batch] = free[rank] = end
                queue.pop(0)
                progress = True
    if any(queues.values()):
        stuck = {rank: (queue[0].kind, _piece(queue[0]), queue[0].micro_batch)
                 for rank, queue in queues.items() if queue}
        raise ValueError(f"these events are not a pipeline step: ranks wait for passes "
                         f"that never run first ({stuck}); pass all ranks' events of one step")
    return replayed


def check_counts(ranks: int, micro_batches: int, virtual_stages: int) -> None:
    """Refuse a K, M or v that is not a whole number >= 1, naming it."""
    for name, value in (("ranks", ranks), ("micro_batches", micro_batches),
                        ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def theoretical_bubble(ranks: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle share of the step with equal pieces and free communication: (K-1)/(v·M+K-1)
    for K ranks holding v virtual stages each and M micro-batches, whatever the ratio of
    backward to forward time. For v = 1 (GPipe, 1F1B) it is (K-1)/(M+K-1)."""
    check_counts(ranks, micro_batches, virtual_stages)
    return (ranks - 1) / (virtual_stages * micro_batches + ranks - 1)


def bubble_to_compute(ranks: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The same bubble as Narayanan et al. (2021) state it: idle time over the ideal
    compute time (not over the whole step), (K-1)/(v·M). A measured idle share b
    converts to this form as b / (1 - b)."""
    check_counts(ranks, micro_batches, virtual_stages)
    return (ranks - 1) / (virtual_stages * micro_batches)


def ideal_speedup(ranks: int, micro_batches: int) -> float:
    """Speed-up of M micro-batches over the naive split (M = 1): K*M/(M+K-1)."""
    return ranks * micro_batches / (micro_batches + ranks - 1)
