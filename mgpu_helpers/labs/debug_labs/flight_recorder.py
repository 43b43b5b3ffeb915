"""The flight recorder labs: PyTorch's record of each process's recent collectives, read
from dumps to find the collective where the ranks diverged.

:func:`lab_flight_recorder` hangs Lab 2's mismatched collectives and has each rank dump
its record meanwhile; :func:`flight_records` reads the dumps back. Counting a piece of
code's collectives in a running rank is :mod:`mgpu_helpers.measure.flight_recorder`'s job; this
module reads the whole dump, the form the recorder writes on a timeout.
"""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from ...runtime.private_apis import flight_recorder_dump
from ...runtime.ranks import rank
from .desync import lab_mismatched_order


def lab_flight_recorder(folder: str, dump_after: float = 1.5) -> None:
    """Lab 2's collectives in a different order on each rank, with PyTorch's flight
    recorder: after ``dump_after`` seconds a timer thread writes this rank's record of
    its recent collectives to ``folder`` (what ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` does for
    NCCL when the watchdog fires), while the rank hangs until the group's timeout."""

    def dump():
        records = flight_recorder_dump()
        Path(folder, f"rank{rank()}.pkl").write_bytes(records)

    timer = threading.Timer(dump_after, dump)
    timer.daemon = True
    timer.start()
    dist.all_reduce(torch.ones(2))  # a matched collective first
    lab_mismatched_order()


def lab_one_recorder_per_process() -> list[dict]:
    """Inside a rank: one all-reduce on the default group, one on a second group, then
    one dump of the flight recorder. The recorder is one per process, shared by its
    groups: the dump holds both collectives, each tagged with its group's ``pg_id`` and
    numbered in that group's own sequence, and each with the Python stack of its call
    (``frames``, recorded unless the dump leaves them out). Returns, per collective,
    ``{"pg_id", "seq", "name", "called_here"}`` (``called_here``: this function is in
    the recorded stack)."""
    group = dist.new_group()
    dist.all_reduce(torch.ones(2))
    dist.all_reduce(torch.ones(3), group=group)
    dump = flight_recorder_dump(stack_traces=True)
    return [{"pg_id": entry["pg_id"], "seq": entry["collective_seq_id"],
             "name": entry["profiling_name"],
             "called_here": any(frame["name"] == "lab_one_recorder_per_process"
                                for frame in entry["frames"])}
            for entry in pickle.loads(dump)["entries"][-2:]]


def flight_records(folder: str, ranks: int) -> list[dict]:
    """Each rank's dump from :func:`lab_flight_recorder`: its collectives as
    ``(sequence number, name, input sizes)`` and the last one it completed."""
    records = []
    for index in range(ranks):
        dump = pickle.loads(Path(folder, f"rank{index}.pkl").read_bytes())
        entries = [(e["collective_seq_id"], e["profiling_name"],
                    [list(size) for size in e["input_sizes"]]) for e in dump["entries"]]
        (status,) = dump["pg_status"].values()
        records.append({"collectives": entries,
                        "last_completed": status["last_completed_collective"]})
    return records
