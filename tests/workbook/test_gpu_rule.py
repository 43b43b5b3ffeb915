"""The GPU rule, tested on a machine without GPUs.

Every launch in the chapters, scripts, benchmarks and package is one of two kinds:

* a **CPU check**: ``backend="gloo"`` and a comment saying why. It runs CPU ranks on
  every machine, so it behaves the same with 0 or 8 GPUs;
* **GPU-capable**: ``backend`` "auto" (or the plan's), ``nprocs`` from the plan (or 1),
  and a function that computes on ``mh.device()``.

The launches are read from the source (tests/support/launch_sites.py), then resolved with the
launcher's own decision functions for 0, 1, 2 and 8 GPUs: a launch that would ask for
more GPUs than there are, or run CPU work over NCCL, fails here, without a GPU.
"""

import pytest
import torch
import torch.distributed as dist
from support.launch_sites import PLAN, all_sites, computes_on_device

import mgpu_helpers as mh
from mgpu_helpers.launcher import LaunchError, resolve_backend, resolve_nprocs
from mgpu_helpers.runtime.backend import GPU_BACKEND, backend_device_type, plan_for

GPU_COUNTS = (0, 1, 2, 8)
SITES = all_sites()


def site_id(site):
    return f"{site.where}:{site.line}:{site.target}"


def resolved(site, gpus: int) -> tuple[str, int]:
    """(backend, nprocs) this launch gets on a machine with ``gpus`` GPUs and NCCL."""
    plan = plan_for(gpus, nccl_available=True, usable_cores=2)
    backend = plan.backend if site.backend == PLAN else site.backend
    nprocs = plan.nprocs if site.nprocs == PLAN else site.nprocs
    backend = resolve_backend(backend, gpus, nccl_available=True)
    return backend, resolve_nprocs(nprocs, backend, gpus)


def test_launch_sites_are_found():
    chapters = {site.where.split(" cell")[0] for site in SITES
                if site.where.startswith("notebooks")}
    assert len(chapters) >= 7, chapters  # 01 and 04 launch nothing
    assert len(SITES) >= 30


@pytest.mark.parametrize("site", SITES, ids=site_id)
def test_every_launch_is_a_cpu_check_or_gpu_capable(site):
    if isinstance(site.backend, tuple) and site.backend[0] == "parameter":
        return  # a helper's backend=backend: its callers' launches are checked instead
    assert site.backend in ("gloo", "auto", PLAN), (
        f"{site.where} line {site.line}: backend {site.backend!r}; use 'gloo' for a CPU "
        "check or 'auto' (or plan.backend) for a GPU-capable launch")
    if site.backend == "gloo":
        assert site.commented, (
            f"{site.where} line {site.line}: launch of {site.target} pins gloo without a "
            "comment saying why (on the call or the line above)")
        return
    assert computes_on_device(site.target_source), (
        f"{site.where} line {site.line}: {site.target} runs with backend 'auto', so on a "
        "GPU node it gets NCCL and a GPU per rank, but it never uses mh.device(): it is a "
        "CPU check; pin backend='gloo' and say why")
    assert site.nprocs in (PLAN, 1, None) or isinstance(site.nprocs, tuple), (
        f"{site.where} line {site.line}: a GPU-capable launch with nprocs={site.nprocs!r} "
        "fails on a machine with fewer GPUs; use plan.nprocs (one per GPU) or 1")


@pytest.mark.parametrize("site", SITES, ids=site_id)
def test_every_launch_resolves_with_0_1_2_and_8_gpus(site):
    # one test per site, the GPU counts in turn (a test per count and site: 4x the cases)
    if any(isinstance(value, tuple) for value in (site.backend, site.nprocs)):
        return  # decided by the caller (a helper's parameter)
    for gpus in GPU_COUNTS:
        if site.nprocs is None and gpus == 0:
            continue  # one rank per GPU: only scripts do it, and they say so without GPUs
        try:
            backend, nprocs = resolved(site, gpus)
        except (LaunchError, ValueError) as error:
            pytest.fail(f"{site.where} line {site.line}: launch of {site.target} fails with "
                        f"{gpus} GPU(s): {error}")
        if site.backend == "gloo":
            assert backend_device_type(backend) == "cpu", gpus
        else:
            assert backend_device_type(backend) == ("cuda" if gpus else "cpu"), gpus
            assert nprocs <= max(gpus, plan_for(0, True, 2).nprocs), gpus


# ------------------------------------------------------- the decisions themselves


@pytest.mark.parametrize(("gpus", "backend", "nprocs", "device"), [
    (0, "gloo", 2, "cpu"), (1, GPU_BACKEND, 1, "cuda"), (2, GPU_BACKEND, 2, "cuda"),
    (8, GPU_BACKEND, 8, "cuda")])
def test_plan_and_auto_backend_for_each_gpu_count(gpus, backend, nprocs, device):
    plan = plan_for(gpus, nccl_available=True, usable_cores=16)
    assert (plan.backend, plan.nprocs, plan.device_type) == (backend, nprocs, device)
    assert resolve_backend("auto", gpus, nccl_available=True) == backend
    assert resolve_nprocs(plan.nprocs, backend, gpus) == nprocs


@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_gloo_is_cpu_ranks_whatever_the_gpus(gpus):
    assert resolve_backend("gloo", gpus, nccl_available=True) == "gloo"
    assert resolve_nprocs(2, "gloo", gpus) == 2


def test_two_gpu_ranks_on_one_gpu_are_refused_before_starting():
    with pytest.raises(LaunchError, match="nprocs=2 GPU ranks need 2 GPUs, but 1 is visible"):
        resolve_nprocs(2, resolve_backend("auto", 1, nccl_available=True), 1)


def test_without_nccl_gpus_are_not_used_for_collectives():
    plan = plan_for(2, nccl_available=False, usable_cores=4)
    assert (plan.backend, plan.device_type) == ("gloo", "cpu")
    assert "no NCCL" in plan.summary


@pytest.mark.parametrize(("backend", "visible", "expected"), [
    ("gloo", 8, "cpu"), (GPU_BACKEND, 8, "cuda:3"), ("nccl", 8, "cuda:3"),
    (GPU_BACKEND, 1, "cuda:0")])  # srun --gpus-per-task=1: each task sees its GPU as cuda:0
def test_device_follows_the_group_backend(monkeypatch, backend, visible, expected):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert mh.device() == torch.device(expected)


def test_device_without_group_is_cpu(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert mh.device() == torch.device("cpu")
