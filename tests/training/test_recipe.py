"""Chapter 05's training run: settings checked, exact resume, results reported."""

import shutil

import pytest
import torch

from mgpu_helpers import launch
from mgpu_helpers.training.recipe import DigitsRun, train_digits

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

@pytest.mark.parametrize(("field", "value", "message"), [
    ("epochs", 0, "epochs must be a whole number >= 1"),
    ("global_batch", 2.5, "global_batch must be a whole number >= 1"),
    ("accumulate", 0, "accumulate must be a whole number >= 1"),
    ("limit", 0, "limit must be None or a whole number >= 1"),
    ("stop_after", -1, "stop_after must be None or a whole number >= 1"),
    ("lr", 0.0, "lr must be positive"),
    ("workers", -1, "workers must be >= 0"),
    ("amp", "fp8", "amp must be None or one of"),
])
def test_bad_settings_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        DigitsRun(**{field: value})


@pytest.mark.slow
def test_interrupted_and_resumed_run_ends_bitwise_equal_to_a_straight_run(
        digits_runs, tmp_path, capsys):
    # digits_runs (conftest): the straight run, and the same run stopped after epoch 0
    straight, straight_checkpoint, _ = digits_runs.straight
    first, first_checkpoint, _ = digits_runs.first
    checkpoint = tmp_path / "b.pt"
    shutil.copy(first_checkpoint, checkpoint)
    resumed = launch(train_digits, DigitsRun(**digits_runs.settings, checkpoint=checkpoint),
                     nprocs=2)
    assert f"[rank 0] resuming from {checkpoint} at epoch 1" in capsys.readouterr().out
    assert [e["epoch"] for e in straight["history"]] == [0, 1]
    assert [e["epoch"] for e in first["history"]] == [0]
    assert [e["epoch"] for e in resumed["history"]] == [1]
    a = torch.load(straight_checkpoint, weights_only=True)
    b = torch.load(checkpoint, weights_only=True)
    assert a["epoch"] == b["epoch"] == 2
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert resumed["test"] == straight["test"]
    assert resumed["history"][0]["loss"] == straight["history"][1]["loss"]


@pytest.mark.slow
def test_result_reports_history_settings_and_global_test_metrics(digits_runs):
    verbose, _, printed_verbose = digits_runs.straight
    quiet, checkpoint, printed_quiet = digits_runs.first  # verbose=False, no evaluation
    assert "[rank 0] epoch 1: train" in printed_verbose   # (the output was captured)
    assert "[rank 0]" not in printed_quiet                # verbose=False: rank 0 prints nothing
    for result in (verbose, quiet):
        assert result["test"]["samples"] == 355           # the whole test split, counted once
    assert quiet["settings"]["epochs"] == 2 and quiet["settings"]["stop_after"] == 1
    assert quiet["settings"]["checkpoint"] == str(checkpoint)  # a Path, reported as text
    for entry in quiet["history"]:
        assert entry.keys() == {"epoch", "loss", "accuracy", "seconds", "samples_per_s"}
        assert entry["samples_per_s"] > 0
    assert all(entry.keys() == {"epoch", "loss", "accuracy", "seconds", "samples_per_s",
                                "test_accuracy"} for entry in verbose["history"])


@pytest.mark.slow
def test_accumulation_and_bfloat16_run_end_to_end(digits_ready):
    # bfloat16 asked for explicitly: emulated (slow) on CPUs without it, so a small run
    # (2 optimizer steps of 2 accumulated micro-batches a rank)
    run = DigitsRun(epochs=1, limit=32, global_batch=16, accumulate=2, amp="bfloat16",
                    progress=False)
    result = launch(train_digits, run, nprocs=2)
    assert 0 <= result["test"]["accuracy"] <= 1
    assert all("test_accuracy" in entry for entry in result["history"])


def test_limited_runs_train_on_every_class(digits_ready):
    from mgpu_helpers.training.recipe import digits_datasets
    train_set, _ = digits_datasets(DigitsRun(limit=100, augment=False))
    labels = {train_set[i][1] for i in range(len(train_set))}
    assert len(train_set) == 100 and labels == set(range(10))
    indices = train_set.indices
    assert indices == sorted(indices) and len(set(indices)) == 100
