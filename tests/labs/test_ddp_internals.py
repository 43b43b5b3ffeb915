"""Chapter 05's look inside DDP (mgpu_helpers.labs.ddp_internals): the backward timeline,
uneven inputs with Join, gradient clipping with a GradScaler and with no_sync."""

import os

import pytest
import torch

from mgpu_helpers import LaunchError, launch
from mgpu_helpers.labs import ddp_internals

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def test_backward_timeline_orders_gradients_hooks_and_all_reduces():
    records = launch(ddp_internals.backward_timeline, 2, 4, nprocs=2, backend="gloo")
    step = records[-1]
    names = [b["parameters"] for b in step["buckets"]]
    assert names[0][-1] == "fc1.weight" and "conv1.weight" in names[-1]
    for bucket in step["buckets"]:
        assert bucket["start"] >= max(step["ready"][name] for name in bucket["parameters"])
        assert bucket["end"] >= bucket["start"]
    assert step["backward_s"] >= max(b["end"] for b in step["buckets"])
    assert step["buckets"][0]["start"] < step["ready"]["conv1.weight"]  # overlap


def test_a_smaller_bucket_cap_gives_more_buckets_and_no_exchange_takes_no_time():
    default = launch(ddp_internals.backward_timeline, 2, 4, nprocs=2, backend="gloo")[-1]
    small = launch(ddp_internals.backward_timeline, 2, 4, 0.01, False, nprocs=2,
                   backend="gloo")[-1]
    assert len(small["buckets"]) > len(default["buckets"]) == 2
    assert all(b["end"] == b["start"] for b in small["buckets"])
    assert sum(b["bytes"] for b in small["buckets"]) == sum(
        b["bytes"] for b in default["buckets"])


def test_find_unused_parameters_splits_the_buckets_from_the_start_and_keeps_them():
    records = launch(ddp_internals.backward_timeline, 2, 4, None, True, True, nprocs=2,
                     backend="gloo")
    layouts = [[sorted(b["parameters"]) for b in record["buckets"]] for record in records]
    assert layouts[0] == layouts[1] == [
        ["fc1.bias", "fc2.bias", "fc2.weight"],
        ["conv1.bias", "conv1.weight", "conv2.bias", "conv2.weight", "fc1.weight"]]
    # the default rebuilds after step 1: the same model, other buckets
    default = launch(ddp_internals.backward_timeline, 2, 4, nprocs=2, backend="gloo")
    assert len(default[0]["buckets"]) == 1
    assert [sorted(b["parameters"]) for b in default[1]["buckets"]] != layouts[1]


def test_counted_all_reduces_counts_and_restores():
    import torch.distributed as dist

    real = dist.all_reduce
    with pytest.raises(ZeroDivisionError), ddp_internals.counted_all_reduces([]):
        assert dist.all_reduce is not real
        raise ZeroDivisionError
    assert dist.all_reduce is real


def test_join_lets_uneven_ranks_finish_with_one_process_arithmetic():
    ranks = launch(ddp_internals.uneven_steps, [3, 1], True, nprocs=2, backend="gloo",
                   return_all=True)
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])
    reference = ddp_internals.uneven_reference([3, 1])
    assert (ranks[0]["weights"] - reference).abs().max() < 1e-6
    # the check can fail: dividing by the ranks still training is another result
    even = ddp_internals.uneven_reference([3, 3])
    assert (ranks[0]["weights"] - even).abs().max() > 1e-4
    # Join's cost: two one-number all-reduces in every forward pass (no buffers here)
    assert [len(r["forward_all_reduces"]) for r in ranks] == [3, 1]
    assert all(sizes == [1, 1] for r in ranks for sizes in r["forward_all_reduces"])


@pytest.mark.slow
def test_uneven_ranks_without_join_hang_until_the_group_timeout():
    with pytest.raises(LaunchError, match=r"Timed out waiting 2000ms for \w+ operation"):
        launch(ddp_internals.uneven_steps, [3, 2], False, nprocs=2, backend="gloo",
               timeout=2)


@pytest.mark.parametrize("ranks", [None, 2])
def test_amp_clipping_needs_unscale_first(ranks):
    def run(unscale_first):
        if ranks is None:  # one plain process
            return [ddp_internals.amp_clipped_step(unscale_first)]
        return launch(ddp_internals.amp_clipped_step, unscale_first, nprocs=ranks,
                      backend="gloo", return_all=True)

    right, wrong = run(True), run(False)
    for outcome in (right, wrong):
        assert all(torch.equal(o["weights"], outcome[0]["weights"]) for o in outcome)
    right, wrong = right[0], wrong[0]
    assert right["true_norm"] > 0.1
    assert right["seen_norm"] == pytest.approx(right["true_norm"], rel=1e-3)
    assert right["update_norm"] == pytest.approx(0.5 * 0.1, rel=1e-3)
    assert wrong["seen_norm"] == pytest.approx(wrong["true_norm"] * 1024, rel=1e-2)
    assert right["update_norm"] == pytest.approx(wrong["update_norm"] * 1024, rel=1e-2)


def test_clipping_once_after_no_sync_accumulation_is_the_big_batch_step():
    reference = ddp_internals.accumulate_and_clip(4)
    assert reference["norm"] > 0.1
    once = launch(ddp_internals.accumulate_and_clip, 2, nprocs=2, backend="gloo",
                  return_all=True)
    each = launch(ddp_internals.accumulate_and_clip, 2, True, nprocs=2, backend="gloo",
                  return_all=True)
    for outcome in (once, each):
        assert torch.equal(outcome[0]["weights"], outcome[1]["weights"])
    assert (once[0]["weights"] - reference["weights"]).abs().max() < 1e-5
    assert once[0]["norm"] == pytest.approx(reference["norm"], rel=1e-5)
    assert (each[0]["weights"] - reference["weights"]).abs().max() > 1e-3


def test_changed_after_wrapping_added_is_unsynchronised_reinitialised_is_not_broadcast():
    ranks = launch(ddp_internals.changed_after_wrapping, nprocs=2, backend="gloo",
                   return_all=True)
    head0, head1 = ranks[0]["head"], ranks[1]["head"]
    assert torch.equal(head0["before"], head1["before"])
    assert not torch.equal(head0["grad"], head1["grad"])
    first0, first1 = ranks[0]["first"], ranks[1]["first"]
    assert torch.equal(first0["grad"], first1["grad"])
    gap_before = first0["before"] - first1["before"]
    assert gap_before.abs().min() > 0
    assert (first0["after"] - first1["after"] - gap_before).abs().max() < 1e-6
    # one plain process runs it too
    alone = ddp_internals.changed_after_wrapping()
    assert alone["first"]["grad"].shape == first0["grad"].shape


def test_native_stderr_silenced_drops_only_the_named_lines(capfd):
    from mgpu_helpers.labs.native_stderr import native_stderr_silenced

    with native_stderr_silenced(keep_lines_without="drop me"):
        os.write(2, b"[W] drop me: a timestamped warning\nan error's last words\n")
    with native_stderr_silenced():
        os.write(2, b"all of this goes\n")
    assert capfd.readouterr().err == "an error's last words\n"
