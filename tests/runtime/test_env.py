"""The environment report: simulated GPU machines, malformed settings, CUDA left alone."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from mgpu_helpers.runtime import backend, devices, env
from mgpu_helpers.runtime.backend import plan_for
from mgpu_helpers.runtime.devices import GPU, CudaProbe, probe_cuda
from mgpu_helpers.runtime.env import describe

NO_DRIVER = CudaProbe(cuda_error="Found no NVIDIA driver on your system.",
                      cudnn_version=90100, nccl_version="2.21.5")


def simulated_gpus(count, name="NVIDIA H100 80GB HBM3"):
    gpus = tuple(GPU(i, name, 85_000_000_000, (9, 0)) for i in range(count))
    return CudaProbe(gpus=gpus, cudnn_version=90100, nccl_version="2.21.5")


@pytest.fixture
def nccl_built(monkeypatch):
    monkeypatch.setattr(env.dist, "is_nccl_available", lambda: True)


@pytest.fixture(autouse=True)
def no_visible_devices_setting(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_names_that_moved_out_of_env_still_import_from_it():
    # code written before the backend policy and the device questions left env.py
    for name in env.__all__:
        assert getattr(env, name) is getattr(backend, name, None) or \
            getattr(env, name) is getattr(devices, name, None) or name in (
                "EnvReport", "describe", "driver_problem")


def test_cpu_machine_plans_simulated_ranks_over_gloo():
    report = describe(NO_DRIVER)
    assert not report.cuda_available
    assert report.plan.backend == "gloo"
    assert report.plan.device_type == "cpu"
    assert report.plan.nprocs == backend.SIMULATED_RANKS
    assert report.plan.summary.startswith("no GPU: 2 ranks simulated as CPU processes over gloo")
    text = str(report)
    assert "GPUs" in text and "none" in text
    assert "no: Found no NVIDIA driver on your system." in text


def test_four_simulated_gpus_plan_nccl(nccl_built):
    report = describe(simulated_gpus(4))
    assert report.cuda_available
    assert report.plan.summary == ("4 GPUs: one process per GPU, NCCL for CUDA tensors (gloo "
                                   "for CPU tensors)")
    assert (report.plan.nprocs, report.plan.backend, report.plan.device_type) == (
        4, "cpu:gloo,cuda:nccl", "cuda")
    text = str(report)
    for index in range(4):
        row = rf"cuda:{index}\s+NVIDIA H100 80GB HBM3, 79\.2 GiB, compute capability 9\.0"
        assert re.search(row, text)
    assert "yes, 4 devices" in text
    assert "cuDNN" in text and "9.1.0" in text
    assert "2.21.5" in text


def test_one_gpu_is_singular(nccl_built):
    assert describe(simulated_gpus(1)).plan.summary.startswith("1 GPU: one process per GPU")


def test_gpus_without_nccl_fall_back_to_gloo():
    plan = plan_for(gpu_count=2, nccl_available=False, usable_cores=8)
    assert (plan.backend, plan.device_type) == ("gloo", "cpu")
    assert "has no NCCL" in plan.summary


def test_a_driver_too_old_for_the_build_is_a_problem_with_the_fix():
    probe = CudaProbe(cuda_error="The NVIDIA driver on your system is too old (found version "
                                 "12020).", cudnn_version=90100, nccl_version="2.21.5")
    problems = " ".join(describe(probe).problems)
    assert "driver is too old" in problems and "supports CUDA up to 12.2" in problems
    assert "--index-url https://download.pytorch.org/whl/cu126" in problems
    assert describe(NO_DRIVER).problems == ()


def test_html_rendering_is_a_table_and_escapes(nccl_built):
    html = describe(simulated_gpus(2, name="GPU <test> & co"))._repr_html_()
    assert html.startswith("<table>") and html.endswith("</table>")
    assert "GPU &lt;test&gt; &amp; co" in html
    assert "<test>" not in html
    assert html.count("<tr>") == sum(len(rows) + 1 for _, rows in describe(NO_DRIVER).rows()) + 1


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("0,,1", "entry 2 is empty"), ("abc", "'abc'"), ("-1", "hide every GPU")],
)
def test_malformed_visible_devices_are_explained_not_fatal(monkeypatch, raw, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", raw)
    text = str(describe(NO_DRIVER))
    assert re.search(rf"CUDA_VISIBLE_DEVICES\s+{re.escape(repr(raw))}: ", text)
    assert expected in text


def test_malformed_visible_devices_listed_as_problem(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,,1")
    report = describe(NO_DRIVER)
    assert report.problems == ("CUDA_VISIBLE_DEVICES='0,,1': entry 2 is empty",)
    assert report.to_dict()["visible_devices"]["entries"] == (0,)


@pytest.mark.slow
def test_describe_never_touches_cuda_in_process(monkeypatch):
    """Any in-process call that would initialise the CUDA driver fails this test."""

    def touched(*args, **kwargs):
        raise AssertionError("describe() called a CUDA API in the calling process")

    for name in ("init", "_lazy_init", "device_count", "is_available",
                 "get_device_properties", "get_device_name", "current_device"):
        monkeypatch.setattr(torch.cuda, name, touched)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", touched, raising=False)
    report = describe()  # the real probe, in a child process
    assert report.problems == ()  # the probe answered (no probe_error)
    assert not torch.cuda.is_initialized()
    # and its answer is self-consistent: an error or GPUs, numbered from 0
    assert (report.cuda_error is None) == bool(report.gpus)
    assert [g.index for g in report.gpus] == list(range(len(report.gpus)))


@pytest.mark.slow
def test_real_probe_survives_malformed_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,,1")
    report = describe()
    assert report.problems == ("CUDA_VISIBLE_DEVICES='0,,1': entry 2 is empty",)
    assert len(report.gpus) <= 1, "CUDA shows at most GPU 0 for '0,,1'"


def test_ipython_shows_the_text_table():
    from IPython.lib.pretty import pretty

    report = describe(NO_DRIVER)
    assert pretty(report) == str(report)


def ask_the_child(monkeypatch):
    """The probe asks its child even where the answer is known without it (no NVIDIA
    device node: devices.no_driver_answer), so that the child's failures are seen."""
    monkeypatch.setattr(devices, "no_driver_answer", lambda: None, raising=False)


def test_probe_timeout_is_reported_not_raised(monkeypatch):
    def hang(*args, **kwargs):
        raise subprocess.TimeoutExpired(cmd="probe", timeout=1)

    monkeypatch.setattr(devices.subprocess, "run", hang)
    ask_the_child(monkeypatch)
    report = describe()
    assert not report.cuda_available
    assert "did not answer within" in report.problems[0]
    assert "did not answer" in str(report)


@pytest.mark.parametrize(
    ("returncode", "stdout", "expected"),
    [(1, "", "exited with status 1: boom"), (0, "not json", "unreadable")],
)
def test_probe_failures_are_reported(monkeypatch, returncode, stdout, expected):
    def fake_run(*args, **kwargs):
        return subprocess.CompletedProcess(args, returncode, stdout=stdout, stderr="x\nboom\n")

    monkeypatch.setattr(devices.subprocess, "run", fake_run)
    ask_the_child(monkeypatch)
    assert expected in probe_cuda().probe_error


def test_probe_rejects_non_positive_timeout():
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        probe_cuda(timeout=0)


@pytest.mark.slow
def test_doctor_prints_report_and_exits_zero():
    done = subprocess.run([sys.executable, "-m", "mgpu_helpers"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Environment report (mgpu_helpers)")
    assert "Workbook plan" in done.stdout
    assert done.stderr == ""


@pytest.mark.parametrize("machine", ["no GPU", "2 GPUs"])
def test_doctor_json_is_machine_readable(monkeypatch, capsys, nccl_built, machine):
    # The doctor's own command (and the real probe) run in the test above; here its
    # --json output, on a simulated machine with and without GPUs.
    from mgpu_helpers.__main__ import main

    probe = NO_DRIVER if machine == "no GPU" else simulated_gpus(2)
    monkeypatch.setattr(env, "cuda_probe", lambda refresh=False: probe)
    assert main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch"] == torch.__version__
    assert report["plan"]["backend"] == ("gloo" if machine == "no GPU" else
                                         "cpu:gloo,cuda:nccl")
    assert len(report["gpus"]) == len(probe.gpus)


# Whether the stub driver says it was started is read from the environment at each call,
# so that one child process asks it both ways.
STUB_DRIVER = """
#include <stdlib.h>
int cuCtxGetCurrent(void **context) {
    const char *started = getenv("STUB_STARTED");
    *context = 0;
    return started && started[0] == '1' ? 0 : 3;  /* 3: CUDA_ERROR_NOT_INITIALIZED */
}
int cuInit(unsigned int flags) { return 100; }  /* CUDA_ERROR_NO_DEVICE */
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_mapped_driver_counts_as_started_only_once_initialised(tmp_path):
    # On a GPU node `import torch` maps libcuda.so.1 (cuBLASLt opens it) without cuInit:
    # a stub driver on LD_LIBRARY_PATH stands in for it, answering as the real one would.
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a stub libcuda.so.1")
    source = tmp_path / "stub.c"
    source.write_text(STUB_DRIVER)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"),
                    str(source)], check=True)
    probe = ("import os, torch\n"
             "from mgpu_helpers.runtime.devices import cuda_driver_loaded\n"
             "mapped = any('/libcuda.so' in line for line in open('/proc/self/maps'))\n"
             "answers = []\n"
             "for started in '01':\n"
             "    os.environ['STUB_STARTED'] = started\n"
             "    answers.append(cuda_driver_loaded())\n"
             "print(mapped, *answers)")
    environment = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], env=environment, check=True,
                         capture_output=True, text=True).stdout.split()
    if out[0] != "True":
        pytest.skip("this torch build does not open libcuda.so.1 on import")
    assert out[1:] == ["False", "True"]  # not started, then started


def test_report_says_what_auto_mixed_precision_computes_in(monkeypatch, nccl_built):
    monkeypatch.setattr(torch.cpu, "get_capabilities",
                        lambda: {"architecture": "x86_64", "avx2": True})
    assert re.search(r'Mixed precision\s+amp="auto": float32 \(this CPU has no bfloat16 '
                     r'instructions', str(describe(NO_DRIVER)))
    assert 'amp="auto": bfloat16 (compute capability 9.0 computes it) on the GPUs' in str(
        describe(simulated_gpus(2)))
    t4 = CudaProbe(gpus=(GPU(0, "Tesla T4", 16_000_000_000, (7, 5)),),
                   cudnn_version=90100, nccl_version="2.21.5")
    assert ('amp="auto": float16 (compute capability 7.5, before 8.0, has no bfloat16: with '
            'a GradScaler) on the GPUs') in str(describe(t4))
