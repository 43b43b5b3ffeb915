"""Chapter 08's labs: every bug is detected within its timeout, every fix passes.
No test can hang: each launch has a group timeout and a hard join_timeout."""

import pytest

from mgpu_helpers import LaunchError, launch
from mgpu_helpers import debug_labs as labs

pytestmark = pytest.mark.usefixtures("no_leftover_processes")
BOUND = {"nprocs": 2, "timeout": 5, "join_timeout": 60}


@pytest.mark.slow
def test_a_collective_only_rank0_calls_times_out_and_the_fix_passes():
    with pytest.raises(LaunchError, match="rank 0 failed: .*Timed out"):
        launch(labs.lab_collective_on_one_rank, **BOUND)
    assert launch(labs.lab_collective_on_one_rank, True, **BOUND) == 8.0


@pytest.mark.slow
def test_monitored_barrier_names_the_missing_rank():
    with pytest.raises(LaunchError, match="Rank 1 failed to pass monitoredBarrier"):
        launch(labs.lab_monitored_barrier, **BOUND)
    assert launch(labs.lab_monitored_barrier, True, **BOUND) == "all ranks passed the barrier"


def test_mismatched_shapes_crash_and_detail_debugging_names_them():
    with pytest.raises(LaunchError, match="killed by signal SIGABRT|failed"):
        launch(labs.lab_mismatched_shapes, **BOUND)
    with labs.distributed_debug("DETAIL"):
        with pytest.raises(LaunchError, match=r"Detected mismatch between collectives"
                                              r"(.|\n)*TensorShape=\[[45]\]"):
            launch(labs.lab_mismatched_shapes, **BOUND)
        assert launch(labs.lab_mismatched_shapes, True, **BOUND) == [2.0] * 4


@pytest.mark.slow
def test_mismatched_order_times_out_and_detail_debugging_names_it():
    with pytest.raises(LaunchError, match="Timed out"):
        launch(labs.lab_mismatched_order, **BOUND)
    with labs.distributed_debug("DETAIL"):
        with pytest.raises(LaunchError, match="OpType=(ALLREDUCE|BROADCAST)"):
            launch(labs.lab_mismatched_order, **BOUND)
    assert launch(labs.lab_mismatched_order, True, **BOUND) == [2.0] * 3 + [0.0] * 3


def test_debug_level_is_restored():
    import os

    import torch.distributed as dist
    before = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    with labs.distributed_debug("DETAIL"):
        assert dist.get_debug_level() == dist.DebugLevel.DETAIL
    assert os.environ.get("TORCH_DISTRIBUTED_DEBUG") == before
    with pytest.raises(ValueError, match="OFF, INFO or DETAIL"):
        with labs.distributed_debug("LOUD"):
            pass


def test_unused_parameter_fails_under_ddp_until_found():
    with pytest.raises(LaunchError, match="find_unused_parameters=True"):
        launch(labs.lab_unused_parameter, **BOUND)
    assert launch(labs.lab_unused_parameter, "find_unused", 3, **BOUND) > 0
    assert launch(labs.lab_unused_parameter, "remove", 3, **BOUND) > 0
    with pytest.raises(LaunchError, match="fix must be None, 'find_unused' or 'remove'"):
        launch(labs.lab_unused_parameter, "ignore", **BOUND)


def test_rank_dependent_initialisation_is_detected_and_fixed():
    assert launch(labs.lab_rank_dependent_init, **BOUND) is False
    assert launch(labs.lab_rank_dependent_init, True, **BOUND) is True


def test_identical_augmentation_across_ranks_is_detected_and_fixed():
    same = launch(labs.lab_identical_augmentation, return_all=True, **BOUND)
    assert same[0] == same[1]
    fixed = launch(labs.lab_identical_augmentation, True, return_all=True, **BOUND)
    assert fixed[0] != fixed[1]


@pytest.mark.slow
def test_a_rank_killed_mid_epoch_is_reported_and_the_run_resumes(tmp_path):
    from mgpu_helpers.recipe import DigitsRun, train_digits

    run = {"epochs": 2, "limit": 64, "global_batch": 32, "progress": False,
           "evaluate_every_epoch": False, "checkpoint": tmp_path / "run.pt"}
    with pytest.raises(LaunchError, match="rank 1 killed by signal SIGKILL"):
        launch(train_digits, DigitsRun(**run, die_at_epoch=1), nprocs=2, join_timeout=120)
    resumed = launch(train_digits, DigitsRun(**run), nprocs=2, join_timeout=120)
    assert [entry["epoch"] for entry in resumed["history"]] == [1]
