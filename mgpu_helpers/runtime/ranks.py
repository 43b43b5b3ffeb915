"""Where am I? Small helpers for code running inside a rank.

They work the same under ``mgpu_helpers.launch``, under ``torchrun`` and in a plain
single process (where the answer is "rank 0 of 1, on this process's device"), so a
training function can use them without knowing how it was started.
"""

from __future__ import annotations

import builtins
import os

import torch
import torch.distributed as dist

from .backend import backend_device_type

# Set in every rank that launch() starts (to its rank), so code can tell it runs in one.
INSIDE_RANK_VAR = "MGPU_LAUNCH_RANK"
# How many times launch(..., max_restarts=k) has restarted the ranks (torchrun's own
# variable is TORCHELASTIC_RESTART_COUNT).
RESTART_COUNT_VAR = "MGPU_RESTART_COUNT"


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 when no process group is running)."""
    return dist.get_rank() if _initialized() else 0


def world_size() -> int:
    """How many ranks take part (1 when no process group is running)."""
    return dist.get_world_size() if _initialized() else 1


def restart_count() -> int:
    """How many times the ranks were restarted before this attempt: 0 on the first, as
    under ``launch(..., max_restarts=k)`` or ``torchrun --max-restarts k``."""
    count = os.environ.get(RESTART_COUNT_VAR) or os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return int(count or 0)


def local_rank() -> int:
    """This process's rank on its own machine."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def gpu_index() -> int:
    """The GPU this rank uses: its local rank, modulo the GPUs it can see. Usually they
    are equal; under ``srun --gpus-per-task=1`` each task sees only its own GPU, as
    ``cuda:0``, whatever its local rank."""
    return local_rank() % max(1, torch.cuda.device_count())


def is_main() -> bool:
    """True on global rank 0: the rank that prints, saves checkpoints and logs."""
    return rank() == 0


def device() -> torch.device:
    """The device this rank computes on: ``cuda:<local_rank>`` when the group moves CUDA
    tensors over NCCL (``launch``'s ``"auto"`` on a GPU node, or a group of your own
    created with ``"nccl"``), else ``cpu`` (gloo ranks, or no group at all)."""
    if _initialized() and backend_device_type(dist.get_backend()) == "cuda":
        return torch.device("cuda", gpu_index())
    return torch.device("cpu")


def print0(*args, **kwargs) -> None:
    """``print`` on rank 0 only, flushed at once so it is not held in a buffer."""
    if is_main():
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)
