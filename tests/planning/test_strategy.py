"""The strategy map's budgets against counts made by hand, and its flowchart as drawn."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402

from mgpu_helpers.models.gpt import GPTConfig  # noqa: E402
from mgpu_helpers.planning import costs, planner, strategy  # noqa: E402
from mgpu_helpers.planning.costs import PYTORCH  # noqa: E402
from mgpu_helpers.planning.strategy import Strategy  # noqa: E402

# A toy model small enough to count by hand: h = 8, 2 blocks, 2 heads, r = 4.
TOY = GPTConfig(vocab_size=10, context=4, dim=8, layers=2, heads=2)
# Its parameters: token embedding 10·8 = 80, positions 4·8 = 32, attention 2·4·8² = 512,
# MLP 2·2·4·8² = 1,024, layer norms 2·(2·2·8) + 2·8 = 80, head 80: 1,808 in all.
TOY_PARAMETERS = 1808
# Activations at b = 1, s = 4 in bfloat16: per block 4 tokens x (16·8 elements x 2 bytes +
# 4 statistics x 2 bytes + 2 heads x 4 bytes) = 4 x 272 = 1,088; the loss's float32 logits
# and their gradient 2 x 4 tokens x 10 x 4 bytes = 320 (the planner's count: it leaves out
# the final norm's output and the token ids, 208 bytes here, a few MB for a 7B model).
BLOCK, LOGITS = 1088, 320
TOY_ACTIVATIONS = 2 * BLOCK + LOGITS


def test_the_toy_counts_agree_with_chapter_10s_formulas():
    assert sum(costs.parameter_counts(TOY).values()) == TOY_PARAMETERS
    assert costs.activation_bytes_per_block(TOY, 1, 4, element_bytes=2) == BLOCK
    assert strategy.tp_block_activation_bytes(TOY, 1, 4, 1) == BLOCK


def test_a_budget_is_the_planners_memory_for_the_strategys_plan():
    budget = strategy.memory_budget(TOY, Strategy("FSDP x TP, AC", 3, tp=2, checkpointing=True),
                                    8, 1, 4)
    memory = planner.stage_memory(planner.Model.from_gpt(TOY),
                                  planner.Plan(dp=4, tp=2, zero=3, checkpointing=True), 4, 0)
    assert budget == {"weights": memory["weights"], "gradients": memory["gradients"],
                      "Adam": memory["optimizer"], "working set": memory["working set"],
                      "activations": memory["activations"], "total": memory["total"]}


def test_each_zero_stage_shards_what_the_paper_says():
    budget = {zero: strategy.memory_budget(TOY, Strategy("s", zero), 8, 1, 4)
              for zero in range(4)}
    whole, shard = TOY_PARAMETERS, 226  # 1,808 / 8 ranks
    assert budget[0] == {"weights": 2 * whole, "gradients": 2 * whole, "Adam": 12 * whole,
                         "working set": 0, "activations": TOY_ACTIVATIONS,
                         "total": 16 * whole + TOY_ACTIVATIONS}
    assert (budget[1]["weights"], budget[1]["gradients"], budget[1]["Adam"]) == (
        2 * whole, 2 * whole, 12 * shard)
    assert (budget[2]["weights"], budget[2]["gradients"], budget[2]["Adam"]) == (
        2 * whole, 2 * shard, 12 * shard)
    # ZeRO-3: everything sharded, plus FSDP's working set. A block has 256 + 512 + 32
    # = 800 parameters, the rest (embeddings, final norm, head) 1,808 - 1,600 = 208:
    # 208 x 2 gathered for the step, 800 x (2 + 2) for two gathered blocks, 800 x 2 for
    # one block's 16-bit gradient (the ZeRO paper's layout reduces in 16 bits).
    assert budget[3] == {"weights": 2 * shard, "gradients": 2 * shard, "Adam": 12 * shard,
                         "working set": 208 * 2 + 800 * 6, "activations": TOY_ACTIVATIONS,
                         "total": 16 * shard + 5216 + TOY_ACTIVATIONS}


def test_autocast_keeps_float32_state_and_bfloat16_copies_of_the_matrices():
    budget = strategy.memory_budget(TOY, Strategy("DDP"), 8, 1, 4, precision=PYTORCH)
    # 1,616 parameters in matrix products (attention 512, MLP 1,024, head 80), 2 bytes each
    assert (budget["weights"], budget["gradients"], budget["Adam"], budget["working set"]) == (
        4 * 1808, 4 * 1808, 8 * 1808, 2 * 1616)
    sharded = strategy.memory_budget(TOY, Strategy("FSDP", 3), 8, 1, 4, precision=PYTORCH)
    # FSDP frees its copies (no autocast copies): 208 x 2 gathered, 800 x 2 x 2 for two
    # blocks, 800 x 4 for a block's float32 gradient (reduce_dtype=float32)
    assert sharded["working set"] == 208 * 2 + 800 * 8 == 6816


def test_tensor_parallel_splits_the_state_and_all_but_two_gathered_activations():
    config = GPTConfig(vocab_size=32, context=16, dim=32, layers=1, heads=4)
    # b = 2, s = 16, float32, on 2 GPUs (as measured on 2 CPU ranks when written): the
    # block's input, residual and statistics, q, k, v, attention's output, log-sum-exp and
    # the MLP's pair split in two: 2048 + 2048 + 256 + 4 x 4096 / 2 + 256 + 16,384; the
    # two gathered norm outputs whole: 2 x 4096.
    assert strategy.tp_block_activation_bytes(config, 2, 16, 2, element_bytes=4) == (
        2048 + 2048 + 256 + 8192 + 256 + 16384 + 8192)
    assert strategy.tp_block_activation_bytes(config, 2, 16, 1, element_bytes=4) == \
        costs.activation_bytes_per_block(config, 2, 16, element_bytes=4) == 66560
    # the state on each of TP = 2: the matrices and the token embedding split, the
    # position table (32) and the layer-norm weights (80) whole: (1,808 - 112) / 2 + 112
    # = 960; ZeRO-3 over the 4 data-parallel ranks: 240
    budget = strategy.memory_budget(TOY, Strategy("FSDP x TP", 3, tp=2), 8, 1, 4)
    assert (budget["weights"], budget["Adam"]) == (240 * 2, 240 * 12)
    # gathered: the edges (5 + 4 embedding rows and 40 + 16 of head and final norm, x 8)
    # 128 x 2; a block 128 + 32 + 256 = 416 x (2 + 2 + 2)
    assert budget["working set"] == 128 * 2 + 416 * 6


def test_checkpointing_keeps_block_inputs_and_one_recomputed_block():
    # 2 blocks of 1,088 bytes; with checkpointing each keeps its input, 4 x 8 x 2 = 64
    # bytes, and the backward pass recomputes one block at a time: 1,088 more
    assert strategy.activation_peak_bytes(TOY, 1, 4, checkpointing=True) == (
        2 * 64 + BLOCK + LOGITS)
    assert strategy.activation_peak_bytes(TOY, 1, 4) == TOY_ACTIVATIONS
    with_ac = strategy.memory_budget(TOY, Strategy("DDP", checkpointing=True), 8, 1, 4)
    assert with_ac["activations"] == 2 * 64 + BLOCK + LOGITS


def test_the_table_runs_cheapest_first_and_names_the_first_that_fits():
    strategies = [Strategy("ZeRO-3", 3), Strategy("DDP"), Strategy("DDP + AC", 0, 1, True),
                  Strategy("ZeRO-1", 1)]
    # DDP holds 16 x 1,808 + 2,496 = 31,424 bytes, ZeRO-1 3,616 x 2 + 2,712 + 2,496 = 12,440
    rows = strategy.budget_table(TOY, strategies, 8, 1, 4, capacity=20000, headroom=0.1)
    assert [row["strategy"].name for row in rows] == ["DDP", "ZeRO-1", "ZeRO-3", "DDP + AC"]
    assert [row["fits"] for row in rows] == [False, True, True, False]
    assert strategy.cheapest_fit(rows).name == "ZeRO-1"
    assert strategy.cheapest_fit(rows[:1]) is None
    assert "over by" in strategy.format_table(rows).splitlines()[1]
    # 12,440 fits under 0.9 x 13,823 = 12,440.7 and not under 0.9 x 13,822
    assert strategy.fits(12440, 13823, 0.1) and not strategy.fits(12440, 13822, 0.1)


def test_smallest_node_count_finds_the_first_that_fits():
    ddp, zero3 = Strategy("DDP"), Strategy("ZeRO-3", 3)
    # DDP never shrinks; ZeRO-3 on n nodes of 2 GPUs: 16 x 1,808 / 2n + 5,216 + 2,496,
    # 14,944 bytes at n = 2 and 12,533 at n = 3
    assert strategy.smallest_node_count(TOY, ddp, 1, 4, gpus_per_node=2, most=4,
                                        capacity=20000) is None
    assert strategy.smallest_node_count(TOY, zero3, 1, 4, gpus_per_node=2, most=4,
                                        capacity=14000, headroom=0) == 3


def test_arguments_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="zero must be 0, 1, 2 or 3"):
        Strategy("ZeRO-4", 4)
    with pytest.raises(ValueError, match="multiples of 3"):
        strategy.tp_block_activation_bytes(TOY, 1, 4, 3)
    with pytest.raises(ValueError, match="whole multiple of the strategy's tp"):
        strategy.memory_budget(TOY, Strategy("TP", 0, tp=2), 3, 1, 4)


def test_the_map_draws_one_labelled_arrow_per_step():
    ax, arrows = strategy.draw_map()
    ax.figure.canvas.draw()
    assert len(arrows) == len(strategy.STEPS) == 7
    drawn = [patch for patch in ax.patches if isinstance(patch, FancyArrowPatch)]
    assert drawn == arrows
    texts = " ".join(text.get_text().replace("\n", " ") for text in ax.texts)
    for step, arrow in zip(strategy.STEPS, arrows, strict=True):
        assert arrow.get_label() == step.trigger
        assert step.trigger.split()[-1] in texts and step.name.split("\n")[0] in texts
        # each arrow runs between the boxes of its step, downwards or to the right
        (x0, y0), (x1, y1) = arrow.get_path().vertices[[0, -1]]
        assert (x1, y1) != (x0, y0)
    boxes = {step.source for step in strategy.STEPS} | {step.name for step in strategy.STEPS}
    assert boxes == set(strategy._PLACES)
    plt.close(ax.figure)


def test_the_budget_chart_draws_a_bar_per_row_and_part():
    rows = strategy.budget_table(TOY, [Strategy("DDP"), Strategy("ZeRO-3", 3)], 8, 1, 4)
    ax = strategy.draw_budgets(rows, "toy")
    ax.figure.canvas.draw()
    assert len(ax.patches) == 2 * 5
    plt.close(ax.figure)
