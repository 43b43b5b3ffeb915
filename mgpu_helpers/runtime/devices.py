"""What GPUs this machine has, asked without initialising CUDA in this process.

A process that has initialised the CUDA driver cannot safely fork training ranks, and a
notebook kernel forks them (``launch``). So the questions are asked where they cost
nothing: NVML lists the GPUs, a short-lived child process asks CUDA for their names and
memory (:func:`probe_cuda`, see ``_cuda_probe``), and :func:`cuda_driver_loaded` tells
whether this process has already started the driver.

A GPU counts only if CUDA can start on it: NVML lists GPUs that a too-old driver, or a
driver not ready, will not let CUDA use. :func:`gpu_count` is the one answer the plan of
``describe()`` and the ranks of ``launch()`` both go by: NVML's word where it lists no
GPU, else the child's (asked once per process and ``CUDA_VISIBLE_DEVICES`` setting,
:func:`cuda_probe`; ``describe()`` asks afresh and keeps its answer for ``launch()``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

from .private_apis import cudnn_library_version, nvml_device_count

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
        listed_gpus: the GPUs NVML lists (the driver sees), CUDA started or not; -1
            where NVML cannot count them (no NVML, a ROCm build, MIG devices).
    """

    gpus: tuple[GPU, ...] = ()
    cuda_error: str | None = None
    cudnn_version: int | None = None
    nccl_version: str | None = None
    probe_error: str | None = None
    listed_gpus: int = -1

    @property
    def unusable_gpus(self) -> int:
        """GPUs the driver lists but CUDA could not start on (0 when it started)."""
        return 0 if self.gpus else max(self.listed_gpus, 0)

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
    known = no_driver_answer()
    if known is not None:  # nothing for the child to find: spare its start (2 s of CPU)
        return known
    command = [sys.executable, "-m", "mgpu_helpers.runtime._cuda_probe"]
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
        probe = CudaProbe.from_json(done.stdout)
    except (ValueError, KeyError, TypeError) as exc:
        return CudaProbe(probe_error=f"the CUDA probe printed something unreadable ({exc})")
    # what the driver lists, CUDA started or not (NVML: fork-safe here, same visibility)
    return dataclasses.replace(probe, listed_gpus=_nvml_listed())


# Where a process reaches an NVIDIA GPU: the driver's device nodes (on the machine, and in
# a container given a GPU) and WSL 2's paravirtual GPU. CUDA finds no GPU without one.
NVIDIA_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/dxg")
#: What CUDA answers without a driver (the first sentence of its error, as the child says).
NO_DRIVER_ERROR = "Found no NVIDIA driver on your system."


def no_driver_answer() -> CudaProbe | None:
    """The child's answer where it is known without asking: a CUDA build of PyTorch on
    Linux with none of the :data:`NVIDIA_NODES`, where CUDA can only say it found no
    driver. The library versions come from this process (reading them starts no driver).
    None anywhere else: a ROCm build, another system, a machine with a node."""
    if not sys.platform.startswith("linux") or torch.version.cuda is None or torch.version.hip:
        return None
    if any(os.path.exists(node) for node in NVIDIA_NODES):
        return None
    cudnn = cudnn_library_version()
    nccl = None
    if torch.distributed.is_available() and torch.distributed.is_nccl_available():
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    return CudaProbe(cuda_error=NO_DRIVER_ERROR, cudnn_version=cudnn, nccl_version=nccl,
                     listed_gpus=_nvml_listed())


def _nvml_listed() -> int:
    """The GPUs NVML lists for a process started from here; -1 where it cannot tell."""
    return nvml_device_count() if torch.version.cuda is not None else -1


#: Settings that change which GPUs CUDA shows a process: an answer is kept per setting.
VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HIP_VISIBLE_DEVICES",
                   "ROCR_VISIBLE_DEVICES")
_probes: dict[tuple[str | None, ...], CudaProbe] = {}


def cuda_probe(refresh: bool = False) -> CudaProbe:
    """:func:`probe_cuda`, asked once per process and GPU visibility setting (the
    ``VISIBILITY_VARS``); ``refresh`` asks again. A probe that itself failed (a timeout,
    a crash) is not kept: the next call asks again."""
    key = tuple(os.environ.get(name) for name in VISIBILITY_VARS)
    if refresh or key not in _probes:
        probe = probe_cuda()
        if probe.probe_error is not None:
            _probes.pop(key, None)
            return probe
        _probes[key] = probe
    return _probes[key]


@dataclass(frozen=True)
class GpuCount:
    """The GPUs a rank started from here can use.

    Args:
        usable: GPUs CUDA starts on: what ``describe()`` plans and ``launch()`` starts.
        listed: GPUs NVML lists, usable or not; -1 where NVML cannot count them.
        problem: why listed GPUs are not usable (CUDA's error, or the probe's), or None.
    """

    usable: int
    listed: int
    problem: str | None = None

    @classmethod
    def from_probe(cls, probe: CudaProbe, listed: int | None = None) -> GpuCount:
        listed = probe.listed_gpus if listed is None else listed
        problem = None
        if not probe.gpus and listed != 0:
            problem = probe.cuda_error or probe.probe_error
        return cls(len(probe.gpus), listed, problem)


def gpu_count() -> GpuCount:
    """How many GPUs a process started from here can use, without initialising CUDA here.

    NVML (through PyTorch, honouring ``CUDA_VISIBLE_DEVICES``) answers first: fork-safe
    and fast. Where it lists no GPU, there is none (no child is started: CPU machines pay
    nothing). Where it lists some, or cannot count them but a GPU driver is present, the
    child-process probe says how many CUDA can start on (:func:`cuda_probe`: once per
    process and setting). A GPU CUDA cannot start on (a driver too old for this build)
    is no GPU: ``describe()`` plans CPU ranks and ``launch()`` starts them.
    """
    if torch.version.cuda is None and torch.version.hip is None:
        return GpuCount(0, 0)
    listed = _nvml_listed()
    if listed == 0:
        return GpuCount(0, 0)
    if listed < 0 and not any(os.path.exists(p)
                              for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd")):
        return GpuCount(0, 0)
    return GpuCount.from_probe(cuda_probe(), listed)


def count_gpus() -> int:
    """The GPUs a rank started from here can use (:func:`gpu_count`): 0 where CUDA cannot
    start, whatever NVML lists. Never initialises CUDA in this process."""
    return gpu_count().usable


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
