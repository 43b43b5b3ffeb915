"""Argument checks, and what a launch resolves to: backend, rank count, start method."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

import torch.distributed as dist

from ..runtime.backend import auto_backend, backend_device_type
from ..runtime.devices import cuda_driver_loaded
from ..runtime.ranks import INSIDE_RANK_VAR
from .failure import LaunchError

BACKENDS = ("auto", "gloo", "nccl", "cpu:gloo,cuda:nccl")


def check_callable(fn) -> None:
    if not callable(fn):
        raise TypeError(
            f"launch() needs a function to run on every rank, got {type(fn).__name__}. "
            "Likely cause: the function was called instead of passed, as in "
            "launch(train()). Pass it uncalled: launch(train, arg1, ...)."
        )


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def check_seconds(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def check_not_inside_rank() -> None:
    inside = os.environ.get(INSIDE_RANK_VAR)
    if inside is not None:
        raise LaunchError(
            f"launch() was called from inside rank {inside} of a running launch. "
            "Ranks cannot start ranks: call the function directly inside the rank, or "
            "call launch() only from the notebook or the script's top level."
        )


def check_no_group_in_this_process() -> None:
    if dist.is_available() and dist.is_initialized():
        raise LaunchError(
            "a process group is already initialised in this process, so launch() would "
            "start ranks that cannot join it. Call dist.destroy_process_group() first, or "
            "restart the kernel."
        )


def resolve_backend(backend: str, gpus: int, nccl_available: bool | None = None,
                    no_gpu_reason: str | None = None) -> str:
    """The process-group backend a launch with ``backend`` uses on a machine with
    ``gpus`` usable GPUs (``devices.count_gpus()``, the count ``describe()`` plans
    with): ``"auto"`` is NCCL for CUDA tensors plus gloo for CPU tensors
    (``"cpu:gloo,cuda:nccl"``) with GPUs, else gloo; ``"gloo"`` is gloo everywhere.
    ``no_gpu_reason``: why GPUs the driver lists are unusable (CUDA's error), if so."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, "
                         f"got {backend!r}")
    nccl_available = dist.is_nccl_available() if nccl_available is None else nccl_available
    if backend == "auto":
        return auto_backend(gpus, nccl_available)
    if backend_device_type(backend) == "cuda":
        if not nccl_available:
            raise LaunchError(f"backend={backend!r} but this PyTorch build has no NCCL; "
                              "use 'gloo' or 'auto'")
        if gpus == 0 and no_gpu_reason:
            raise LaunchError(
                f"backend={backend!r} needs GPUs, and CUDA cannot start on the ones here: "
                f"{no_gpu_reason} `python -m mgpu_helpers` says how to fix it; until then "
                "use backend='auto' or 'gloo' (CPU ranks over gloo)"
            )
        if gpus == 0:
            raise LaunchError(
                f"backend={backend!r} needs GPUs and none is visible here (check "
                "CUDA_VISIBLE_DEVICES and `python -m mgpu_helpers`); use backend='auto' (CPU "
                "ranks over gloo where there is no GPU) or backend='gloo'"
            )
    return backend


def resolve_nprocs(nprocs, backend: str, gpus: int) -> int:
    """How many ranks: ``nprocs``, or one per GPU when it is None; GPU ranks need a GPU
    each. ``backend`` is the resolved one (:func:`resolve_backend`)."""
    if nprocs is None:
        if gpus == 0 or backend_device_type(backend) != "cuda":
            raise ValueError(
                "nprocs=None means one rank per GPU, and this launch has no GPU to count "
                f"(backend {backend!r}, {gpus} GPU(s) visible). Say how many ranks to run "
                "as CPU processes, e.g. launch(fn, nprocs=2)."
            )
        return gpus
    check_positive_int("nprocs", nprocs)
    if backend_device_type(backend) == "cuda" and nprocs > gpus:
        raise LaunchError(
            f"nprocs={nprocs} GPU ranks need {nprocs} GPUs, but {gpus} "
            f"{'is' if gpus == 1 else 'are'} visible. Use nprocs<={gpus} (the plan of "
            "mgpu_helpers.describe() gives one rank per GPU), or backend='gloo' for CPU ranks."
        )
    return nprocs


def resolve_start_method(start_method: str) -> str:
    available = mp.get_all_start_methods()
    if start_method not in ("auto", "fork", "spawn", "forkserver"):
        raise ValueError(
            f"start_method must be 'auto', 'fork', 'spawn' or 'forkserver', got {start_method!r}"
        )
    if start_method == "auto":
        safe_platform = sys.platform.startswith("linux") and "fork" in available
        return "fork" if safe_platform and not cuda_driver_loaded() else "spawn"
    if start_method not in available:
        raise LaunchError(f"start_method={start_method!r} is not available on {sys.platform}; "
                          "use 'spawn'")
    if start_method == "fork" and cuda_driver_loaded():
        raise LaunchError(
            "refusing to fork: CUDA is already initialised in this process, and forked "
            "children cannot use it. Likely cause: an earlier call such as "
            "torch.cuda.is_available() (fork-safe only with PYTORCH_NVML_BASED_CUDA_CHECK=1), "
            "tensor.cuda() / .to('cuda') or nn.DataParallel on a GPU; "
            "torch.cuda.device_count() only where NVML cannot count the GPUs. Restart the "
            "kernel and launch before touching CUDA (mgpu_helpers.describe() is safe), or "
            "pass start_method='spawn'."
        )
    return start_method


def check_port(port) -> None:
    if port is None:
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"master_port must be an int in 1..65535 or None, got {port!r}")
