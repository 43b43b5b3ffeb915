"""Number formats: which 16-bit type mixed precision uses here, and exact float32.

Mixed precision picks **bfloat16** where the hardware computes it (CPUs, and NVIDIA GPUs
of compute capability 8.0 on: A100, H100, RTX 30xx and later) and **float16** elsewhere
(V100, T4 as on Kaggle and Colab, RTX 20xx), where it needs a ``GradScaler``.

Float32 on recent NVIDIA GPUs is not always float32: convolutions (cuDNN) may use TF32,
which keeps 10 bits of mantissa, by default. That is a good trade for training, but it
makes an equivalence check (data parallel vs one device) differ in the third or fourth
significant digit. :func:`exact_float32` switches TF32 off for such checks.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

AMP_CHOICES = ("auto", "bfloat16", "float16")


def amp_dtype_for(device: torch.device | str) -> torch.dtype:
    """The 16-bit type for ``torch.autocast`` on ``device``: bfloat16 on CPUs and on
    GPUs of compute capability 8.0 and later, float16 (with a GradScaler) before that."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.bfloat16
    return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16


def amp_dtype(choice: str | None, device: torch.device | str) -> torch.dtype | None:
    """``None`` (float32), ``"bfloat16"``, ``"float16"``, or ``"auto"`` for
    :func:`amp_dtype_for` the device, as a dtype (None for float32)."""
    if choice is None:
        return None
    if choice not in AMP_CHOICES:
        raise ValueError(f"amp must be None or one of {', '.join(AMP_CHOICES)}, got {choice!r}")
    if choice == "auto":
        return amp_dtype_for(device)
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
