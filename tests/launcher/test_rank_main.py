"""What runs inside a launched rank: its place, its results and its output,
on 2 gloo ranks forked from this process."""

import gc
import os
import sys
import threading
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from support.launching import SCRIPTS, run_script, where_am_i

import mgpu_helpers as mh
from mgpu_helpers import LaunchError, launch

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


# ------------------------------------------------------------------- ranks and results


def test_every_rank_knows_where_it_runs():
    results = launch(where_am_i, nprocs=2, return_all=True)
    assert results == [
        {"rank": r, "world": 2, "local": r, "device": "cpu", "main": r == 0, "threads": 1,
         "addr": "127.0.0.1"} for r in range(2)
    ]


def frozen_objects():
    return gc.get_freeze_count()


def test_a_forked_rank_leaves_the_objects_it_inherits_to_its_parent():
    # the collector of a forked rank never walks (and so never copies) its parent's heap
    parent = len(gc.get_objects())
    assert launch(frozen_objects, nprocs=2, start_method="fork") >= 0.9 * parent
    assert gc.get_freeze_count() == 0  # this process's own collector is untouched


def test_cpu_threads_is_configurable():
    assert launch(torch.get_num_threads, nprocs=2, cpu_threads=2) == 2


def reduce_and_return(kind):
    value = torch.tensor([float(mh.rank() + 1)], requires_grad=False)
    dist.all_reduce(value)
    if kind == "dict":
        return {"sum": value.item(), "rank": mh.rank()}
    if kind == "tensor":
        return value * torch.ones(2, requires_grad=True)  # a non-leaf: comes back detached
    if kind == "bytes":
        return bytes([mh.rank()]) * 50_000_000
    raise AssertionError(kind)


def test_returns_rank0_value_or_all_values_and_leaves_the_environment_unchanged():
    before = dict(os.environ)
    assert launch(reduce_and_return, "dict", nprocs=2) == {"sum": 3.0, "rank": 0}
    all_values = launch(reduce_and_return, "dict", nprocs=2, return_all=True)
    assert all_values == [{"sum": 3.0, "rank": 0}, {"sum": 3.0, "rank": 1}]
    # two launches in a row: neither leaves its settings or its group behind
    assert dict(os.environ) == before
    assert not dist.is_initialized()


def test_tensors_come_back_on_cpu_detached():
    value = launch(reduce_and_return, "tensor", nprocs=2)
    assert value.device.type == "cpu" and not value.requires_grad
    assert value.tolist() == [3.0, 3.0]


@dataclass
class Trained:
    model: torch.nn.Module
    losses: list
    gradients: dict


def return_a_trained_module():
    model = torch.nn.Linear(3, 2)
    loss = model(torch.ones(1, 3)).square().sum()  # a non-leaf tensor that requires grad
    loss.backward()
    return Trained(model, [loss], {"weight": model.weight.grad})


def test_tensors_inside_dataclasses_and_modules_come_back_detached():
    # Before, only dicts, lists and tuples were walked: a loss inside a dataclass could not
    # be pickled, and a CUDA module would have come back on the GPU (initialising CUDA in
    # the notebook, so that later launches had to spawn).
    trained = launch(return_a_trained_module, nprocs=1, backend="gloo")
    assert isinstance(trained.model.weight, torch.nn.Parameter)
    assert trained.model.weight.requires_grad and trained.model.weight.device.type == "cpu"
    assert not trained.losses[0].requires_grad
    gradient = trained.gradients["weight"]
    assert gradient.shape == (2, 3) and gradient.device.type == "cpu"


def test_50_mb_return_values_do_not_deadlock():
    values = launch(reduce_and_return, "bytes", nprocs=2, return_all=True)
    assert [len(v) for v in values] == [50_000_000, 50_000_000]
    assert values[1][:3] == b"\x01\x01\x01"


def return_a_lock():
    return threading.Lock()


def test_unpicklable_return_value_names_the_rank():
    with pytest.raises(LaunchError) as caught:
        launch(return_a_lock, nprocs=2)
    message = str(caught.value)
    assert message.startswith("rank ")
    assert "cannot pickle '_thread.lock' object (while sending its return value back)" in message
    assert "Advice: A rank's return value travels back to the launcher pickled" in message


def chatty():
    print(f"hello from {mh.rank()}")
    print(f"warning from {mh.rank()}", file=sys.stderr)
    mh.print0("only rank 0 says this")


def test_output_is_prefixed_line_by_line(capfd):
    launch(chatty, nprocs=2)
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == ["[rank 0] hello from 0", "[rank 0] only rank 0 says this",
                                        "[rank 1] hello from 1"]
    assert sorted(err.splitlines()) == ["[rank 0] warning from 0", "[rank 1] warning from 1"]


@pytest.mark.slow
def test_function_from_main_module_under_fork_and_spawn():
    done = run_script(sys.executable, str(SCRIPTS / "main_module.py"))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "fork: 21" in lines and "spawn: 21" in lines
    # DDP's and FSDP2's first call imports torch._dynamo; the parent did, once, before
    # forking, so no forked rank pays for it again
    assert "forked ranks inherit the parent's imports: True" in lines
    assert lines.count("[rank 0] printed once") == 2
    assert "[rank 1] rank 1 of 2 on cpu" in lines
    assert "environment unchanged" in lines


