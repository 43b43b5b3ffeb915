"""Chapter 07's activation checkpointing (mgpu_helpers.labs.recompute)."""

import pytest
import torch

from mgpu_helpers.labs import recompute


def test_checkpointing_keeps_less_recomputes_and_gives_the_same_gradients():
    steps = {mode: recompute.checkpointed_step(mode, batch_size=8) for mode in recompute.MODES}
    for step in steps.values():
        assert all(torch.equal(a, b) for a, b in zip(step["gradients"],
                                                     steps["none"]["gradients"], strict=True))
    assert (steps["full"]["kept_bytes"] < steps["selective"]["kept_bytes"]
            < steps["none"]["kept_bytes"])
    assert [steps[m]["recomputed_convolutions"] for m in recompute.MODES] == [0, 2, 0]
    # what each mode keeps, from the shapes: batch 8, 64 channels of 32 x 32
    relu_output, pool_indices = 8 * 64 * 32 * 32 * 4, 8 * 64 * 16 * 16 * 8
    kept = {mode: step["kept_bytes"] for mode, step in steps.items()}
    assert kept["none"] - kept["full"] == 2 * relu_output + pool_indices
    assert kept["none"] - kept["selective"] == pool_indices  # convolutions' outputs kept


def test_activation_bytes_grow_with_the_batch_and_bad_modes_are_refused():
    small = recompute.checkpointed_step("none", batch_size=4)["kept_bytes"]
    large = recompute.checkpointed_step("none", batch_size=8)["kept_bytes"]
    assert large == pytest.approx(2 * small, rel=0.05)
    with pytest.raises(ValueError, match="mode must be one of"):
        recompute.checkpointed_step("half")
