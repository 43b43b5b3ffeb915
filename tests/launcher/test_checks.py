"""Bad arguments and busy ports are refused before any rank starts, naming
what was wrong (launcher/checks.py)."""

import socket
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import mgpu_helpers as mh
from mgpu_helpers import LaunchError, launch
from mgpu_helpers.launcher import api, checks, rank_main
from mgpu_helpers.launcher.records import GroupSpec

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


# ------------------------------------------------------------------------------- ports


def test_busy_fixed_port_fails_fast_naming_it():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(LaunchError, match=f"master_port={port} on 127.0.0.1 is already"):
            launch(mh.rank, nprocs=2, master_port=port)
        assert time.monotonic() - start < 10  # no rank was started, nothing waited


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("nprocs", [0, -1, True, "2", 1.5])
def test_bad_nprocs(nprocs):
    with pytest.raises(ValueError, match="nprocs must be a positive int"):
        launch(mh.rank, nprocs=nprocs)


def test_nprocs_required_without_gpus(monkeypatch):
    monkeypatch.setattr(api, "count_gpus", lambda: 0)
    with pytest.raises(ValueError, match=r"no GPU to count .* Say how many ranks .* nprocs=2"):
        launch(mh.rank)


def test_called_function_instead_of_function():
    with pytest.raises(TypeError, match=r"launch\(train\(\)\)"):
        launch(mh.rank(), nprocs=2)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'gloo', 'nccl'"):
        launch(mh.rank, nprocs=2, backend="mpi")


def test_nccl_without_gpus(monkeypatch):
    monkeypatch.setattr(api, "count_gpus", lambda: 0)
    monkeypatch.setattr(checks.dist, "is_nccl_available", lambda: True)
    with pytest.raises(LaunchError, match="backend='nccl' needs GPUs"):
        launch(mh.rank, nprocs=2, backend="nccl")


def test_nccl_with_more_ranks_than_gpus(monkeypatch):
    monkeypatch.setattr(api, "count_gpus", lambda: 1)
    monkeypatch.setattr(checks.dist, "is_nccl_available", lambda: True)
    with pytest.raises(LaunchError, match="nprocs=2 GPU ranks need 2 GPUs, but 1 is visible"):
        launch(mh.rank, nprocs=2, backend="nccl")


@pytest.mark.parametrize("port", [0, 70000, "29500", True])
def test_invalid_port(port):
    with pytest.raises(ValueError, match="master_port must be an int in 1..65535"):
        launch(mh.rank, nprocs=2, master_port=port)


@pytest.mark.parametrize(("name", "value"), [("timeout", 0), ("join_timeout", -1),
                                             ("cpu_threads", 0)])
def test_invalid_limits(name, value):
    with pytest.raises(ValueError, match=name):
        launch(mh.rank, nprocs=2, **{name: value})


def test_process_group_already_initialised_here():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(LaunchError, match="already initialised in this process"):
            launch(mh.rank, nprocs=2)
    finally:
        dist.destroy_process_group()


def test_fork_refused_once_cuda_is_initialised(monkeypatch):
    monkeypatch.setattr(checks, "cuda_driver_loaded", lambda: True)
    with pytest.raises(LaunchError, match=r"refusing to fork: .*torch.cuda.is_available\(\)"):
        launch(mh.rank, nprocs=2, start_method="fork")
    assert checks.resolve_start_method("auto") == "spawn"


def test_nccl_rank_detects_a_poisoned_fork(monkeypatch):
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    spec = GroupSpec(2, "nccl", "127.0.0.1", 1, 5.0, 1)
    with pytest.raises(RuntimeError, match="poisoned fork"):
        rank_main.join_group(0, spec, None)


def test_unknown_start_method():
    with pytest.raises(ValueError, match="start_method must be"):
        launch(mh.rank, nprocs=2, start_method="thread")


def test_unpicklable_argument_under_spawn_is_refused_before_starting():
    with pytest.raises(LaunchError, match="cannot send the function or its arguments"):
        launch(lambda lock: None, threading.Lock(), nprocs=2, start_method="spawn")


def progress_bar():
    sys.stderr.write("\rstep 1/3")
    sys.stderr.write("\rstep 2/3")
    sys.stderr.write("\rstep 3/3\n")
    sys.stderr.write("\rhalf a line\rlatest update\r")


def test_carriage_returns_keep_only_the_latest_update(capfd):
    launch(progress_bar, nprocs=1)
    err = capfd.readouterr().err
    assert "[rank 0] step 3/3\n" in err
    assert "[rank 0] step 1/3\n" not in err, "overwritten updates never end a line"
    assert "[rank 0] latest update\r" in err
