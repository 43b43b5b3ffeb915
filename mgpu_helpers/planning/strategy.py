"""Choosing a parallelism strategy: the map of steps, and memory budgets per GPU.

The appendix ``appendix_strategy_map.ipynb`` draws :data:`STEPS` as a flowchart
(:func:`draw_map`) and budgets the memory of a GPT-shaped model per GPU under each
strategy (:func:`memory_budget`). There is one cost model: a budget is chapter 14's
planner (:func:`~mgpu_helpers.planning.planner.stage_memory`) for the strategy's plan,
one pipeline stage, on the planner's :class:`~mgpu_helpers.planning.planner.Model` of
the workbook's GPT; its formulas rest on :mod:`~mgpu_helpers.planning.costs`' (chapter
10's parameters and activations, chapter 07's ZeRO stages). What the map needs of it:

* what a rank keeps of a block's activations under tensor parallelism with sequence
  parallelism, as PyTorch's ``parallelize_module`` runs it
  (:func:`tp_block_activation_bytes`: the appendix measures it on CPU ranks);
* the activation peak with checkpointing, which adds the block recomputed during the
  backward pass to what the forward pass keeps (:func:`activation_peak_bytes`);
* FSDP's working set: the weights it gathers and the gradient it reduces, a block at a
  time (:func:`memory_budget`).

Bytes per parameter follow a :class:`~mgpu_helpers.planning.costs.Precision`, one set of
layouts in :mod:`~mgpu_helpers.planning.costs`: by default the ZeRO paper's mixed
precision, 16-bit weights and gradients (2 + 2) and float32 master weights with Adam's
two moments (12); :data:`~mgpu_helpers.planning.costs.PYTORCH` is PyTorch's own way
(float32 state, bfloat16 copies for the matrix products). A ZeRO stage divides what it
shards by the data-parallel ranks.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass

from ..models.gpt import GPTConfig
from .costs import MIXED, Precision
from .planner import ACTIVATION_BYTES, GB, Model, Plan, stage_memory

# GB (10^9 bytes) and ACTIVATION_BYTES (bfloat16; attention's log-sum-exp stays float32)
# are the planner's.
#: An H100's memory as its data sheet states it (80 GB), counted as 80 x 10^9 bytes.
H100_BYTES = 80 * GB
#: The share of a GPU's memory a budget leaves free for what it does not count.
HEADROOM = 0.10


@dataclass(frozen=True)
class Step:
    """A box of the strategy map and the arrow that leads to it."""

    name: str       # the box's text
    chapter: str    # where the workbook teaches it
    source: str     # the box the arrow starts from
    trigger: str    # the arrow's label: when to take this step


START = "one GPU"
STEPS = (
    Step("data parallel (DDP)", "ch. 04-05", START,
         "the model trains on one GPU but too slowly: a copy on every GPU"),
    Step("shard the training state\n(ZeRO-1/2, FSDP2 = ZeRO-3)", "ch. 07, 10",
         "data parallel (DDP)",
         "the training state (weights, gradients, Adam) does not fit one GPU"),
    Step("activation checkpointing", "ch. 07, 10",
         "shard the training state\n(ZeRO-1/2, FSDP2 = ZeRO-3)",
         "the activations do not fit"),
    Step("tensor + sequence parallel\n(TP/SP, within a node)", "ch. 07",
         "activation checkpointing",
         "a layer's matrices are too big, or activations per GPU must shrink more: "
         "split each layer over a node's GPUs (NVLink)"),
    Step("pipeline parallel (PP)", "ch. 06",
         "tensor + sequence parallel\n(TP/SP, within a node)",
         "still does not fit, or more GPUs than the batch can use: stages across nodes"),
    Step("context parallel (CP)", "ch. 12", "activation checkpointing",
         "sequences too long: split each sequence"),
    Step("expert parallel (EP)", "ch. 13",
         "shard the training state\n(ZeRO-1/2, FSDP2 = ZeRO-3)",
         "a mixture of experts (MoE): experts on different GPUs"),
)


@dataclass(frozen=True)
class Strategy:
    """How a model is spread over the GPUs.

    Args:
        name: what the budget table calls it.
        zero: the ZeRO stage over the data-parallel ranks: 0 (DDP, nothing sharded),
            1 (Adam's state), 2 (and the gradients), 3 (and the weights: FSDP2).
        tp: GPUs that split each layer (tensor parallelism, with sequence parallelism
            for the layer norms); the data-parallel ranks are the GPUs over ``tp``.
        checkpointing: activation checkpointing of every block.
    """

    name: str
    zero: int = 0
    tp: int = 1
    checkpointing: bool = False

    def __post_init__(self):
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Strategy {self.name!r}: zero must be 0, 1, 2 or 3 (the ZeRO "
                             f"stage; 0 is DDP), got {self.zero!r}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"Strategy {self.name!r}: tp must be a whole number >= 1 "
                             f"(GPUs per tensor-parallel group), got {self.tp!r}")

    @property
    def cost_rank(self) -> tuple[int, bool, int]:
        """Order from cheapest to dearest, the map's order: more sharding first (its
        traffic overlaps the computation), then recomputation (a forward pass more that
        nothing hides), then tensor parallelism (blocking all-reduces in every block)."""
        return (self.tp, self.checkpointing, self.zero)


def _check_tp(config: GPTConfig, tp: int) -> None:
    if config.heads % tp or config.dim % tp:
        raise ValueError(f"tensor parallelism over {tp} GPUs needs heads ({config.heads}) and "
                         f"dim ({config.dim}) to be multiples of {tp}: each GPU takes whole "
                         "heads; pick tp among their common divisors")


def tp_block_activation_bytes(config: GPTConfig, batch: int, length: int, tp: int,
                              element_bytes: int = ACTIVATION_BYTES) -> int:
    """Bytes one block keeps for its backward pass on each of ``tp`` GPUs, under tensor
    parallelism with sequence parallelism as PyTorch runs it (``SequenceParallel`` on the
    layer norms, ``ColwiseParallel`` on q, k, v and up, ``RowwiseParallel`` on o and down):
    the planner's :meth:`~mgpu_helpers.planning.planner.Model.layer_activation_elements`.

    Each GPU keeps 1/tp of every tensor of chapter 10's count (its tokens of the block's
    input, residual and layer-norm statistics; its heads and MLP columns), except the two
    all-gathered layer-norm outputs that q, k, v and up read, kept whole: 2·b·s·h elements.
    ``tp = 1`` gives :func:`costs.activation_bytes_per_block`.
    """
    _check_tp(config, tp)
    model = Model.from_gpt(config)
    elements = model.layer_activation_elements(batch * length, tp, element_bytes)
    return math.ceil(elements * element_bytes)  # the largest rank's share, whole bytes


def memory_budget(config: GPTConfig, strategy: Strategy, gpus: int, batch: int,
                  length: int, precision: Precision = MIXED) -> dict[str, float]:
    """Bytes per GPU at the peak of a training step with AdamW, by kind: chapter 14's
    planner (:func:`~mgpu_helpers.planning.planner.stage_memory`) for ``strategy``'s plan,
    one pipeline stage.

    Args:
        config: the model's sizes (chapter 10's GPT).
        strategy: how it is spread.
        gpus: GPUs in all; ``gpus / strategy.tp`` data-parallel ranks shard the state.
        batch: sequences per data-parallel rank in a micro-batch.
        length: tokens per sequence.
        precision: bytes per parameter (:data:`MIXED` by default).

    Returns ``weights``, ``gradients``, ``Adam`` (its state, master weights included),
    ``working set`` (copies that exist only during the step: under ZeRO-3 with more than
    one shard, the gathered 16-bit embeddings and head, two gathered blocks, the running
    one and the next, and one block's gradient on its way to the reduce-scatter; without
    ZeRO-3, ``precision.copies``), ``activations`` (what the blocks keep, or with
    checkpointing their inputs and one block recomputed, and the loss's float32 logits
    and their gradient) and their ``total``. TP splits every matrix and the token
    embedding; the position table and the layer norms' weights stay whole.
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1 or gpus % strategy.tp:
        raise ValueError(f"gpus must be a whole multiple of the strategy's tp "
                         f"({strategy.tp}), got {gpus!r}: each TP group takes tp GPUs")
    _check_tp(config, strategy.tp)
    # data parallelism over the GPUs the TP groups leave, no pipeline
    plan = Plan(dp=gpus // strategy.tp, tp=strategy.tp, zero=strategy.zero,
                micro_batch=batch, checkpointing=strategy.checkpointing)
    memory = stage_memory(Model.from_gpt(config), plan, length, stage=0, precision=precision)
    return {"weights": memory["weights"], "gradients": memory["gradients"],
            "Adam": memory["optimizer"], "working set": memory["working set"],
            "activations": memory["activations"], "total": memory["total"]}


def activation_peak_bytes(config: GPTConfig, batch: int, length: int, tp: int = 1,
                          checkpointing: bool = False, precision: Precision = MIXED) -> float:
    """The most activation bytes a GPU holds in a step: :func:`memory_budget`'s
    ``activations`` (the loss's logits included). Without checkpointing every block keeps
    :func:`tp_block_activation_bytes`; with it each block keeps only its input (its 1/tp
    of the tokens under sequence parallelism), and the backward pass recomputes one
    block at a time, which holds that block's activations again."""
    strategy = Strategy("activations only", tp=tp, checkpointing=checkpointing)
    return memory_budget(config, strategy, tp, batch, length, precision)["activations"]


def fits(total: int, capacity: int = H100_BYTES, headroom: float = HEADROOM) -> bool:
    """Does a budget of ``total`` bytes fit, leaving ``headroom`` of ``capacity`` free?"""
    return total <= capacity * (1 - headroom)


def budget_table(config: GPTConfig, strategies, gpus: int, batch: int, length: int,
                 precision: Precision = MIXED, capacity: int = H100_BYTES,
                 headroom: float = HEADROOM) -> list[dict]:
    """One row per strategy, cheapest first (:attr:`Strategy.cost_rank`): the strategy,
    its :func:`memory_budget` and whether it :func:`fits`."""
    rows = []
    for strategy in sorted(strategies, key=lambda s: s.cost_rank):
        budget = memory_budget(config, strategy, gpus, batch, length, precision)
        rows.append({"strategy": strategy, "budget": budget,
                     "fits": fits(budget["total"], capacity, headroom)})
    return rows


def cheapest_fit(rows: list[dict]) -> Strategy | None:
    """The first strategy of a :func:`budget_table` that fits, or None."""
    return next((row["strategy"] for row in rows if row["fits"]), None)


def smallest_node_count(config: GPTConfig, strategy: Strategy, batch: int, length: int,
                        gpus_per_node: int = 8, most: int = 64, precision: Precision = MIXED,
                        capacity: int = H100_BYTES, headroom: float = HEADROOM) -> int | None:
    """The fewest nodes of ``gpus_per_node`` GPUs on which ``strategy`` fits (up to
    ``most``), or None."""
    for nodes in range(1, most + 1):
        budget = memory_budget(config, strategy, nodes * gpus_per_node, batch, length,
                               precision)
        if fits(budget["total"], capacity, headroom):
            return nodes
    return None


COLUMNS = ("weights", "gradients", "Adam", "working set", "activations", "total")


def format_table(rows: list[dict], capacity: int = H100_BYTES,
                 headroom: float = HEADROOM) -> str:
    """A budget table as text, in GB (10^9 bytes) per GPU, with a verdict per row."""
    limit = capacity * (1 - headroom)
    name_width = max(len(row["strategy"].name) for row in rows) + 2
    head = (f"{'strategy':<{name_width}}{'recompute':<10}"
            + "".join(f"{column:>12}" for column in COLUMNS) + "   verdict")
    lines = [head]
    for row in rows:
        strategy, budget = row["strategy"], row["budget"]
        margin = (limit - budget["total"]) / GB
        verdict = (f"fits, {margin:.1f} GB to spare" if row["fits"]
                   else f"over by {-margin:.1f} GB")
        lines.append(f"{strategy.name:<{name_width}}"
                     f"{'yes' if strategy.checkpointing else 'no':<10}"
                     + "".join(f"{budget[column] / GB:>12.1f}" for column in COLUMNS)
                     + f"   {verdict}")
    return "\n".join(lines)


# Where each box sits (x, y in axes fractions): the main chain down the left, the two
# branches on the right, level with the box they leave from.
_PLACES = {START: (0.17, 0.96), "data parallel (DDP)": (0.17, 0.79),
           "shard the training state\n(ZeRO-1/2, FSDP2 = ZeRO-3)": (0.17, 0.61),
           "activation checkpointing": (0.17, 0.43),
           "tensor + sequence parallel\n(TP/SP, within a node)": (0.17, 0.24),
           "pipeline parallel (PP)": (0.17, 0.05),
           "expert parallel (EP)": (0.84, 0.61), "context parallel (CP)": (0.84, 0.43)}


def draw_map(ax=None):
    """Draw :data:`STEPS` as a flowchart: a box per step with its chapter, an arrow per
    step labelled with its trigger. Returns the axes and the arrows (one per step, in
    :data:`STEPS` order)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 8))
    ax.set_axis_off()
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    boxes = {START: ax.text(*_PLACES[START], START, ha="center", va="center", fontsize=10,
                            bbox={"boxstyle": "round,pad=0.5", "fc": "#eeeeee"})}
    for step in STEPS:
        main_line = _PLACES[step.name][0] < 0.5
        boxes[step.name] = ax.text(
            *_PLACES[step.name], f"{step.name}\n[{step.chapter}]", ha="center", va="center",
            fontsize=10, bbox={"boxstyle": "round,pad=0.5",
                               "fc": "#dbe9f6" if main_line else "#fbe3cf"})
    arrows = []
    for step in STEPS:
        (x0, y0), (x1, y1) = _PLACES[step.source], _PLACES[step.name]
        arrow = FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=16,
                                patchA=boxes[step.source].get_bbox_patch(),
                                patchB=boxes[step.name].get_bbox_patch(),
                                color="#333333", label=step.trigger,
                                zorder=4)  # after the boxes, whose outlines clip it
        ax.add_patch(arrow)
        arrows.append(arrow)
        if x0 == x1:  # down the main chain: the label to the right of the arrow
            ax.text(x0 + 0.02, (y0 + y1) / 2, textwrap.fill(step.trigger, 60), fontsize=8.5,
                    va="center", ha="left", style="italic")
        else:  # a branch, level with its source: the label above the arrow
            ax.text((x0 + x1) / 2 + 0.08, y0 + 0.015, textwrap.fill(step.trigger, 34),
                    fontsize=8.5, va="bottom", ha="center", style="italic")
    return ax, arrows


def draw_budgets(rows: list[dict], title: str, capacity: int = H100_BYTES,
                 headroom: float = HEADROOM, ax=None):
    """Stacked horizontal bars of a :func:`budget_table`, in GB per GPU, with the GPU's
    capacity and the headroom line. Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.2))
    colours = ("#2a7ab0", "#e3863b", "#7aa95c", "#9aa5b1", "#c0392b")
    labels = [f"{row['strategy'].name}{' + AC' if row['strategy'].checkpointing else ''}"
              for row in rows]
    for index, row in enumerate(rows):
        left = 0.0
        for colour, column in zip(colours, COLUMNS[:-1], strict=True):
            value = row["budget"][column] / GB
            ax.barh(index, value, left=left, color=colour,
                    label=column if index == 0 else None)
            left += value
    ax.axvline(capacity / GB, color="black", lw=1)
    ax.axvline(capacity * (1 - headroom) / GB, color="black", lw=1, ls="--")
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GB per GPU (solid line: the GPU's memory; dashed: less the headroom)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    return ax
