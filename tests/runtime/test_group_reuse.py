"""Code written for torchrun runs unchanged under launch().

Such code creates its process group itself and reads RANK, LOCAL_RANK and WORLD_SIZE, as
PyTorch's DDP tutorial does. Before, launch() had already created the group and the
function's own init_process_group raised "trying to initialize the default process
group twice!".
"""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

from mgpu_helpers import LaunchError, launch

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT")


def torchrun_style_training(steps: int = 3):
    """As in PyTorch's DDP tutorial (multigpu_torchrun.py), on CPU ranks."""
    dist.init_process_group(backend="gloo")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(rank)  # different initial weights: DDP must broadcast rank 0's
    model = DDP(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        inputs = torch.full((8, 4), float(rank + step))
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        optimizer.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    dist.destroy_process_group()
    return {"rank": rank, "local_rank": local_rank, "world": world, "weights": weights,
            "environment": sorted(v for v in TORCHRUN_VARIABLES if v in os.environ)}


def test_torchrun_style_function_runs_unchanged_and_replicas_agree():
    results = launch(torchrun_style_training, nprocs=2, return_all=True, backend="gloo")
    assert [(r["rank"], r["local_rank"], r["world"]) for r in results] == [(0, 0, 2), (1, 1, 2)]
    assert all(r["environment"] == sorted(TORCHRUN_VARIABLES) for r in results)
    assert torch.equal(results[0]["weights"], results[1]["weights"])


def imported_by_name():
    # `from torch.distributed import init_process_group` at the top of a module or cell
    init_process_group("gloo", rank=int(os.environ["RANK"]),
                       world_size=int(os.environ["WORLD_SIZE"]))
    value = torch.ones(1)
    dist.all_reduce(value)
    destroy_process_group()
    return value.item()


def test_init_process_group_imported_by_name_is_reused_too():
    assert launch(imported_by_name, nprocs=2, backend="gloo") == 2.0


def init_with(arguments: dict):
    dist.init_process_group(**arguments)
    return "joined"


@pytest.mark.parametrize(("arguments", "message"), [
    ({"backend": "gloo", "world_size": 4}, "world_size=4, but launch started 2 ranks"),
    ({"backend": "nccl"}, "backend='nccl', but launch made a gloo group"),
    ({"backend": "mpi"}, "backend='mpi', but launch made a gloo group"),
])
def test_a_contradicting_init_is_an_error_that_says_so(arguments, message):
    with pytest.raises(LaunchError, match="contradicts the launch") as raised:
        launch(init_with, arguments, nprocs=2, backend="gloo")
    assert message in str(raised.value)


def test_a_rank_argument_that_is_not_this_rank_is_an_error():
    with pytest.raises(LaunchError, match="rank=0, but this is rank 1"):
        launch(init_with, {"backend": "gloo", "rank": 0, "world_size": 2}, nprocs=2,
               backend="gloo")


def test_code_that_uses_the_launched_group_still_works():
    def launch_style():
        value = torch.ones(1)
        dist.all_reduce(value)
        return value.item()

    assert launch(launch_style, nprocs=2, backend="gloo") == 2.0


def test_init_process_group_is_put_back_after_the_run():
    launch(torchrun_style_training, 1, nprocs=2, backend="gloo")
    assert dist.init_process_group is dist.distributed_c10d.init_process_group
    assert not getattr(dist.init_process_group, "reuses_launched_group", False)
    assert init_process_group is dist.init_process_group


# A torchrun-style function defined in a notebook cell and launched from there is chapter
# 05's bare_ddp_script (its own init_process_group, LOCAL_RANK read from the environment,
# the replicas compared bitwise), which nbval runs in a real kernel.


def _ddp_in_a_reference_cycle(kept):
    import weakref

    model = DDP(torch.nn.Linear(4, 2))
    model(torch.ones(2, 4)).sum().backward()  # the reducer holds this step's work
    holder = {"model": model}
    holder["self"] = holder  # a cycle, as DDP's hooks and reducer make one
    kept.append(weakref.ref(model))
    return dist.get_rank()


def test_in_place_the_group_and_ddp_are_freed_before_the_function_returns(monkeypatch):
    # Under torchrun the launcher runs the function in this process; DDP objects held in
    # reference cycles keep gloo's group, whose threads must end while Python is whole
    # (freed at shutdown, a worker thread aborted the process in 2 torchrun runs of 40).
    import socket

    from mgpu_helpers.launcher.in_place import run_in_this_process
    from mgpu_helpers.runtime.cluster import ClusterRank

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                        "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    kept = []
    cluster = ClusterRank("torchrun", rank=0, world_size=1, local_rank=0, init_method="env://")
    assert run_in_this_process(_ddp_in_a_reference_cycle, (kept,), {}, cluster, "gloo",
                               30.0) == 0
    assert not dist.is_initialized()
    assert kept[0]() is None, "the DDP model (and the group it holds) is still alive"
