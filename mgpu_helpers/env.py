"""The environment report: what this machine has, and how the workbook will use it.

``describe()`` gathers versions, devices and the ``CUDA_VISIBLE_DEVICES`` setting into an
:class:`EnvReport`, which shows as an HTML table in a notebook and as text in a terminal
(``python -m mgpu_helpers``). It never initialises CUDA in the calling process: the GPU
questions are asked in a short-lived child process (see ``_cuda_probe``), because a
process that has initialised CUDA cannot fork training ranks afterwards.
"""

from __future__ import annotations

import ctypes
import html
import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from .visible_devices import ENV_VAR, VisibleDevices, parse_cuda_visible_devices

#: Ranks the workbook simulates as CPU processes when there is no GPU.
SIMULATED_RANKS = 2
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


#: What ``backend="auto"`` means on a machine with GPUs and NCCL: one process group with
#: two backends, NCCL for CUDA tensors and gloo for CPU tensors. A GPU-capable cell then
#: all-reduces its CUDA gradients over NCCL, and a small CPU tensor (a metric, a flag)
#: still works, where a pure NCCL group would refuse it.
GPU_BACKEND = "cpu:gloo,cuda:nccl"


def auto_backend(gpu_count: int, nccl_available: bool) -> str:
    """The backend ``launch(backend="auto")`` uses: NCCL (+ gloo for CPU tensors) with
    GPUs and a PyTorch build that has NCCL, else gloo (ranks compute on the CPU)."""
    return GPU_BACKEND if gpu_count > 0 and nccl_available else "gloo"


def backend_device_type(backend: str) -> str:
    """``"cuda"`` when a group created with ``backend`` moves CUDA tensors (NCCL), else
    ``"cpu"``: the device a rank of such a group computes on."""
    return "cuda" if "nccl" in str(backend) else "cpu"


@dataclass(frozen=True)
class DevicePlan:
    """How the workbook will run parallel ranks on this machine."""

    nprocs: int
    backend: str
    device_type: str
    summary: str


def plan_for(gpu_count: int, nccl_available: bool, usable_cores: int) -> DevicePlan:
    """The plan of GPU-capable cells: one process per GPU (NCCL for CUDA tensors, gloo
    for CPU tensors), else CPU ranks over gloo. CPU checks ignore it: they pin gloo."""
    backend = auto_backend(gpu_count, nccl_available)
    if gpu_count > 0 and backend != "gloo":
        noun = "GPU" if gpu_count == 1 else "GPUs"
        summary = (f"{gpu_count} {noun}: one process per GPU, NCCL for CUDA tensors "
                   "(gloo for CPU tensors)")
        return DevicePlan(gpu_count, backend, "cuda", summary)
    if gpu_count > 0:
        summary = (f"{gpu_count} GPU(s), but this PyTorch build has no NCCL: "
                   f"{SIMULATED_RANKS} ranks compute on the CPU over gloo")
        return DevicePlan(SIMULATED_RANKS, "gloo", "cpu", summary)
    summary = (f"no GPU: {SIMULATED_RANKS} ranks simulated as CPU processes over gloo "
               f"(one thread each, on {usable_cores} usable CPU core"
               f"{'' if usable_cores == 1 else 's'})")
    return DevicePlan(SIMULATED_RANKS, "gloo", "cpu", summary)


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _cudnn_text(version: int | None) -> str:
    if version is None:
        return "not in this build"
    major, rest = divmod(version, 10000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


@dataclass(frozen=True)
class EnvReport:
    """A snapshot of the software, hardware and plan; render with ``str()`` or in a notebook."""

    python: str
    python_executable: str
    platform: str
    torch: str
    cuda_build: str | None
    cuda_error: str | None
    cudnn: str
    nccl: str | None
    gloo: bool
    cpu_cores: int
    usable_cores: int
    torch_threads: int
    gpus: tuple[GPU, ...]
    visible_devices: VisibleDevices
    plan: DevicePlan
    problems: tuple[str, ...] = field(default_factory=tuple)

    @property
    def cuda_available(self) -> bool:
        return bool(self.gpus)

    def rows(self) -> list[tuple[str, list[tuple[str, str]]]]:
        """The report as sections of (label, value) rows, shared by both renderings."""
        if self.gpus:
            cuda = f"yes, {len(self.gpus)} device{'s' if len(self.gpus) > 1 else ''}"
        elif self.cuda_build is None:
            cuda = "no: this PyTorch build has no CUDA"
        else:
            cuda = f"no: {self.cuda_error or 'no GPU found'}"
        software = [
            ("Python", f"{self.python} ({self.python_executable})"),
            ("Platform", self.platform),
            ("PyTorch", self.torch),
            ("CUDA (build)", self.cuda_build or "none (CPU-only build)"),
            ("CUDA available", cuda),
            ("cuDNN", self.cudnn),
            ("NCCL", self.nccl or "not available in this build"),
            ("gloo", "available" if self.gloo else "not available"),
        ]
        gpu_rows = [
            (f"cuda:{g.index}", f"{g.name}, {g.memory_gib:.1f} GiB, "
             f"compute capability {g.capability[0]}.{g.capability[1]}")
            for g in self.gpus
        ] or [("GPUs", "none")]
        shown = "unset" if self.visible_devices.raw is None else repr(self.visible_devices.raw)
        hardware = [
            ("CPU cores", f"{self.usable_cores} usable of {self.cpu_cores}"),
            ("torch threads", str(self.torch_threads)),
            *gpu_rows,
            (ENV_VAR, f"{shown}: {self.visible_devices.meaning}"),
        ]
        plan = [("Workbook plan", self.plan.summary)]
        plan += [("Problem", p) for p in self.problems]
        return [("Software", software), ("Hardware", hardware), ("Plan", plan)]

    def __str__(self) -> str:
        sections = self.rows()
        width = max(len(label) for _, rows in sections for label, _ in rows)
        lines = ["Environment report (mgpu_helpers)"]
        for title, rows in sections:
            lines.append(title)
            lines += [f"  {label:<{width}}  {value}" for label, value in rows]
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        # IPython in a terminal (and a notebook's text/plain output) shows the text table.
        printer.text(str(self))

    def _repr_html_(self) -> str:
        parts = ["<table>", "<caption>Environment report (mgpu_helpers)</caption>"]
        for title, rows in self.rows():
            parts.append(f'<tr><th colspan="2" style="text-align:left">{html.escape(title)}'
                         "</th></tr>")
            parts += [f'<tr><td style="text-align:left">{html.escape(label)}</td>'
                      f'<td style="text-align:left">{html.escape(value)}</td></tr>'
                      for label, value in rows]
        parts.append("</table>")
        return "\n".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)


def describe(probe: CudaProbe | None = None) -> EnvReport:
    """Report Python, PyTorch, CUDA/cuDNN/NCCL/gloo, CPUs, GPUs and the workbook's plan.

    Args:
        probe: CUDA facts to use instead of asking a child process (tests pass a
            simulated machine here). By default :func:`probe_cuda` is called.

    Returns:
        An :class:`EnvReport`. CUDA is never initialised in the calling process.
    """
    probe = probe if probe is not None else probe_cuda()
    visible = parse_cuda_visible_devices(from_env=True)
    nccl_built = dist.is_available() and dist.is_nccl_available()
    usable = _usable_cores()
    problems = [p for p in (probe.probe_error, driver_problem(probe.cuda_error)) if p]
    if visible.problem:
        problems.append(f"{ENV_VAR}={visible.raw!r}: {visible.problem}")
    return EnvReport(
        python=platform.python_version(),
        python_executable=sys.executable,
        platform=f"{platform.system()} {platform.machine()}",
        torch=torch.__version__,
        cuda_build=torch.version.cuda or (torch.version.hip and f"ROCm {torch.version.hip}"),
        cuda_error=probe.cuda_error,
        cudnn=_cudnn_text(probe.cudnn_version),
        nccl=probe.nccl_version if nccl_built else None,
        gloo=dist.is_available() and dist.is_gloo_available(),
        cpu_cores=os.cpu_count() or 1,
        usable_cores=usable,
        torch_threads=torch.get_num_threads(),
        gpus=probe.gpus,
        visible_devices=visible,
        plan=plan_for(len(probe.gpus), nccl_built, usable),
        problems=tuple(problems),
    )


def driver_problem(cuda_error: str | None, cuda_build: str | None = None) -> str | None:
    """What to do when CUDA failed because the NVIDIA driver is older than this PyTorch
    build needs ("The NVIDIA driver on your system is too old (found version 12020)")."""
    if not cuda_error or "too old" not in cuda_error:
        return None
    cuda_build = cuda_build or torch.version.cuda
    found = re.search(r"found version (\d+)", cuda_error)
    supports = ""
    if found:
        major, minor = divmod(int(found.group(1)) // 10, 100)
        supports = f" (it supports CUDA up to {major}.{minor})"
    return (f"the NVIDIA driver is too old for this PyTorch build, made for CUDA {cuda_build}"
            f"{supports}. Update the driver, or install a PyTorch build for the CUDA your "
            "driver supports, e.g. pip install torch torchvision --index-url "
            "https://download.pytorch.org/whl/cu126 (README: 'PyTorch wheels and drivers')")


def count_gpus() -> int:
    """How many GPUs a process started from here would see, without initialising CUDA.

    Uses NVML (through PyTorch, honouring ``CUDA_VISIBLE_DEVICES``), which is fork-safe
    and fast. Where NVML cannot answer but a GPU driver is present, falls back to the
    child-process probe of :func:`probe_cuda` (slow, but still fork-safe).
    """
    if torch.version.cuda is None and torch.version.hip is None:
        return 0
    if torch.version.cuda is not None:
        counted = torch.cuda._device_count_nvml()
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
