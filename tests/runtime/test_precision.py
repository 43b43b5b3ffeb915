"""Mixed precision "auto": a 16-bit type only where the hardware computes it.

The CPU's flags are passed in (as ``torch.cpu.get_capabilities()`` reports them), so each
branch is tested on any machine; one test reads this machine's own flags.
"""

from __future__ import annotations

import pytest
import torch

from mgpu_helpers.runtime import precision
from mgpu_helpers.runtime.precision import AmpChoice, amp_dtype, auto_amp, cpu_bfloat16

AVX2_LAPTOP = {"architecture": "x86_64", "avx2": True, "avx512_f": False,
               "avx512_bf16": False, "amx_bf16": False}
AVX512_NO_BF16 = {**AVX2_LAPTOP, "avx512_f": True}        # Skylake-X, Zen 3 servers
AVX512_BF16 = {**AVX512_NO_BF16, "avx512_bf16": True}     # Cooper Lake, Zen 4 on
AMX = {**AVX512_BF16, "amx_bf16": True, "amx_tile": True}  # Sapphire Rapids on
ARM_BF16 = {"architecture": "aarch64", "neon": True, "bf16": True}   # Graviton 3, M2
ARM_OLD = {"architecture": "aarch64", "neon": True, "bf16": False}   # Graviton 2, M1


@pytest.mark.parametrize("flags", [AVX2_LAPTOP, AVX512_NO_BF16, ARM_OLD,
                                   {"architecture": "riscv64"}],
                         ids=["avx2", "avx512-without-bf16", "arm-without-bf16", "riscv"])
def test_auto_is_float32_where_bfloat16_would_be_emulated(flags):
    choice = auto_amp("cpu", capabilities=flags, environ={})
    assert choice.dtype is None and choice.name == "float32"
    assert "emulate" in choice.reason or "not known" in choice.reason
    assert cpu_bfloat16(flags, environ={})[0] is False


@pytest.mark.parametrize("flags, named", [(AVX512_BF16, "AVX512-BF16"), (AMX, "AMX-BF16"),
                                          (ARM_BF16, "BF16")],
                         ids=["avx512-bf16", "amx", "arm-bf16"])
def test_auto_is_bfloat16_where_the_cpu_computes_it(flags, named):
    choice = auto_amp("cpu", capabilities=flags, environ={})
    assert choice.dtype == torch.bfloat16
    assert "natively" in choice.reason and named in choice.reason
    assert str(choice).startswith("bfloat16 (")


@pytest.mark.parametrize("limit", ["AVX2", "avx512_core", "AVX512_CORE_VNNI", "SSE41"])
def test_a_onednn_limit_below_bf16_turns_auto_to_float32(limit):
    # ONEDNN_MAX_CPU_ISA=AVX2 on a bfloat16 machine is how the tests reproduce a laptop
    choice = auto_amp("cpu", capabilities=AMX, environ={"ONEDNN_MAX_CPU_ISA": limit})
    assert choice.dtype is None
    assert f"ONEDNN_MAX_CPU_ISA={limit.upper()}" in choice.reason


@pytest.mark.parametrize("environ", [{"ONEDNN_MAX_CPU_ISA": "ALL"},
                                     {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
                                     {"DNNL_MAX_CPU_ISA": "AVX512_CORE_AMX"},
                                     {"ATEN_CPU_CAPABILITY": "avx2"}])
def test_limits_that_keep_bfloat16_native(environ):
    # ATen's kernel set does not decide it: oneDNN computes autocast's products
    assert auto_amp("cpu", capabilities=AVX512_BF16, environ=environ).dtype == torch.bfloat16


def test_amp_dtype_auto_follows_auto_amp(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: AVX2_LAPTOP)
    assert amp_dtype("auto", "cpu") is None
    assert amp_dtype("bfloat16", "cpu") == torch.bfloat16  # asked for by name: given
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: AMX)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert amp_dtype("auto", "cpu") == torch.bfloat16


@pytest.mark.parametrize("capability, expected", [((9, 0), torch.bfloat16),
                                                  ((8, 0), torch.bfloat16),
                                                  ((7, 5), torch.float16),
                                                  ((7, 0), torch.float16)])
def test_gpus_unchanged(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    choice = auto_amp("cuda:0")
    assert choice.dtype == expected == precision.amp_dtype_for("cuda:0")
    assert f"{capability[0]}.{capability[1]}" in choice.reason
    assert ("GradScaler" in choice.reason) == (expected == torch.float16)


def test_this_machine_is_judged_by_its_own_flags():
    flags = torch.cpu.get_capabilities()
    choice = auto_amp("cpu", environ={})  # no oneDNN limit: the hardware alone
    native = any(flags.get(flag) for flag in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"))
    assert (choice.dtype == torch.bfloat16) == native, choice
    assert isinstance(choice, AmpChoice) and choice.reason


def test_bad_choice_names_the_choices():
    with pytest.raises(ValueError, match="auto, bfloat16, float16"):
        amp_dtype("fp16", "cpu")
