"""This rank's flight recorder, read in the process: the collectives it has run.

Each process keeps a ring buffer of the last collectives of its gloo process groups
(2,000 entries by default in the pinned PyTorch, ``TORCH_FR_BUFFER_SIZE``; older releases
default to 0, off); chapter 09 shows it. NCCL groups record into a recorder of their own,
read with a call of their own, which :func:`collectives_so_far`
does not read: the labs that count with it run on gloo. Each entry is a dict with, among
others, ``pg_id`` (its group), ``profiling_name`` ("gloo:all_reduce"), ``input_sizes``,
``output_sizes``, ``input_dtypes`` and ``is_p2p``. Gloo records collectives only: its
``send``, ``isend``, ``recv`` and ``irecv`` leave no entry, so ``is_p2p`` is False in every
gloo entry (NCCL also records its point-to-point messages, "nccl:send 0->1", with ``is_p2p``
True). Counting what a piece of code ran: ``before = len(collectives_so_far())``, run it,
then ``collectives_so_far()[before:]`` (valid while fewer entries than the buffer holds
have been recorded).
"""

from __future__ import annotations

import pickle

from ..runtime.private_apis import flight_recorder_dump


def collectives_so_far() -> list[dict]:
    """The entries of this process's gloo flight recorder, oldest first."""
    return pickle.loads(flight_recorder_dump())["entries"]
