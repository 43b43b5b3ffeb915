"""Training Part III's GPT on the recall task: the loss, the batches, the reference run.

* :func:`lm_loss` is the mean cross-entropy over the scored positions (the answers);
* :func:`step_batch` is the global batch of one optimizer step, a function of the step
  alone (so a resumed run sees what the uninterrupted one saw), and :func:`rank_rows`
  this rank's equal share of it;
* :func:`train_reference` trains one process on whole batches: every parallel run of
  Part III is checked against it, step by step;
* :func:`next_token_loss` lets ``train.evaluate`` (and ``train_one_epoch``) score a
  language model over its answers, and :func:`exact_match` counts the sequences whose
  every answer is right.

Every sequence of the task has the same number of answers, so the mean over a global
batch equals the mean of its ranks' means: data-parallel ranks that average their
gradients get the whole batch's gradient exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..data.recall import IGNORE, RecallTask
from ..models.gpt import GPT, GPTConfig
from .train import BatchLoss

#: Seeds of the training batches (``seed * STEP_SEEDS + step``) and of the held-out set.
STEP_SEEDS = 1_000_003
HELD_OUT_SEED = 999_999


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of next-token ``logits`` (batch x length x vocab) over the
    targets that are scored (not :data:`~mgpu_helpers.data.recall.IGNORE`)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)


def step_batch(task: RecallTask, step: int, global_batch: int,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(inputs, targets)`` of optimizer step ``step``: the same on every rank and
    machine, and independent of what ran before."""
    return task.sequences(global_batch, seed * STEP_SEEDS + step)


def rank_rows(tensors, rank: int, world: int):
    """This rank's equal, contiguous share of each tensor's rows."""
    shares = []
    for tensor in tensors:
        if len(tensor) % world:
            raise ValueError(f"a global batch of {len(tensor)} sequences does not split "
                             f"evenly over {world} ranks: use a multiple of {world}")
        per_rank = len(tensor) // world
        shares.append(tensor[rank * per_rank:(rank + 1) * per_rank])
    return tuple(shares)


def model_for(task: RecallTask, seed: int = 0, **sizes) -> GPT:
    """A :class:`GPT` for ``task`` (its vocabulary and length), initialised from
    ``seed``: every rank that calls this with the same seed builds the same weights."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=task.vocab_size, context=task.length, **sizes))


def train_reference(task: RecallTask, steps: int, global_batch: int, lr: float = 2e-3,
                    seed: int = 0, schedule: Callable[[int], float] | None = None,
                    **sizes) -> tuple[GPT, list[float]]:
    """One process, whole batches, AdamW: the run every parallel one must reproduce.
    ``schedule(step)`` scales the learning rate (constant without it); ``sizes`` are
    :class:`~mgpu_helpers.models.gpt.GPTConfig`'s. Returns the trained model and each
    step's loss."""
    model = model_for(task, seed, **sizes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule) if schedule else None
    losses = []
    for step in range(steps):
        inputs, targets = step_batch(task, step, global_batch, seed)
        loss = lm_loss(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return model, losses


def next_token_loss(model: nn.Module, batch, device: torch.device) -> BatchLoss:
    """``train.evaluate``'s loss function for a language model: the loss over the
    answers, how many answers, how many predicted right."""
    inputs, targets = (tensor.to(device, non_blocking=True) for tensor in batch)
    logits = model(inputs)
    scored = targets != IGNORE
    correct = (logits.detach().argmax(-1)[scored] == targets[scored]).sum()
    return BatchLoss(lm_loss(logits, targets), scored.sum(), correct, unit="answers")


@torch.no_grad()
def exact_match(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """The share of sequences whose every answer the model gets right (greedy), over
    every rank's sequences where a process group runs (each rank passes its own)."""
    model.eval()
    predicted = model(inputs).argmax(-1)
    model.train()
    scored = targets != IGNORE
    right = ((predicted == targets) | ~scored).all(1)
    totals = torch.stack([right.sum(), torch.tensor(len(right), device=right.device)]).double()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)  # on the model's device: NCCL on GPUs, gloo on CPUs
    return (totals[0] / totals[1]).item()
