"""What GPUs this machine has, asked without initialising CUDA in this process.

A process that has initialised the CUDA driver cannot safely fork training ranks, and a
notebook kernel forks them (``launch``). So the questions are asked where they cost
nothing: NVML counts the GPUs (:func:`count_gpus`), a short-lived child process asks
CUDA for their names and memory (:func:`probe_cuda`, see ``_cuda_probe``), and
:func:`cuda_driver_loaded` tells whether this process has already started the driver.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

from .private_apis import nvml_device_count

PROBE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class GPU:
    """One GPU as the CUDA runtime reports it (index as renumbered by CUDA_VISIBLE_DEVICES)."""

    index: int
    name: str
    total_memory_bytes: int
    capability: tuple[int, int]

    @property
    def memory_gib(self) -> float:
        return self.total_memory_bytes / 2**30


@dataclass(frozen=True)
class CudaProbe:
    """What a child process learned from CUDA.

    Args:
        gpus: the GPUs the child could use.
        cuda_error: why CUDA could not be initialised (no driver, no device...), or None.
        cudnn_version: cuDNN version as an integer (e.g. 90100), or None without cuDNN.
        nccl_version: NCCL version string, or None when this build has no NCCL.
        probe_error: why the probe itself failed, or None.
    """

    gpus: tuple[GPU, ...] = ()
    cuda_error: str | None = None
    cudnn_version: int | None = None
    nccl_version: str | None = None
    probe_error: str | None = None

    @classmethod
    def from_json(cls, text: str) -> CudaProbe:
        facts = json.loads(text)
        gpus = tuple(
            GPU(g["index"], g["name"], int(g["total_memory_bytes"]), tuple(g["capability"]))
            for g in facts["gpus"]
        )
        return cls(gpus, facts["cuda_error"], facts["cudnn_version"], facts["nccl_version"])


def probe_cuda(timeout: float = PROBE_TIMEOUT_S) -> CudaProbe:
    """Ask CUDA about the GPUs from a child process, leaving this process's CUDA untouched.

    The child inherits this process's environment, so it sees the same
    ``CUDA_VISIBLE_DEVICES`` a training rank started from here would see.
    """
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    command = [sys.executable, "-m", "mgpu_helpers._cuda_probe"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return CudaProbe(probe_error=f"the CUDA probe did not answer within {timeout:.0f} s; "
                         "a hung driver is the usual cause: check `nvidia-smi`")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return CudaProbe(probe_error=f"the CUDA probe exited with status {done.returncode}: "
                         f"{last}")
    try:
        return CudaProbe.from_json(done.stdout)
    except (ValueError, KeyError, TypeError) as exc:
        return CudaProbe(probe_error=f"the CUDA probe printed something unreadable ({exc})")


def count_gpus() -> int:
    """How many GPUs a process started from here would see, without initialising CUDA.

    Uses NVML (through PyTorch, honouring ``CUDA_VISIBLE_DEVICES``), which is fork-safe
    and fast. Where NVML cannot answer but a GPU driver is present, falls back to the
    child-process probe of :func:`probe_cuda` (slow, but still fork-safe).
    """
    if torch.version.cuda is None and torch.version.hip is None:
        return 0
    if torch.version.cuda is not None:
        counted = nvml_device_count()
        if counted >= 0:
            return counted
    if not any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd")):
        return 0
    return len(probe_cuda().gpus)


_CUDA_ERROR_NOT_INITIALIZED = 3


def cuda_driver_loaded() -> bool:
    """True if this process has initialised the CUDA driver (so forking it is unsafe).

    ``torch.cuda.is_initialized()`` misses calls such as ``torch.cuda.is_available()``
    that initialise the driver (``cuInit``) without PyTorch's own lazy initialisation.
    The driver's library being mapped is not enough: on a GPU node ``import torch`` maps
    ``libcuda.so.1`` (cuBLASLt and cuSPARSELt open it when they load) without starting
    it, and forking is still safe then. So where it is mapped, the driver itself is asked:
    ``cuCtxGetCurrent`` answers CUDA_ERROR_NOT_INITIALIZED until ``cuInit`` has run.
    """
    if torch.cuda.is_initialized():
        return True
    try:
        with open("/proc/self/maps") as maps:
            if not any("/libcuda.so" in line for line in maps):
                return False
    except OSError:  # not Linux: only PyTorch's own flag is available
        return False
    try:  # RTLD_NOLOAD: the library already mapped, never a second copy
        driver = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        context = ctypes.c_void_p()
        return driver.cuCtxGetCurrent(ctypes.byref(context)) != _CUDA_ERROR_NOT_INITIALIZED
    except (OSError, AttributeError):  # mapped under another name: assume it started
        return True
