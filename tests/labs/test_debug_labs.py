"""Chapter 09's labs: every bug is detected, every fix passes, and the one-line summaries
the chapter prints do not depend on which rank reported first.

No test can hang: each launch has a group timeout and a hard join_timeout. A lab that
hangs waits exactly the group's timeout, so those launches use a short one (HANG)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from mgpu_helpers import LaunchError, launch, rank
from mgpu_helpers.data.loading import loader_generator, seed_worker
from mgpu_helpers.labs import debug_labs as labs
from mgpu_helpers.labs.augmentation_seeds import RandomAngles

pytestmark = pytest.mark.usefixtures("no_leftover_processes")
BOUND = {"nprocs": 2, "timeout": 30, "join_timeout": 60}  # launches that must not time out
HANG = {**BOUND, "timeout": 2}  # launches whose point is that a collective times out


def test_a_collective_only_rank0_calls_times_out_and_the_fix_passes():
    with pytest.raises(LaunchError, match="^rank 0 failed: RuntimeError: .*Timed out "
                                          "waiting 2000ms for recv") as caught:
        launch(labs.lab_collective_on_one_rank, **HANG)
    assert "rank 1: killed by signal SIGTERM" in str(caught.value)  # stopped, not failed
    assert (labs.failure_summary(str(caught.value))
            == "RuntimeError: Timed out waiting 2000ms for recv operation")
    assert launch(labs.lab_collective_on_one_rank, True, **BOUND) == 8.0


def test_monitored_barrier_names_the_missing_rank():
    with pytest.raises(LaunchError, match="Rank 1 failed to pass monitoredBarrier in "
                                          "1000 ms") as caught:
        launch(labs.lab_monitored_barrier, False, 1.0, **BOUND)
    assert (labs.failure_summary(str(caught.value))
            == "RuntimeError: Rank 1 failed to pass monitoredBarrier in 1000 ms")
    assert (launch(labs.lab_monitored_barrier, True, 1.0, **BOUND)
            == "all ranks passed the barrier")


def test_monitored_barrier_waiting_for_all_ranks_names_every_missing_one():
    with pytest.raises(LaunchError, match="Ranks 1, 2 failed to pass monitoredBarrier in "
                                          "1000 ms") as caught:
        launch(labs.lab_monitored_barrier, False, 1.0, True, **(BOUND | {"nprocs": 3}))
    assert (labs.failure_summary(str(caught.value))
            == "RuntimeError: Ranks 1, 2 failed to pass monitoredBarrier in 1000 ms")


def test_mismatched_shapes_crash_and_detail_debugging_names_them(capsys):
    with pytest.raises(LaunchError, match="rank 0:? killed by signal SIGABRT") as caught:
        launch(labs.lab_mismatched_shapes, **BOUND)
    rank_output = capsys.readouterr().err
    assert "[rank 0]" in rank_output and "Received data size doesn't match" in rank_output
    assert (labs.failure_summary(str(caught.value), rank_output) == "rank 0 killed by signal "
            "SIGABRT: Received data size doesn't match expected size")
    with labs.distributed_debug("DETAIL"):
        with pytest.raises(LaunchError, match=r"Detected mismatch between collectives"
                                              r"(.|\n)*TensorShape=\[[45]\]") as caught:
            launch(labs.lab_mismatched_shapes, **BOUND)
        assert launch(labs.lab_mismatched_shapes, True, **BOUND) == [2.0] * 4
    assert labs.failure_summary(str(caught.value)) == (
        "RuntimeError: Detected mismatch between collectives: rank 0 ALLREDUCE of shape [4], "
        "rank 1 ALLREDUCE of shape [5]")


def test_mismatched_order_times_out_and_detail_debugging_names_it():
    with pytest.raises(LaunchError, match="Timed out waiting 2000ms"):
        launch(labs.lab_mismatched_order, **HANG)
    with labs.distributed_debug("DETAIL"):
        with pytest.raises(LaunchError, match="OpType=(ALLREDUCE|BROADCAST)") as caught:
            launch(labs.lab_mismatched_order, **BOUND)
    assert labs.failure_summary(str(caught.value)) == (
        "RuntimeError: Detected mismatch between collectives: rank 0 ALLREDUCE of shape [3], "
        "rank 1 BROADCAST of shape [3]")
    assert launch(labs.lab_mismatched_order, True, **BOUND) == [2.0] * 3 + [0.0] * 3


# The same failure as two different runs may report it: the summary must not differ.
FINGERPRINT = ("CollectiveFingerPrint(SequenceNumber=0, OpType={op}, TensorShape=[{shape}], "
               "TensorDtypes=Float)")
DETAIL_REPORTS = [
    f"rank {reporter} failed: RuntimeError: Detected mismatch between collectives on ranks. "
    f"Rank {reporter} is running collective: "
    + FINGERPRINT.format(op="ALLREDUCE", shape=4 + reporter)
    + f", but Rank {1 - reporter} is running collective: "
    + FINGERPRINT.format(op="ALLREDUCE", shape=5 - reporter)
    + f"\n\nOther ranks (stopped by the launcher after the failure):\n  rank {1 - reporter}: "
    "killed by signal SIGTERM"
    for reporter in (0, 1)
]
ABORT_REPORTS = [
    "rank 0 killed by signal SIGABRT\nOther ranks (stopped by the launcher after the "
    "failure):\n  rank 1: killed by signal SIGTERM",
    "rank 1 failed: RuntimeError: [/gloo/pair.cc:545] Read error: Connection reset by peer."
    "\n\nOther ranks (stopped by the launcher after the failure):\n  rank 0: killed by "
    "signal SIGABRT",
]
GLOO_LAST_WORDS = ("[rank 0]   what():  [enforce fail at /gloo/pair.cc:464] 8 vs 4. Received "
                   "data size doesn't match expected size. Is there a collective mismatch?\n")


def test_failure_summary_does_not_depend_on_which_rank_reported_first():
    assert {labs.failure_summary(report) for report in DETAIL_REPORTS} == {
        "RuntimeError: Detected mismatch between collectives: rank 0 ALLREDUCE of shape [4], "
        "rank 1 ALLREDUCE of shape [5]"}
    assert {labs.failure_summary(report, GLOO_LAST_WORDS) for report in ABORT_REPORTS} == {
        "rank 0 killed by signal SIGABRT: Received data size doesn't match expected size"}
    barrier = ("rank 0 failed: RuntimeError: [Rank 0]: Rank 1 failed to pass monitoredBarrier "
               "in 2000 ms\n Original exception: \n[/gloo/unbound_buffer.cc:78] Timed out "
               "waiting {}ms for recv operation to complete")
    assert {labs.failure_summary(barrier.format(ms)) for ms in (2000, 1999)} == {
        "RuntimeError: Rank 1 failed to pass monitoredBarrier in 2000 ms"}


def test_failure_summary_of_an_unexpected_error_quotes_its_first_line():
    report = "rank 1 failed: ValueError: bad value 3\n\nTraceback from rank 1: ..."
    assert labs.failure_summary(report) == "ValueError: bad value 3"
    assert (labs.failure_summary("rank 1 killed by signal SIGKILL (killed from outside)")
            == "rank 1 killed by signal SIGKILL")


def test_debug_level_is_restored():
    import os

    before = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    with labs.distributed_debug("DETAIL"):
        assert dist.get_debug_level() == dist.DebugLevel.DETAIL
    assert os.environ.get("TORCH_DISTRIBUTED_DEBUG") == before
    with pytest.raises(ValueError, match="OFF, INFO or DETAIL"):
        with labs.distributed_debug("LOUD"):
            pass


def test_unused_parameter_fails_under_ddp_until_found_or_removed():
    with pytest.raises(LaunchError, match="find_unused_parameters=True") as caught:
        launch(labs.lab_unused_parameter, **BOUND)
    assert labs.failure_summary(str(caught.value)) == (
        "RuntimeError: Expected to have finished reduction in the prior iteration ... "
        "find_unused_parameters=True")
    searched = launch(labs.lab_unused_parameter, "find_unused", 3, **BOUND)
    removed = launch(labs.lab_unused_parameter, "remove", 3, **BOUND)
    head = labs.TwoHeads().unused_head
    head_bytes = sum(p.numel() * p.element_size() for p in head.parameters())
    assert searched.found_unused_bytes == head_bytes and removed.found_unused_bytes == 0
    # measured in the last step: the unused head's zero gradients are all-reduced too ...
    assert searched.reduced_bytes == removed.reduced_bytes + head_bytes
    assert searched.reduced_parameters == sorted(
        name for name, _ in labs.TwoHeads().named_parameters())
    assert searched.zero_gradients == ["unused_head.bias", "unused_head.weight"]
    assert removed.zero_gradients == [] and len(removed.reduced_parameters) == 4
    # ... and a second all-reduce per step: which of the 6 parameters each rank used
    assert searched.step_collectives == [("gloo:all_reduce", searched.reduced_bytes // 4),
                                         ("gloo:all_reduce", 6)]
    assert removed.step_collectives == [("gloo:all_reduce", removed.reduced_bytes // 4)]
    assert removed.buckets_rebuilt and not searched.buckets_rebuilt
    assert searched.trained.keys() == removed.trained.keys() == {
        "body.weight", "body.bias", "head.weight", "head.bias"}
    assert all(torch.equal(searched.trained[name], removed.trained[name])
               for name in removed.trained)
    with pytest.raises(LaunchError, match="fix must be None, 'find_unused' or 'remove'"):
        launch(labs.lab_unused_parameter, "ignore", **BOUND)


def test_the_flight_recorder_is_one_per_process_for_all_its_groups():
    # Groups are numbered per process, from a counter a forked rank inherits: after a
    # test that made groups in this process, the ranks' groups are 1 and 2, not 0 and 1
    for entries in launch(labs.lab_one_recorder_per_process, return_all=True, **BOUND):
        (first, second) = entries
        assert second["pg_id"] == first["pg_id"] + 1  # two groups in one dump
        assert [(e["seq"], e["name"]) for e in entries] == [(1, "gloo:all_reduce")] * 2
        assert all(e["called_here"] for e in entries)


def test_rank_dependent_initialisation_is_detected_and_fixed():
    assert launch(labs.lab_rank_dependent_init, return_all=True, **BOUND) == [False, False]
    assert launch(labs.lab_rank_dependent_init, True, return_all=True, **BOUND) == [True, True]


def _replicas_after(change: str) -> tuple[bool, bool]:
    """(replicas_agree, whether a sum-of-weights checksum agrees) after rank 1 changes
    its copy of a model in a way that keeps the sum of its weights exactly."""
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(torch.arange(12.0).reshape(3, 4) / 4)  # exact in float32
        model.bias.fill_(0.5)
        if rank() == 1 and change == "permuted":
            model.weight.copy_(model.weight.flip(0))
        elif rank() == 1 and change == "compensated":
            model.weight[0, 0] += 0.25
            model.weight[2, 3] -= 0.25
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
    checksums = [torch.zeros((), dtype=torch.float64) for _ in range(2)]
    dist.all_gather(checksums, checksum)
    return labs.replicas_agree(model), bool(torch.equal(*checksums))


def _replicas_of_different_sizes() -> bool:
    return labs.replicas_agree(nn.Linear(4, 3 + rank()))


def _replicas_after_each(changes: list[str]) -> dict[str, tuple[bool, bool]]:
    return {change: _replicas_after(change) for change in changes}


def test_replicas_agree_compares_every_parameter_not_a_checksum():
    # one world, every case in turn: unchanged, then each change that keeps the checksum
    found = launch(_replicas_after_each, ["none", "permuted", "compensated"],
                   return_all=True, **BOUND)
    for by_change in found:
        assert by_change == {"none": (True, True), "permuted": (False, True),
                             "compensated": (False, True)}


def test_replicas_of_different_sizes_disagree_without_hanging():
    assert launch(_replicas_of_different_sizes, return_all=True, **BOUND) == [False, False]


def angles(draws, worker=None):
    return [angle for _, by, angle in draws if worker in (None, by)]


@pytest.fixture(scope="module")
def fixed_augmentation():
    """The augmentation lab with its fix: each rank's draws (two tests read them)."""
    return launch(labs.lab_identical_augmentation, True, return_all=True, **BOUND)


def test_identical_augmentation_across_ranks_is_detected_and_fixed(fixed_augmentation):
    same = launch(labs.lab_identical_augmentation, return_all=True, **BOUND)
    fixed = fixed_augmentation
    for draws in same + fixed:
        assert len(draws) == 8 and all(-30 <= angle <= 30 for angle in angles(draws))
    for index, draws in enumerate(same):  # the sampler's share of each rank
        assert [sample for sample, _, _ in draws] == list(range(index, 16, 2))
    # the bug: the same angles for the two ranks' different samples; the fix: all differ
    assert angles(same[0]) == angles(same[1])
    assert set(angles(fixed[0])).isdisjoint(angles(fixed[1]))
    # within a rank, the DataLoader seeds each of its 2 workers differently
    for draws in same + fixed:
        assert {worker for _, worker, _ in draws} == {0, 1}
        assert set(angles(draws, 0)).isdisjoint(angles(draws, 1))


def test_the_augmentation_lab_draws_chapter_02s_random_angles(fixed_augmentation):
    assert isinstance(labs.TaggedAngles(4, degrees=30.0).angles, RandomAngles)
    # The lab's angles are RandomAngles' own draws, loaded as the lab loads them: each
    # rank's share of 16 samples, 2 workers, the loader seeded per rank (the fix).
    for index, draws in enumerate(fixed_augmentation):
        dataset = RandomAngles(16, degrees=30.0)
        sampler = DistributedSampler(dataset, num_replicas=2, rank=index, shuffle=False)
        loader = DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=2,
                            collate_fn=list, worker_init_fn=seed_worker,
                            generator=loader_generator(0, index))
        assert angles(draws) == [angle for batch in loader for angle in batch]
    # without workers, the loading process draws (worker -1), from its own generator
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tagged = [labs.TaggedAngles(3, degrees=30.0)[index] for index in range(3)]
        torch.manual_seed(0)
        plain = [RandomAngles(3, degrees=30.0)[index] for index in range(3)]
    assert tagged == [(index, -1, angle) for index, angle in enumerate(plain)]


@pytest.mark.slow
def test_a_rank_killed_mid_epoch_is_reported_and_the_run_resumes(digits_ready, tmp_path):
    from mgpu_helpers.training.recipe import DigitsRun

    run = {"epochs": 2, "limit": 64, "global_batch": 32, "progress": False,
           "evaluate_every_epoch": False, "checkpoint": tmp_path / "run.pt"}
    with pytest.raises(LaunchError, match="rank 1:? killed by signal SIGKILL") as caught:
        launch(labs.train_digits_with_a_crash, DigitsRun(**run), nprocs=2, join_timeout=120)
    assert labs.failure_summary(str(caught.value)) == "rank 1 killed by signal SIGKILL"
    # epoch 0's checkpoint survives the crash: a run started again resumes from it
    assert torch.load(run["checkpoint"], weights_only=True)["epoch"] == 1
    # The same crash with max_restarts=1: the launcher starts both ranks again, which
    # resume from epoch 1's checkpoint, and the crash lab does not strike a second time.
    again = {**run, "checkpoint": tmp_path / "restarted.pt"}
    restarted = launch(labs.train_digits_with_a_crash, DigitsRun(**again), nprocs=2,
                       join_timeout=120, max_restarts=1)
    assert [entry["epoch"] for entry in restarted["history"]] == [1]
    assert torch.load(again["checkpoint"], weights_only=True)["epoch"] == 2
