"""Cutting work into pieces: a model into stage modules, chosen from what each layer
costs, and a batch into micro-batches."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

# ------------------------------------------------------------------ the model


def split_sequential(model: nn.Sequential, cuts: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``model`` before each index in ``cuts``: ``cuts=[3]`` gives ``model[:3]`` and
    ``model[3:]``. The pieces share the model's layers (no copies)."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"split_sequential needs an nn.Sequential, got {type(model).__name__}")
    cuts = list(cuts)
    for cut in cuts:
        if not isinstance(cut, int) or not 1 <= cut <= len(model) - 1:
            raise ValueError(f"split point {cut!r} is out of range: a model of {len(model)} "
                             f"layers can be cut before layer 1 to {len(model) - 1}")
    if cuts != sorted(set(cuts)):
        raise ValueError(f"split points must be increasing and distinct, got {cuts}")
    bounds = [0, *cuts, len(model)]
    return [model[start:end] for start, end in zip(bounds, bounds[1:], strict=False)]


# ------------------------------------------------------------------ the batch


def micro_batch_size(batch_size: int, micro_batches: int) -> int:
    """The size of each micro-batch; the count must divide the batch."""
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro-batch count must be a whole number >= 1, got {micro_batches!r}")
    if batch_size % micro_batches:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise ValueError(f"{micro_batches} micro-batches do not divide the batch of "
                         f"{batch_size} samples: use one of {divisors}")
    return batch_size // micro_batches


def split_batch(inputs: torch.Tensor | None, targets: torch.Tensor | None,
                micro_batches: int, rank: int, ranks: int) -> tuple:
    """The micro-batches of a step's batch that ``rank`` of ``ranks`` uses: rank 0 runs
    the model's first piece and needs ``inputs``, the last rank runs its last piece and
    needs ``targets`` (one rank alone needs both). Returns ``(input micro-batches,
    target micro-batches)``, each None where this rank does not use it."""
    input_chunks = target_chunks = None
    if rank == 0:
        if inputs is None:
            raise ValueError("rank 0 runs the first piece: pass inputs")
        input_chunks = inputs.split(micro_batch_size(len(inputs), micro_batches))
    if rank == ranks - 1:
        if targets is None:
            raise ValueError(f"rank {rank} runs the last piece: pass targets")
        target_chunks = targets.split(micro_batch_size(len(targets), micro_batches))
    return input_chunks, target_chunks


# ------------------------------------------------------- costs and split points


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs, for one batch: the numbers that decide a split point."""

    index: int
    name: str
    parameters: int
    flops: int             # forward FLOPs (multiply and add counted separately)
    activation_bytes: int  # the layer's output: what a cut after it must send
    seconds: float         # measured forward + backward time (median)


def layer_costs(model: nn.Sequential, example: torch.Tensor, repeats: int = 5) -> list[LayerCost]:
    """Measure every layer of ``model`` on ``example`` (one batch)."""
    costs, x = [], example
    for index, layer in enumerate(model):
        x = x.detach().requires_grad_(x.is_floating_point())
        with FlopCounterMode(display=False) as counter:
            y = layer(x)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            out = layer(x)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            times.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        costs.append(LayerCost(index, type(layer).__name__,
                               sum(p.numel() for p in layer.parameters()),
                               int(counter.get_total_flops()),
                               y.numel() * y.element_size(), sorted(times[1:])[repeats // 2]))
        x = y
    return costs


def balanced_cuts(weights: Sequence[float], stages: int) -> list[int]:
    """Split points that cut per-layer ``weights`` (seconds, FLOPs...) into ``stages``
    stage modules with the heaviest as light as it can be (it sets the pipeline's pace).
    Exact, by dynamic programming."""
    n = len(weights)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the heaviest stage module when the first i layers form k of them
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                heaviest = max(best[k - 1][j], prefix[i] - prefix[j])
                if heaviest <= best[k][i]:  # ties: the later cut (a layer keeps its ReLU)
                    best[k][i], choice[k][i] = heaviest, j
    cuts, i = [], n
    for k in range(stages, 1, -1):
        i = choice[k][i]
        cuts.append(i)
    return sorted(cuts)
