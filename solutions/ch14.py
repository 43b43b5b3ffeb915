"""Chapter 14: reference solutions and plausible mistakes."""

import math
from fractions import Fraction

import numpy as np

from mgpu_helpers.parallel import pipeline
from mgpu_helpers.parallel.pipeline import theoretical_bubble
from mgpu_helpers.planning import costs, planner
from mgpu_helpers.planning.costs import ring_bytes_sent

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
    return pipeline.theoretical_bubble(pp, micro_batches, virtual_stages)


# ------------------------------------------------------------------ 14.4


def fewest_gpus(parameters, layers, activations_gb_per_layer, tp, memory_gb):
    activations = layers * activations_gb_per_layer
    for dp in (2**k for k in range(11)):  # 1, 2, 4 ... 1024
        state = parameters * (2 + 2 + 12) / (tp * dp) / 1e9  # ZeRO-3 over dp, split by tp
        if state + activations <= 0.9 * memory_gb:
            return tp * dp
    return None


def fewest_gpus_closed_form(parameters, layers, activations_gb_per_layer, tp, memory_gb):
    # the exact dp needed, rounded up to a power of two: another correct way
    room = 0.9 * memory_gb - layers * activations_gb_per_layer
    if room <= 0:
        return None
    needed = parameters * 16 / tp / 1e9 / room  # the dp at which the state just fits
    dp = 2 ** max(0, math.ceil(math.log2(needed)))
    return np.int64(tp * dp) if dp <= 1024 else None


def fewest_gpus_without_headroom(parameters, layers, activations_gb_per_layer, tp,
                                 memory_gb):
    return fewest_gpus(parameters, layers, activations_gb_per_layer, tp, memory_gb / 0.9)


def fewest_gpus_without_activations(parameters, layers, activations_gb_per_layer, tp,
                                    memory_gb):
    return fewest_gpus(parameters, layers, 0.0, tp, memory_gb)


def fewest_gpus_state_over_dp_only(parameters, layers, activations_gb_per_layer, tp,
                                   memory_gb):
    for dp in (2**k for k in range(11)):
        if parameters * 16 / dp / 1e9 + layers * activations_gb_per_layer <= 0.9 * memory_gb:
            return tp * dp
    return None


def fewest_gpus_returns_dp(parameters, layers, activations_gb_per_layer, tp, memory_gb):
    gpus = fewest_gpus(parameters, layers, activations_gb_per_layer, tp, memory_gb)
    return None if gpus is None else gpus // tp


def fewest_gpus_exact_ceiling(parameters, layers, activations_gb_per_layer, tp, memory_gb):
    # dp = the exact ceiling, not rounded up to a power of two
    room = 0.9 * memory_gb - layers * activations_gb_per_layer
    if room <= 0:
        return None
    dp = math.ceil(parameters * 16 / tp / 1e9 / room)
    return tp * dp if dp <= 1024 else None


def fewest_gpus_zero_when_impossible(parameters, layers, activations_gb_per_layer, tp,
                                     memory_gb):
    return fewest_gpus(parameters, layers, activations_gb_per_layer, tp, memory_gb) or 0


def fewest_gpus_last_tried_when_impossible(parameters, layers, activations_gb_per_layer,
                                           tp, memory_gb):
    gpus = fewest_gpus(parameters, layers, activations_gb_per_layer, tp, memory_gb)
    return tp * 1024 if gpus is None else gpus


def fewest_gpus_state_in_bytes(parameters, layers, activations_gb_per_layer, tp, memory_gb):
    for dp in (2**k for k in range(11)):
        if parameters * 16 / (tp * dp) + layers * activations_gb_per_layer <= 0.9 * memory_gb:
            return tp * dp
    return None


def fewest_gpus_strictly_below(parameters, layers, activations_gb_per_layer, tp, memory_gb):
    for dp in (2**k for k in range(11)):
        state = parameters * 16 / (tp * dp) / 1e9
        if state + layers * activations_gb_per_layer < 0.9 * memory_gb:
            return tp * dp
    return None


def fewest_gpus_up_to_512(parameters, layers, activations_gb_per_layer, tp, memory_gb):
    for dp in (2**k for k in range(10)):  # range(10): 1 ... 512
        state = parameters * 16 / (tp * dp) / 1e9
        if state + layers * activations_gb_per_layer <= 0.9 * memory_gb:
            return tp * dp
    return None


def fewest_gpus_fitted_to_one_case(parameters, layers, activations_gb_per_layer, tp,
                                   memory_gb):
    return 64  # what one earlier check expected for its "several doublings" case


def fewest_gpus_through_costs(parameters, layers, activations_gb_per_layer, tp, memory_gb):
    for dp in (2**k for k in range(11)):
        state = costs.training_state_bytes(parameters // tp, dp, 2, 2, 12) / 1e9
        if state + layers * activations_gb_per_layer <= 0.9 * memory_gb:
            return tp * dp
    return None


def fewest_gpus_through_the_planner(parameters, layers, activations_gb_per_layer, tp,
                                    memory_gb):
    model = planner.Model("asked", layers=layers, dim=1024, heads=8, ffn=4096, vocab=8)
    for dp in (2**k for k in range(11)):
        memory = planner.stage_memory(model, planner.Plan(dp=dp, tp=tp, zero=3), 4096, 0)
        if memory["total"] <= 0.9 * memory_gb * 1e9:
            return tp * dp
    return None


REFERENCE = {"14.1": training_state_gb, "14.2": tp_bytes_per_step, "14.3": bubble_share,
             "14.4": fewest_gpus}
ALTERNATIVES = {"14.1": [training_state_gb_exact], "14.2": [tp_bytes_as_float],
                "14.3": [bubble_share_as_fraction], "14.4": [fewest_gpus_closed_form]}
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
    "14.4": [(fewest_gpus_without_headroom, "fail", "10% headroom"),
             (fewest_gpus_without_activations, "fail", "you left them out"),
             (fewest_gpus_state_over_dp_only, "fail", "not by dp alone"),
             (fewest_gpus_returns_dp, "fail", "you returned dp"),
             (fewest_gpus_exact_ceiling, "fail", "is not one"),
             (fewest_gpus_zero_when_impossible, "fail", "return None"),
             (fewest_gpus_last_tried_when_impossible, "fail", "return None"),
             (fewest_gpus_state_in_bytes, "fail", "your state is in bytes"),
             (fewest_gpus_strictly_below, "fail", "you used <"),
             (fewest_gpus_up_to_512, "fail", "you stopped at 512"),
             (fewest_gpus_fitted_to_one_case, "fail", "expected"),
             (fewest_gpus_through_costs, "error", REFUSED),
             (fewest_gpus_through_the_planner, "error", REFUSED)],
}
