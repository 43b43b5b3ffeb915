"""The CUDA probe's shortcut: where no NVIDIA device node exists, the answer the child
would print is given without starting it, and it is the child's answer."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mgpu_helpers.runtime import devices
from mgpu_helpers.runtime.devices import CudaProbe, no_driver_answer


def test_the_shortcut_gives_the_childs_answer():
    known = no_driver_answer()
    if known is None:
        pytest.skip("this machine has an NVIDIA device node (or no CUDA build): the child "
                    "is asked, as the other probe tests check")
    child = subprocess.run([sys.executable, "-m", "mgpu_helpers.runtime._cuda_probe"],
                           capture_output=True, text=True, timeout=120, check=True)
    asked = CudaProbe.from_json(child.stdout)
    assert (known.gpus, known.cuda_error, known.cudnn_version, known.nccl_version) == (
        asked.gpus, asked.cuda_error, asked.cudnn_version, asked.nccl_version)
    assert not torch.cuda.is_initialized() and not devices.cuda_driver_loaded()


@pytest.mark.parametrize("node", devices.NVIDIA_NODES)
def test_any_nvidia_node_sends_the_question_to_the_child(monkeypatch, node):
    monkeypatch.setattr(devices.sys, "platform", "linux")
    monkeypatch.setattr(devices.torch.version, "cuda", "13.0")
    monkeypatch.setattr(devices.torch.version, "hip", None)
    monkeypatch.setattr(devices.os.path, "exists", lambda path: path == node)
    assert no_driver_answer() is None


@pytest.mark.parametrize("platform, cuda, hip", [("darwin", "13.0", None),
                                                 ("linux", None, None),
                                                 ("linux", None, "6.2")])
def test_other_systems_and_builds_ask_the_child(monkeypatch, platform, cuda, hip):
    monkeypatch.setattr(devices.sys, "platform", platform)
    monkeypatch.setattr(devices.torch.version, "cuda", cuda)
    monkeypatch.setattr(devices.torch.version, "hip", hip)
    monkeypatch.setattr(devices.os.path, "exists", lambda path: False)
    assert no_driver_answer() is None


def test_without_nodes_a_cuda_build_on_linux_answers_no_driver(monkeypatch):
    monkeypatch.setattr(devices.sys, "platform", "linux")
    monkeypatch.setattr(devices.torch.version, "cuda", "13.0")
    monkeypatch.setattr(devices.torch.version, "hip", None)
    monkeypatch.setattr(devices.os.path, "exists", lambda path: False)

    def child(*args, **kwargs):
        raise AssertionError("the child was started")

    monkeypatch.setattr(devices.subprocess, "run", child)
    probe = devices.probe_cuda()
    assert probe.cuda_error == "Found no NVIDIA driver on your system."
    assert probe.gpus == () and probe.probe_error is None
