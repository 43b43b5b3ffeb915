"""This rank's flight recorder, read in the process: the collectives it has run.

Every process group keeps a ring buffer of its last collectives (2,000 by default,
``TORCH_FR_BUFFER_SIZE``), gloo's included; chapter 09 shows it. Each entry is a dict
with, among others, ``profiling_name`` ("gloo:all_reduce"), ``input_sizes``,
``output_sizes``, ``input_dtypes`` and ``is_p2p``. Counting what a piece of code ran:
``before = len(collectives_so_far())``, run it, then ``collectives_so_far()[before:]``
(valid while fewer entries than the buffer holds have been recorded).
"""

from __future__ import annotations

import pickle

import torch


def collectives_so_far() -> list[dict]:
    """The flight recorder's entries of this process, oldest first."""
    dump = torch._C._distributed_c10d._dump_fr_trace(includeStackTraces=False)
    return pickle.loads(dump)["entries"]
