"""The ranks started from a fresh interpreter (spawn), as on a GPU node once
CUDA is initialised: the main paths again, under spawn."""

import os

import pytest
import torch
import torch.distributed as dist
from support.launching import rank1_dies, rank1_raises_while_rank0_waits, where_am_i

import mgpu_helpers as mh
from mgpu_helpers import LaunchError, launch

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


# ------------------------------------------------------------------------- under spawn
# On a GPU node launch spawns once the notebook has initialised CUDA (a forked rank could
# not use the GPU): ranks start from a fresh interpreter, the function reaches them by
# cloudpickle, and they end differently (see rank_exit.end_rank). The other launcher tests
# fork; these run the main paths again under spawn, on CPU ranks.


def report_and_return_a_tensor():
    if mh.rank() == 1 and mh.restart_count() == 0:
        raise ValueError("first attempt")
    print(f"hello from {mh.rank()} on attempt {mh.restart_count()}")
    value = torch.tensor([float(mh.rank() + 1)])
    dist.all_reduce(value)
    return {**where_am_i(), "sum": value * torch.ones(2, requires_grad=True),
            "restarts": (mh.restart_count(), int(os.environ["MGPU_RESTART_COUNT"]))}


@pytest.mark.slow
def test_under_spawn_values_output_tensors_and_restarts(capfd):
    # rank 1 fails on the first attempt: max_restarts starts every rank again, and the
    # second attempt's values, output and tensors come back
    values = launch(report_and_return_a_tensor, nprocs=2, return_all=True, max_restarts=1,
                    start_method="spawn")
    assert [(v["rank"], v["world"], v["device"], v["threads"]) for v in values] == [
        (0, 2, "cpu", 1), (1, 2, "cpu", 1)]
    assert all(v["sum"].tolist() == [3.0, 3.0] and not v["sum"].requires_grad
               for v in values)
    assert [v["restarts"] for v in values] == [(1, 1), (1, 1)]  # both on the second attempt
    out, err = capfd.readouterr()
    assert "[rank 0] hello from 0 on attempt 1" in out
    assert "[rank 1] hello from 1 on attempt 1" in out
    assert "(restart 1 of 1)" in err


@pytest.mark.slow
def test_under_spawn_failures_are_reported_as_under_fork():
    with pytest.raises(LaunchError) as caught:
        launch(rank1_raises_while_rank0_waits, nprocs=2, timeout=30, start_method="spawn")
    assert str(caught.value).startswith("rank 1 failed: ValueError: boom")
    assert 'raise ValueError("boom")' in str(caught.value)  # the rank's own traceback
    with pytest.raises(LaunchError, match=r"^rank 1 exited with code 3 without returning"):
        launch(rank1_dies, "exit", nprocs=2, timeout=30, start_method="spawn")


