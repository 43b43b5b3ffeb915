"""Training and evaluation loops with global metrics, and checkpoints that resume exactly.

The original tutorial's ``train``/``test`` loops report each rank's own loss and accuracy, so two
ranks print two different "accuracies", and evaluating through ``DistributedSampler``
counts its padded duplicates. Here every metric is summed across ranks before it is
reported (every rank returns the same global numbers), and :func:`evaluate` shards the
dataset without padding so each sample counts exactly once.

The loops do not know what a batch holds: a loss function turns one batch into a
:class:`BatchLoss` (the mean loss, over how many items, how many predicted right).
:func:`classification_loss`, the default, is the image classifier's; a language model
passes its own, averaged over tokens, and keeps accumulation, ``no_sync``, mixed
precision and the global metrics of the same loop.

Checkpoints are written by rank 0 only, atomically (temporary file, flush, fsync,
``os.replace``), hold the unwrapped model (no ``module.`` prefix), the optimizer, the
epoch and the random number generator states, and load with ``weights_only=True``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset

from ..runtime.progress import progress_bar
from ..runtime.ranks import device as rank_device
from ..runtime.ranks import is_main, rank, world_size

CHECKPOINT_FORMAT = 1


@dataclass(frozen=True)
class Metrics:
    """Mean loss and accuracy over every item (sample, token) seen by every rank."""

    loss: float
    accuracy: float
    items: int
    unit: str = "samples"

    @property
    def samples(self) -> int:
        """The item count under the name image classification gives it."""
        return self.items

    def __str__(self) -> str:
        return (f"loss {self.loss:.4f}, accuracy {self.accuracy:.2%} over {self.items} "
                f"{self.unit}")


@dataclass(frozen=True)
class BatchLoss:
    """What one batch cost: the loop backpropagates ``loss`` and adds the rest up.

    Attributes:
        loss: the mean over the batch's items, a scalar tensor; backward runs from it.
        items: how many items that mean is over (an int, or an integer tensor on the
            device, which spares a host sync when it is counted there, e.g. the tokens
            a padding mask keeps). The epoch's loss weighs each batch by it.
        correct: how many of the items were predicted right (an integer tensor or int).
        unit: what an item is, for printing: "samples", "tokens".
    """

    loss: torch.Tensor
    items: int | torch.Tensor
    correct: int | torch.Tensor
    unit: str = "samples"


#: ``loss_fn(model, batch, device)``: moves ``batch`` (what the loader yields) to
#: ``device``, runs ``model`` and returns the :class:`BatchLoss`.
LossFn = Callable[[nn.Module, Any, torch.device], BatchLoss]


def classification_loss(model: nn.Module, batch, device: torch.device,
                        channels_last: bool = False) -> BatchLoss:
    """Cross-entropy of an image classifier on an ``(images, labels)`` batch.

    Args:
        model: maps images to class scores.
        batch: ``(images, labels)``; one sample per label.
        device: where the batch goes.
        channels_last: move the images to the ``channels_last`` memory layout (the model
            should be converted too: ``model.to(memory_format=torch.channels_last)``).
            Pass it with ``functools.partial(classification_loss, channels_last=True)``.
    """
    images, labels = batch
    images = images.to(device, non_blocking=True,
                       memory_format=torch.channels_last if channels_last
                       else torch.preserve_format)
    labels = labels.to(device, non_blocking=True)
    logits = model(images)
    return BatchLoss(F.cross_entropy(logits, labels), len(labels),
                     (logits.detach().argmax(1) == labels).sum())


class _Totals:
    """A loop's sums over its batches, and their means over every rank's items.

    The sums stay on the device: reading them on the host every batch (``.item()``,
    ``.cpu()``) would make the CPU wait for the GPU at every batch.
    """

    def __init__(self, device: torch.device):
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.items = torch.zeros((), dtype=torch.int64, device=device)
        self.unit = "samples"

    def add(self, cost: BatchLoss) -> None:
        self.loss += cost.loss.detach().double() * cost.items
        self.correct += cost.correct
        self.items += cost.items
        self.unit = cost.unit

    def global_metrics(self) -> Metrics:
        """The means over all ranks (a collective: every rank calls it)."""
        totals = torch.stack([self.loss, self.correct.double(), self.items.double()])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(totals)  # on the device the sums live on: NCCL on GPUs
        loss_sum, correct, count = totals.tolist()
        if count == 0:
            raise ValueError("no samples were seen: is the loader or the dataset empty?")
        return Metrics(loss_sum / count, correct / count, int(count), self.unit)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel / DataParallel wrapper (or the model)."""
    return model.module if isinstance(model, (nn.DataParallel,
                                              nn.parallel.DistributedDataParallel)) else model


def train_one_epoch(model: nn.Module, loader, optimizer: torch.optim.Optimizer,
                    device: torch.device | str | None = None, epoch: int = 0,
                    progress: bool = True, accumulate: int = 1,
                    amp_dtype: torch.dtype | None = None,
                    scaler: torch.amp.GradScaler | None = None,
                    scheduler=None, loss_fn: LossFn = classification_loss,
                    skip: int = 0, stop: Callable[[int], bool] | None = None) -> Metrics:
    """One pass over ``loader``: forward and loss (``loss_fn``), backward, step.

    Args:
        model: the (possibly DDP-wrapped) model, already on ``device``.
        loader: yields the batches ``loss_fn`` takes. With a ``DistributedSampler``, call
            ``sampler.set_epoch(epoch)`` before this, or every epoch repeats one order.
        optimizer: steps once per ``accumulate`` batches.
        device: where batches go; default this rank's device.
        epoch: shown in the progress bar.
        progress: show a progress bar (rank 0 only).
        accumulate: batches whose gradients are summed before each optimizer step. Under
            DDP all but the last batch of a group run inside ``model.no_sync()``, so the
            gradients are averaged across ranks once per step, not once per batch. Each
            loss is divided by the group's size: the step sees the mean over the group
            (of the batches' means: where batches hold different numbers of items, as
            padded token batches do, not quite the mean over the group's items).
            A last group shorter than ``accumulate`` is divided by its own size.
        amp_dtype: run ``loss_fn`` (forward and loss) under ``torch.autocast`` in this
            dtype (``torch.bfloat16`` on CPUs and recent GPUs, ``torch.float16`` on GPUs
            with a ``scaler``); None trains in float32.
        scaler: a ``torch.amp.GradScaler`` for float16 training (scales the loss so small
            gradients do not underflow, skips steps whose gradients overflowed).
        scheduler: a learning-rate scheduler, stepped after every optimizer step.
        loss_fn: what one batch costs (see :data:`LossFn`); default an image
            classifier's cross-entropy on ``(images, labels)`` batches.
        skip: batches already trained on (an epoch resumed in its middle): they are
            loaded, so that their random augmentations are drawn again, but not trained on.
        stop: called after every optimizer step with the number of batches done in this
            epoch (skipped ones included); the epoch ends there when it returns True.
            Every rank must get the same answer: ``preemption.PreemptionNotice.agreed``.

    Returns:
        The mean loss and accuracy over all ranks' items trained on in this call.
    """
    if not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be a whole number >= 1, got {accumulate!r}")
    if not isinstance(skip, int) or skip < 0 or skip % accumulate:
        raise ValueError(f"skip must be a whole number of optimizer steps' batches (a "
                         f"multiple of accumulate={accumulate}), got {skip!r}")
    device = torch.device(device) if device is not None else rank_device()
    model.train()
    totals = _Totals(device)
    batches = len(loader) if accumulate > 1 else None  # a loader without len: accumulate=1
    can_skip_sync = isinstance(model, nn.parallel.DistributedDataParallel)
    bar = progress_bar(loader, desc=f"epoch {epoch}", unit="batch", leave=False,
                       disable=not (progress and is_main()))
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(bar):
        if step < skip:
            continue
        group_start = step - step % accumulate
        group_size = 1 if batches is None else min(accumulate, batches - group_start)
        steps_now = step == group_start + group_size - 1
        syncing = nullcontext() if steps_now or not can_skip_sync else model.no_sync()
        with syncing:
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                cost = loss_fn(model, batch, device)
            share = cost.loss / group_size if group_size > 1 else cost.loss
            (scaler.scale(share) if scaler is not None else share).backward()
        if steps_now:
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
        totals.add(cost)
        if steps_now and stop is not None and stop(step + 1):
            break
    bar.close()
    return totals.global_metrics()


@torch.no_grad()
def evaluate(model: nn.Module, dataset, batch_size: int = 256,
             device: torch.device | str | None = None, num_workers: int = 0,
             loss_fn: LossFn = classification_loss) -> Metrics:
    """Loss and accuracy over ``dataset``, each sample counted exactly once across ranks.

    Each rank evaluates ``dataset[rank::world_size]`` (no padding, so shards may differ
    by one sample) and the sums are added up across ranks.

    Args:
        model: the model (unwrapped: evaluation needs no gradient synchronisation).
        dataset: indexable; its batches are what ``loss_fn`` takes.
        batch_size: samples per batch on each rank.
        device: where batches go; default this rank's device.
        num_workers: DataLoader workers per rank.
        loss_fn: what one batch costs, as for :func:`train_one_epoch`.
    """
    device = torch.device(device) if device is not None else rank_device()
    shard = Subset(dataset, range(rank(), len(dataset), world_size()))
    loader = DataLoader(shard, batch_size=batch_size, num_workers=num_workers)
    model.eval()
    totals = _Totals(device)
    for batch in loader:
        totals.add(loss_fn(model, batch, device))
    return totals.global_metrics()


# ---------------------------------------------------------------------- checkpoints


def _rng_state() -> dict:
    keys_kind, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"kind": keys_kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                  "position": int(position), "has_gauss": int(has_gauss),
                  "cached": float(cached)},
    }
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32),
                         numpy_state["position"], numpy_state["has_gauss"],
                         numpy_state["cached"]))
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(state["cuda"])


def _every_rank_rng_state() -> list[dict]:
    """Each rank's RNG states, in rank order, gathered on rank 0 (others get ``[]``)."""
    mine = _rng_state()
    if not (dist.is_available() and dist.is_initialized()) or world_size() == 1:
        return [mine]
    states = [None] * world_size() if is_main() else None
    dist.gather_object(mine, states, dst=0)
    return states or []


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    epoch: int, sampler_epoch: int | None = None, extra: dict | None = None):
    """Write a checkpoint atomically from rank 0; every rank waits until it is complete.

    Args:
        path: the checkpoint file. An existing one is replaced only once the new one is
            fully written, so an interrupted save never destroys the last good checkpoint.
        model: the model (DDP wrapper or not; it is saved unwrapped).
        optimizer: its state (momentum buffers...) is needed to resume exactly.
        epoch: the number of completed epochs.
        sampler_epoch: the value for ``sampler.set_epoch`` when resuming (default: epoch).
        extra: more plain data to store (metrics, configuration).
    """
    path = Path(path)
    rng_states = _every_rank_rng_state()  # a collective: every rank takes part
    if is_main():
        state = {
            "format": CHECKPOINT_FORMAT,
            "model": unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "epoch": int(epoch),
            "sampler_epoch": int(epoch if sampler_epoch is None else sampler_epoch),
            "rng": rng_states,  # one entry per rank: ranks draw different numbers
            "world_size": world_size(),
            "extra": extra or {},
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a killed save
            stale.unlink(missing_ok=True)
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(temporary, "wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # nobody loads or overwrites it while rank 0 is still writing


def _this_rank_rng_state(saved, path: Path) -> dict:
    """This rank's entry of a checkpoint's RNG states (older checkpoints hold one)."""
    states = saved if isinstance(saved, list) else [saved]
    if len(states) != world_size():
        raise ValueError(
            f"{path} holds the RNG states of {len(states)} rank(s), but this run has "
            f"{world_size()}: they cannot be handed out one per rank. Resume with "
            "restore_rng=False, and seed each rank's randomness from (seed, epoch, rank) "
            "as recipe.train_digits does."
        )
    return states[rank()]


def load_checkpoint(path: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    restore_rng: bool = True) -> dict:
    """Load a checkpoint into ``model`` (and ``optimizer``) on this rank's device.

    ``restore_rng`` gives each rank back its own random-number states (the checkpoint
    holds one set per rank, so ranks keep drawing different augmentations and dropout
    masks); it needs the same number of ranks as the run that saved.

    Returns:
        ``{"epoch", "sampler_epoch", "world_size", "extra"}`` from the checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        # On the CPU: the model and optimizer copy their tensors to their own device, and
        # the random-number states must stay CPU tensors.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise RuntimeError(
            f"checkpoint {path} is unreadable ({type(exc).__name__}: {exc}). It may be "
            "truncated or from another program; the previous good file is gone only if "
            "it was overwritten by something other than save_checkpoint."
        ) from exc
    if state.get("format") != CHECKPOINT_FORMAT:
        raise RuntimeError(f"{path} is not a checkpoint written by save_checkpoint")
    weights = {key.removeprefix("module."): value for key, value in state["model"].items()}
    unwrap(model).load_state_dict(weights)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if restore_rng:
        _restore_rng(_this_rank_rng_state(state["rng"], path))
    return {key: state[key] for key in ("epoch", "sampler_epoch", "world_size", "extra")}
