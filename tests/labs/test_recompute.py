"""Chapter 07's activation checkpointing (mgpu_helpers.labs.recompute), with the three
ways of running the region that the chapter writes."""

import functools

import pytest
import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from mgpu_helpers.labs import recompute


def _save_convolutions(ctx, op, *args, **kwargs):
    if op == torch.ops.aten.convolution.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _plain(region, x):
    return region(x)


def _full(region, x):
    return checkpoint(region, x, use_reentrant=False)


def _selective(region, x):
    contexts = functools.partial(create_selective_checkpoint_contexts, _save_convolutions)
    return checkpoint(region, x, use_reentrant=False, context_fn=contexts,
                      respect_saved_tensors_hooks=True)


WAYS = {"none": _plain, "full": _full, "selective": _selective}


def test_checkpointing_keeps_less_recomputes_and_gives_the_same_gradients():
    steps = {mode: recompute.checkpointed_step(way, batch_size=8) for mode, way in WAYS.items()}
    for step in steps.values():
        assert all(torch.equal(a, b) for a, b in zip(step["gradients"],
                                                     steps["none"]["gradients"], strict=True))
    assert (steps["full"]["kept_bytes"] < steps["selective"]["kept_bytes"]
            < steps["none"]["kept_bytes"])
    assert [steps[m]["recomputed_convolutions"] for m in WAYS] == [0, 2, 0]
    # what each mode keeps, from the shapes: batch 8, 64 channels of 32 x 32
    relu_output, pool_indices = 8 * 64 * 32 * 32 * 4, 8 * 64 * 16 * 16 * 8
    kept = {mode: step["kept_bytes"] for mode, step in steps.items()}
    assert kept["none"] - kept["full"] == 2 * relu_output + pool_indices
    assert kept["none"] - kept["selective"] == pool_indices  # convolutions' outputs kept


def test_a_policy_that_saves_nothing_recomputes_the_convolutions_too():
    # the counter sees the policy's choice: recomputing everything is full checkpointing
    def recompute_all(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    def nothing_saved(region, x):
        contexts = functools.partial(create_selective_checkpoint_contexts, recompute_all)
        return checkpoint(region, x, use_reentrant=False, context_fn=contexts,
                          respect_saved_tensors_hooks=True)

    step = recompute.checkpointed_step(nothing_saved, batch_size=4)
    assert step["recomputed_convolutions"] == 2
    assert step["kept_bytes"] == recompute.checkpointed_step(_full, batch_size=4)["kept_bytes"]


def test_activation_bytes_grow_with_the_batch_and_a_non_function_is_refused():
    small = recompute.checkpointed_step(_plain, batch_size=4)["kept_bytes"]
    large = recompute.checkpointed_step(_plain, batch_size=8)["kept_bytes"]
    assert large == pytest.approx(2 * small, rel=0.05)
    with pytest.raises(TypeError, match="run_region must be a function"):
        recompute.checkpointed_step("selective")
