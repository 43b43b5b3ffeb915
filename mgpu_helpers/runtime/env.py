"""The environment report: what this machine has, and how the workbook will use it.

``describe()`` gathers versions, devices and the ``CUDA_VISIBLE_DEVICES`` setting into an
:class:`EnvReport`, which shows as an HTML table in a notebook and as text in a terminal
(``python -m mgpu_helpers``). It never initialises CUDA in the calling process (see
:mod:`.devices`). How the workbook runs ranks on what it finds, the backend and the
plan, is :mod:`.backend`'s; its names are re-exported here for code written before the
split.
"""

from __future__ import annotations

import html
import importlib.metadata
import os
import platform
import re
import sys
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from .backend import (
    GPU_BACKEND,
    SIMULATED_RANKS,
    DevicePlan,
    auto_backend,
    backend_device_type,
    plan_for,
)
from .devices import GPU, CudaProbe, count_gpus, cuda_driver_loaded, cuda_probe, probe_cuda
from .precision import auto_amp, gpu_amp
from .visible_devices import ENV_VAR, VisibleDevices, parse_cuda_visible_devices

__all__ = [  # the report, and the names that moved to .backend and .devices
    "GPU", "GPU_BACKEND", "SIMULATED_RANKS", "CudaProbe", "DevicePlan", "EnvReport",
    "auto_backend", "backend_device_type", "count_gpus", "cuda_driver_loaded", "describe",
    "driver_problem", "plan_for", "probe_cuda",
]


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
    mixed_precision: str = ""  # what amp="auto" computes in here, and why

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
        if self.mixed_precision:
            plan.append(("Mixed precision", f'amp="auto": {self.mixed_precision}'))
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
            simulated machine here). By default a child process is asked afresh
            (:func:`~mgpu_helpers.runtime.devices.cuda_probe`), and ``launch()`` then goes by the
            same answer: the GPUs planned here are the GPUs a launch starts ranks on.

    Returns:
        An :class:`EnvReport`. CUDA is never initialised in the calling process.
    """
    probe = probe if probe is not None else cuda_probe(refresh=True)
    visible = parse_cuda_visible_devices(from_env=True)
    nccl_built = dist.is_available() and dist.is_nccl_available()
    usable = _usable_cores()
    cuda_problem = driver_problem(probe.cuda_error) or _cuda_start_problem(probe)
    problems = [p for p in (probe.probe_error, cuda_problem) if p]
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
        plan=plan_for(len(probe.gpus), nccl_built, usable,
                      gpus_without_cuda=probe.unusable_gpus),
        problems=tuple(problems),
        mixed_precision=mixed_precision_summary(probe.gpus),
    )


def mixed_precision_summary(gpus: tuple[GPU, ...]) -> str:
    """What ``amp="auto"`` computes in on the devices the plan uses, with the reason: the
    oldest GPU's (its compute capability, read from the probe, so CUDA stays untouched
    here), else this CPU's (:func:`.precision.auto_amp`)."""
    if not gpus:
        return str(auto_amp("cpu"))
    return f"{gpu_amp(min(gpu.capability for gpu in gpus))} on the GPUs"


def _cuda_start_problem(probe: CudaProbe) -> str | None:
    """The driver lists GPUs but CUDA cannot start on them, for a reason other than a
    driver too old for the build (which :func:`driver_problem` explains)."""
    if not probe.unusable_gpus:
        return None
    count = probe.unusable_gpus
    gpus = f"{count} GPU{'s' if count > 1 else ''}"
    them = "them" if count > 1 else "it"
    return (f"{gpus} found, but CUDA cannot start on {them}: "
            f"{probe.cuda_error or 'no reason given.'} Until it can, the workbook runs CPU "
            "ranks over gloo. Check that `nvidia-smi` "
            "lists the GPUs without errors and that no other program holds them in "
            "exclusive mode; on a cluster node, ask its administrators (the fabric manager "
            "of NVSwitch machines must be running).")


def _reinstall_command(index_tag: str) -> str:
    """pip's command that installs this same PyTorch release (and its torchvision) built
    for another CUDA: the tested versions, only the build changes."""
    release = torch.__version__.split("+")[0]
    pins = [f"torch=={release}"]
    try:
        pins.append(f"torchvision=={importlib.metadata.version('torchvision').split('+')[0]}")
    except importlib.metadata.PackageNotFoundError:
        pass
    return (f"pip install --force-reinstall {' '.join(pins)} --index-url "
            f"https://download.pytorch.org/whl/{index_tag}")


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
            f"{supports}, so CUDA cannot start and the workbook runs CPU ranks over gloo. "
            "Update the driver, or install this PyTorch release built for the CUDA your "
            f"driver supports, e.g. {_reinstall_command('cu126')} "
            "(README: 'PyTorch wheels and drivers')")
