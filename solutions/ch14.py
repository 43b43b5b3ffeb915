"""Chapter 14: reference solutions and plausible mistakes."""

from fractions import Fraction

import numpy as np

from mgpu_helpers import costs, pipeline_parallel, planner
from mgpu_helpers.costs import ring_bytes_sent
from mgpu_helpers.parallel.pipeline import theoretical_bubble

# ------------------------------------------------------------------ 14.1


def training_state_gb(parameters, dp, tp, pp, zero):
    per_gpu = parameters / (tp * pp)
    weights = 2 / (dp if zero >= 3 else 1)
    gradients = 2 / (dp if zero >= 2 else 1)
    optimizer = 12 / (dp if zero >= 1 else 1)
    return per_gpu * (weights + gradients + optimizer) / 1e9


def training_state_gb_exact(parameters, dp, tp, pp, zero):
    # fractions, then a NumPy float: another correct way
    shards = [dp if zero >= stage else 1 for stage in (3, 2, 1)]
    held = sum(Fraction(b, s) for b, s in zip((2, 2, 12), shards, strict=True))
    return np.float64(Fraction(parameters, tp * pp) * held / 10**9)


def state_gradients_whole_at_zero2(parameters, dp, tp, pp, zero):
    # the gradients taken to be sharded from ZeRO-3 on, with the weights
    per_gpu = parameters / (tp * pp)
    return per_gpu * (2 / (dp if zero >= 3 else 1) + 2 / (dp if zero >= 3 else 1)
                      + 12 / (dp if zero >= 1 else 1)) / 1e9


def state_in_bytes(parameters, dp, tp, pp, zero):
    return training_state_gb(parameters, dp, tp, pp, zero) * 1e9


def state_split_by_tp_only(parameters, dp, tp, pp, zero):
    return training_state_gb(parameters, dp, tp, 1, zero)


def state_in_float32(parameters, dp, tp, pp, zero):
    per_gpu = parameters / (tp * pp)
    return per_gpu * (4 / (dp if zero >= 3 else 1) + 4 / (dp if zero >= 2 else 1)
                      + 8 / (dp if zero >= 1 else 1)) / 1e9


def state_every_stage_shards_everything(parameters, dp, tp, pp, zero):
    return parameters / (tp * pp) * 16 / dp / 1e9


def state_fitted_to_one_case(parameters, dp, tp, pp, zero):
    return 63.45  # what one earlier check expected for its ZeRO-0 case


def state_through_costs(parameters, dp, tp, pp, zero):
    # costs.training_state_bytes is ZeRO-3's formula: refused, however close
    return costs.training_state_bytes(parameters // (tp * pp), dp, 2, 2, 12) / 1e9


# ------------------------------------------------------------------ 14.2


def tp_bytes_per_step(tokens, dim, layers, tp, micro_batches, checkpointing):
    slab = tokens * dim * 2  # bfloat16
    each = (tp - 1) * slab // tp  # an all-gather of the 1/tp share, a reduce-scatter
    passes = 3 if checkpointing else 2
    return passes * layers * micro_batches * 4 * each


def tp_bytes_as_float(tokens, dim, layers, tp, micro_batches, checkpointing):
    share = tokens * dim * 2.0 / tp
    per_layer = 2 * (tp - 1) * share + 2 * (tp - 1) / tp * (tp * share)
    return (2 + checkpointing) * layers * micro_batches * per_layer


def tp_bytes_as_all_reduces(tokens, dim, layers, tp, micro_batches, checkpointing):
    slab = tokens * dim * 2
    passes = 3 if checkpointing else 2
    return passes * layers * micro_batches * 4 * 2 * (tp - 1) / tp * slab


def tp_bytes_without_the_recomputed_forward(tokens, dim, layers, tp, micro_batches,
                                            checkpointing):
    return tp_bytes_per_step(tokens, dim, layers, tp, micro_batches, False)


def tp_bytes_gathering_whole_slabs(tokens, dim, layers, tp, micro_batches, checkpointing):
    slab = tokens * dim * 2
    passes = 3 if checkpointing else 2
    return passes * layers * micro_batches * 2 * ((tp - 1) * slab + (tp - 1) / tp * slab)


def tp_bytes_forward_only(tokens, dim, layers, tp, micro_batches, checkpointing):
    return layers * micro_batches * 4 * (tp - 1) / tp * tokens * dim * 2


def tp_bytes_through_ring_bytes_sent(tokens, dim, layers, tp, micro_batches, checkpointing):
    slab = tokens * dim * 2
    each = (ring_bytes_sent("all_gather", slab / tp, tp)
            + ring_bytes_sent("reduce_scatter", slab, tp))
    return (2 + checkpointing) * layers * micro_batches * 2 * each


def tp_bytes_through_the_planner(tokens, dim, layers, tp, micro_batches, checkpointing):
    model = planner.Model("asked", layers=layers, dim=dim, heads=tp, ffn=4 * dim, vocab=8)
    plan = planner.Plan(tp=tp, micro_batches=micro_batches, checkpointing=checkpointing)
    prediction = planner.predict(model, planner.H100_NODES, plan, tokens)
    return prediction.communication["tp"].bytes_sent


# ------------------------------------------------------------------ 14.3


def bubble_share(pp, micro_batches, virtual_stages):
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)


def bubble_share_as_fraction(pp, micro_batches, virtual_stages):
    return Fraction(pp - 1, virtual_stages * micro_batches + pp - 1)


def bubble_over_the_micro_batches(pp, micro_batches, virtual_stages):
    return (pp - 1) / micro_batches


def bubble_over_the_compute(pp, micro_batches, virtual_stages):
    return (pp - 1) / (virtual_stages * micro_batches)


def bubble_without_the_virtual_stages(pp, micro_batches, virtual_stages):
    return (pp - 1) / (micro_batches + pp - 1)


def bubble_in_percent(pp, micro_batches, virtual_stages):
    return 100 * bubble_share(pp, micro_batches, virtual_stages)


def bubble_fitted_to_one_case(pp, micro_batches, virtual_stages):
    return 0.2 if pp > 1 else 0.0


def bubble_through_an_alias(pp, micro_batches, virtual_stages):
    return theoretical_bubble(pp, micro_batches, virtual_stages)


def bubble_through_the_package(pp, micro_batches, virtual_stages):
    return pipeline_parallel.theoretical_bubble(pp, micro_batches, virtual_stages)


REFERENCE = {"14.1": training_state_gb, "14.2": tp_bytes_per_step, "14.3": bubble_share}
ALTERNATIVES = {"14.1": [training_state_gb_exact], "14.2": [tp_bytes_as_float],
                "14.3": [bubble_share_as_fraction]}
REFUSED = "the planner is what you are checking"
MISTAKES = {
    "14.1": [(state_gradients_whole_at_zero2, "fail", "ZeRO-2 shards the gradients"),
             (state_in_bytes, "fail", "your result is in bytes"),
             (state_split_by_tp_only, "fail", "by tp = 8 only"),
             (state_in_float32, "fail", "2 + 2 + 12 bytes per parameter"),
             (state_every_stage_shards_everything, "fail", "keeps the weights whole"),
             (state_fitted_to_one_case, "fail", "expected"),
             (state_through_costs, "error", REFUSED)],
    "14.2": [(tp_bytes_as_all_reduces, "fail", "priced as an all-reduce"),
             (tp_bytes_without_the_recomputed_forward, "fail", "3 passes, not 2"),
             (tp_bytes_gathering_whole_slabs, "fail", "the rank's 1/tp share"),
             (tp_bytes_forward_only, "fail", "the forward pass only"),
             (tp_bytes_through_ring_bytes_sent, "fail", "costs.ring_bytes_sent"),
             (tp_bytes_through_the_planner, "error", REFUSED)],
    "14.3": [(bubble_over_the_micro_batches, "fail", "over the compute time"),
             (bubble_over_the_compute, "fail", "over the compute time"),
             (bubble_without_the_virtual_stages, "fail", "virtual stages are missing"),
             (bubble_in_percent, "fail", "not a percentage"),
             (bubble_fitted_to_one_case, "fail", "expected"),
             (bubble_through_an_alias, "error", "timeline.theoretical_bubble does not run"),
             (bubble_through_the_package, "error", REFUSED)],
}
