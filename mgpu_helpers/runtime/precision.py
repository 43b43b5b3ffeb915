"""Number formats: which 16-bit type mixed precision uses here, and exact float32.

Mixed precision ``"auto"`` picks **bfloat16** where the hardware computes it: NVIDIA GPUs of
compute capability 8.0 on (A100, H100, RTX 30xx and later), and CPUs with bfloat16
instructions (x86 with AVX512-BF16 or AMX, Arm with BF16). Older GPUs (V100, T4 as on
Kaggle and Colab, RTX 20xx) get **float16**, which needs a ``GradScaler``. A CPU without
bfloat16 instructions (AVX2-only x86: most laptops and many CI runners) gets **float32**:
PyTorch would emulate bfloat16 there, converting every number in software, and a training
step of the tutorial CNN then takes about 18 times as long as in float32.
:func:`auto_amp` says which it picked and why.

Float32 on recent NVIDIA GPUs is not always float32: convolutions (cuDNN) may use TF32,
which keeps 10 bits of mantissa, by default. That is a good trade for training, but it
makes an equivalence check (data parallel vs one device) differ in the third or fourth
significant digit. :func:`exact_float32` switches TF32 off for such checks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

AMP_CHOICES = ("auto", "bfloat16", "float16")

# oneDNN's instruction-set limits (its documented ONEDNN_MAX_CPU_ISA, older DNNL_MAX_CPU_ISA),
# lowest first: bfloat16 is computed natively from AVX512_CORE_BF16 on. oneDNN runs the
# convolutions and matrix products of a CPU autocast, so its limit decides the speed: with
# ONEDNN_MAX_CPU_ISA=AVX2 on an AVX512-BF16 machine a bfloat16 step of the tutorial CNN took
# 18x its float32 time, with ATEN_CPU_CAPABILITY=avx2 alone it stayed 2x faster than float32.
_ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_AMX",
                "AVX10_1_512_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16")
_FIRST_BF16_ISA = _ONEDNN_ISAS.index("AVX512_CORE_BF16")


@dataclass(frozen=True)
class AmpChoice:
    """What ``amp="auto"`` computes in on a device, and why.

    ``dtype`` is the type for ``torch.autocast``, or ``None`` for plain float32 (no
    autocast); ``reason`` is one line a reader can check against their machine.
    """

    dtype: torch.dtype | None
    reason: str

    @property
    def name(self) -> str:
        return "float32" if self.dtype is None else str(self.dtype).removeprefix("torch.")

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def _onednn_isa_limit(environ: Mapping[str, str]) -> str | None:
    """The instruction-set limit set for oneDNN in ``environ``, upper-cased, or None."""
    for variable in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = environ.get(variable, "").strip().upper()
        if value and value not in ("ALL", "DEFAULT"):
            return value
    return None


def cpu_bfloat16(capabilities: Mapping[str, object] | None = None,
                 environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Does this CPU compute bfloat16 in hardware, as PyTorch will use it? ``(yes, why)``.

    The instruction flags come from ``torch.cpu.get_capabilities()`` (public since PyTorch
    2.9): cpuinfo's reading of the CPUID bits (x86) or the kernel's hardware capabilities
    (Arm), the same facts oneDNN and ATen dispatch their kernels on, so a flag present
    here is a kernel path taken there. x86 needs AVX512-BF16 or AMX-BF16 (and no
    ``ONEDNN_MAX_CPU_ISA`` below AVX512_CORE_BF16); Arm needs BF16 (Neoverse V1/N2,
    Graviton 3, Apple M2 on). Anything else is emulated in software.

    Args:
        capabilities: the flags to judge instead of this machine's (tests pass these).
        environ: the environment to read ``ONEDNN_MAX_CPU_ISA`` from (default: os.environ).
    """
    if capabilities is None:
        capabilities = torch.cpu.get_capabilities()
    environ = os.environ if environ is None else environ
    architecture = str(capabilities.get("architecture", "unknown"))
    if architecture in ("x86_64", "x86", "i386", "i686", "AMD64"):
        found = [flag for flag in ("amx_bf16", "avx512_bf16") if capabilities.get(flag)]
        if not found:
            return False, ("this CPU has no bfloat16 instructions (no AVX512-BF16 or AMX), "
                           "so bfloat16 would be emulated, about 18x slower than float32")
        flags = " and ".join(flag.upper().replace("_", "-") for flag in found)
        limit = _onednn_isa_limit(environ)
        if limit is not None and (limit not in _ONEDNN_ISAS
                                  or _ONEDNN_ISAS.index(limit) < _FIRST_BF16_ISA):
            return False, (f"this CPU has {flags}, but ONEDNN_MAX_CPU_ISA={limit} keeps "
                           "oneDNN from using it, so bfloat16 would be emulated")
        return True, f"this CPU computes bfloat16 natively: {flags}"
    if architecture in ("arm64", "aarch64"):
        if capabilities.get("bf16") or capabilities.get("sve_bf16"):
            return True, "this Arm CPU computes bfloat16 natively: BF16"
        return False, ("this Arm CPU has no BF16 instructions, so bfloat16 would be "
                       "emulated, many times slower than float32")
    return False, (f"bfloat16 is not known to be native on {architecture} CPUs, "
                   "so the workbook does not risk an emulated one")


def gpu_amp(capability: tuple[int, int]) -> AmpChoice:
    """What ``"auto"`` uses on an NVIDIA GPU of this compute capability: bfloat16 from 8.0
    (A100, H100, RTX 30xx on), float16 with a ``GradScaler`` before (V100, T4, RTX 20xx)."""
    major, minor = capability
    if (major, minor) >= (8, 0):
        return AmpChoice(torch.bfloat16, f"compute capability {major}.{minor} computes it")
    return AmpChoice(torch.float16, f"compute capability {major}.{minor}, before 8.0, has no "
                     "bfloat16: with a GradScaler")


def auto_amp(device: torch.device | str, capabilities: Mapping[str, object] | None = None,
             environ: Mapping[str, str] | None = None) -> AmpChoice:
    """What mixed precision ``"auto"`` uses on ``device``, with the reason.

    GPUs: bfloat16 from compute capability 8.0 on, float16 (with a ``GradScaler``) before.
    CPUs: bfloat16 where :func:`cpu_bfloat16` finds it native, else float32 (no autocast),
    since an emulated 16-bit type is slower than float32 and saves nothing that matters
    on a CPU. ``capabilities`` and ``environ`` stand in for this CPU's (tests).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_amp(torch.cuda.get_device_capability(device))
    if device.type == "cpu":
        native, why = cpu_bfloat16(capabilities, environ)
        return AmpChoice(torch.bfloat16 if native else None, why)
    return AmpChoice(torch.bfloat16, f"{device.type} device: bfloat16")


def amp_dtype_for(device: torch.device | str) -> torch.dtype:
    """The 16-bit type for ``torch.autocast`` on ``device``: bfloat16 on CPUs and on GPUs of
    compute capability 8.0 and later, float16 (with a GradScaler) before that.

    This is the type a 16-bit run *would* use, native or not: on a CPU without bfloat16
    instructions it is emulated (slow). To train, use :func:`auto_amp` or ``amp="auto"``,
    which pick float32 there."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.bfloat16
    return gpu_amp(torch.cuda.get_device_capability(device)).dtype


def amp_dtype(choice: str | None, device: torch.device | str) -> torch.dtype | None:
    """``None`` (float32), ``"bfloat16"``, ``"float16"``, or ``"auto"`` for what
    :func:`auto_amp` picks on the device, as a dtype (None for float32)."""
    if choice is None:
        return None
    if choice not in AMP_CHOICES:
        raise ValueError(f"amp must be None or one of {', '.join(AMP_CHOICES)}, got {choice!r}")
    if choice == "auto":
        return auto_amp(device).dtype
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[choice]


def _fp32_settings() -> list[tuple[object, str, object]]:
    """(object, attribute, value for exact float32) for cuBLAS and cuDNN, in the API this
    PyTorch has: ``fp32_precision`` from 2.9 on, ``allow_tf32`` before."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    try:
        matmul.fp32_precision  # noqa: B018 (raises AttributeError on older PyTorch)
        return [(matmul, "fp32_precision", "ieee"), (cudnn.conv, "fp32_precision", "ieee"),
                (cudnn.rnn, "fp32_precision", "ieee")]
    except AttributeError:
        return [(matmul, "allow_tf32", False), (cudnn, "allow_tf32", False)]


@contextmanager
def exact_float32():
    """Within the block, float32 matrix products and convolutions on GPUs are computed
    in float32 (no TF32). Does nothing on CPUs, which never use TF32."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in _fp32_settings()]
    try:
        for owner, name, value in _fp32_settings():
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def disable_tf32() -> None:
    """Compute float32 matrix products and convolutions in float32 from now on (no TF32),
    for a notebook whose checks compare float32 results. Does nothing on CPUs."""
    for owner, name, value in _fp32_settings():
        setattr(owner, name, value)
