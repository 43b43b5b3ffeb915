"""The plan of describe() and the ranks launch() starts agree on the GPUs, on simulated
GPU machines (issue 32): a GPU whose CUDA cannot start is no GPU to either.

The machine is simulated where the package asks it: NVML's count in this process, and
the CUDA probe's child process, whose ``python -m mgpu_helpers.runtime._cuda_probe`` is replaced
by the probe's own code run here with CUDA simulated. No rank is started: launch() is
followed up to the point where it starts ranks.
"""

import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mgpu_helpers as mh
from mgpu_helpers.launcher import api, checks
from mgpu_helpers.runtime import _cuda_probe, devices, env

TOO_OLD = ("The NVIDIA driver on your system is too old (found version 12040). Please update "
           "your GPU driver by downloading and installing a new version from the URL: "
           "http://www.nvidia.com/Download/index.aspx")
NOT_READY = "CUDA driver initialization failed, you might not have a CUDA gpu."


class Machine:
    """A simulated GPU machine: NVML lists ``listed`` GPUs; CUDA then starts with them
    (``cuda_error=None``) or fails with ``cuda_error``. Counts the probe's child runs."""

    def __init__(self, monkeypatch, listed: int, cuda_error: str | None):
        self.listed, self.cuda_error, self.probes = listed, cuda_error, 0
        monkeypatch.setattr(devices.torch.version, "cuda", "13.0")
        monkeypatch.setattr(devices, "nvml_device_count", lambda: self.listed)
        monkeypatch.setattr(devices.subprocess, "run", self.run_probe)
        # a GPU machine has NVIDIA device nodes: the answer is never known without the
        # child (devices.no_driver_answer, where there is none)
        monkeypatch.setattr(devices, "no_driver_answer", lambda: None, raising=False)
        monkeypatch.setattr(env.dist, "is_nccl_available", lambda: True)
        monkeypatch.setattr(checks.dist, "is_nccl_available", lambda: True)

    def run_probe(self, command, **kwargs):
        assert command[1:] == ["-m", "mgpu_helpers.runtime._cuda_probe"], command
        self.probes += 1
        with pytest.MonkeyPatch.context() as child:  # what the child process would see
            child.setattr(torch.cuda, "init", self.cuda_init)
            child.setattr(torch.backends.cudnn, "version", lambda: 91900)
            child.setattr(torch.cuda, "device_count", lambda: self.listed)
            child.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(
                name="NVIDIA H100 80GB HBM3", total_memory=85_000_000_000, major=9, minor=0))
            facts = _cuda_probe.probe()
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps(facts), stderr="")

    def cuda_init(self):
        if self.cuda_error:
            raise RuntimeError(self.cuda_error)


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """No answer cached from an earlier test, no CUDA setting from the shell, and any
    CUDA call in this process (the notebook kernel's) fails the test."""
    monkeypatch.setattr(devices, "_probes", {})
    monkeypatch.setattr(api, "_told_no_gpu", set())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def touched(*args, **kwargs):
        raise AssertionError("CUDA was asked in the calling process")

    for name in ("init", "device_count", "is_available", "get_device_properties",
                 "current_device", "set_device"):
        monkeypatch.setattr(torch.cuda, name, touched)


@pytest.fixture
def launched(monkeypatch):
    """What launch() would start: each call's (nprocs, backend), and no process."""
    starts = []

    def run_ranks(ctx, nprocs, spec_args, work, listener, join_timeout, return_all):
        listener.close()
        starts.append((nprocs, spec_args["backend"]))
        return "started"

    monkeypatch.setattr(api, "run_ranks", run_ranks)
    return starts


def plan_and_launch(launched):
    """The plan describe() gives, and what launch() starts when a chapter follows it:
    ``launch(fn, nprocs=plan.nprocs)``, with backend="auto" and with plan.backend."""
    plan = mh.describe().plan
    assert launch_with(nprocs=plan.nprocs) == "started"
    assert launch_with(nprocs=plan.nprocs, backend=plan.backend) == "started"
    return plan, launched


def launch_with(**kwargs):
    return mh.launch(mh.rank, **kwargs)


def test_a_gpu_whose_cuda_cannot_start_is_no_gpu_to_plan_or_launch(monkeypatch, launched,
                                                                    capsys):
    machine = Machine(monkeypatch, listed=1, cuda_error=TOO_OLD)
    plan, starts = plan_and_launch(launched)
    assert (plan.backend, plan.nprocs, plan.device_type) == ("gloo", 2, "cpu")
    assert starts == [(2, "gloo"), (2, "gloo")]
    assert devices.count_gpus() == 0
    assert machine.probes == 1, "launch() reuses the answer describe() got"
    told = capsys.readouterr().err
    assert told.count("CUDA cannot start") == 1, "the launch says why, once per process"
    assert "too old" in told and "python -m mgpu_helpers" in told


def test_the_report_says_the_gpu_is_unusable_why_and_how_to_fix_it(monkeypatch):
    Machine(monkeypatch, listed=1, cuda_error=TOO_OLD)
    report = mh.describe()
    text = str(report)
    assert "1 GPU found, but CUDA cannot start on it" in report.plan.summary
    assert "2 ranks simulated as CPU processes over gloo" in report.plan.summary
    problems = " ".join(report.problems)
    assert "driver is too old for this PyTorch build" in problems
    assert "supports CUDA up to 12.4" in problems
    # the fix installs this same release, built for an older CUDA: no version skew
    release = torch.__version__.split("+")[0]
    assert f"torch=={release}" in problems and "--index-url" in problems
    assert "Problem" in text and "1 GPU found, but CUDA cannot start" in text


def test_cuda_failing_for_another_reason_is_a_problem_too(monkeypatch, launched):
    Machine(monkeypatch, listed=2, cuda_error=NOT_READY)
    plan, starts = plan_and_launch(launched)
    assert starts == [(2, "gloo"), (2, "gloo")]
    problems = " ".join(mh.describe().problems)
    assert "2 GPUs found, but CUDA cannot start on them" in problems
    assert NOT_READY in problems and "nvidia-smi" in problems


def test_nccl_alone_says_why_the_gpus_are_unusable(monkeypatch, launched):
    Machine(monkeypatch, listed=1, cuda_error=TOO_OLD)
    with pytest.raises(mh.LaunchError, match=r"needs GPUs.*CUDA cannot start.*too old"):
        launch_with(nprocs=1, backend="nccl")
    assert launched == []


def test_two_working_gpus_are_two_nccl_ranks_to_both(monkeypatch, launched):
    machine = Machine(monkeypatch, listed=2, cuda_error=None)
    plan, starts = plan_and_launch(launched)
    assert (plan.backend, plan.nprocs, plan.device_type) == ("cpu:gloo,cuda:nccl", 2, "cuda")
    assert starts == [(2, "cpu:gloo,cuda:nccl"), (2, "cpu:gloo,cuda:nccl")]
    assert launch_with() == "started" and starts[-1] == (2, "cpu:gloo,cuda:nccl")
    assert mh.describe().problems == ()
    assert machine.probes == 2, "describe() asks afresh; launch() reuses its answer"


def test_launch_asks_cuda_once_per_visible_devices_setting(monkeypatch, launched):
    machine = Machine(monkeypatch, listed=2, cuda_error=None)
    launch_with(nprocs=2)
    launch_with(nprocs=2)
    assert machine.probes == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    machine.listed = 1
    launch_with(nprocs=1)
    assert machine.probes == 2 and launched[-1] == (1, "cpu:gloo,cuda:nccl")


def test_no_gpu_listed_asks_no_child(monkeypatch, launched):
    machine = Machine(monkeypatch, listed=0, cuda_error="no CUDA-capable device is detected")
    assert devices.count_gpus() == 0
    launch_with(nprocs=2)
    assert machine.probes == 0 and launched == [(2, "gloo")]


def test_a_failed_probe_is_asked_again(monkeypatch):
    Machine(monkeypatch, listed=1, cuda_error=None)

    def hang(*args, **kwargs):
        raise subprocess.TimeoutExpired(cmd="probe", timeout=1)

    monkeypatch.setattr(devices.subprocess, "run", hang)
    assert devices.count_gpus() == 0
    assert "did not answer" in devices.gpu_count().problem
    machine = Machine(monkeypatch, listed=1, cuda_error=None)
    assert devices.count_gpus() == 1 and machine.probes == 1


# ------------------------------------------------------------------ version skew

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("package", ["torch", "torchvision"])
def test_the_accepted_floor_is_the_tested_release(package):
    """pyproject.toml accepts no release older than the pinned (tested) one's minor
    version: the workbook was tested on that one only (requirements/constraints.txt)."""
    floor = re.search(rf'^\s*"{package}>=(\d+)\.(\d+)[.\d]*,<\d+"',
                      (ROOT / "pyproject.toml").read_text(), re.M)
    pins = (ROOT / "requirements" / "constraints.txt").read_text()
    pinned = re.search(rf"^{package}==(\d+)\.(\d+)\.", pins, re.M)
    assert floor and pinned
    assert floor.groups() == pinned.groups(), (
        f"pyproject.toml accepts {package} {'.'.join(floor.groups())}, but the workbook was "
        f"tested on {'.'.join(pinned.groups())} (constraints.txt): raise the floor to it, "
        "or test the older release and update this test")
