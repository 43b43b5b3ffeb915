"""Chapter 05's DDP training run of the tutorial CNN on the digits, shared with the script.

:func:`train_digits` is what one rank runs: join the group (done by ``launch``), build a
``DistributedSampler``, wrap the model in ``DistributedDataParallel``, train with
``set_epoch`` every epoch, checkpoint every epoch, resume from the checkpoint if there
is one, evaluate on the test split. The notebook launches it with ``launch``;
``scripts/train_ddp.py`` runs it under ``launch``, ``torchrun`` or SLURM.

Every epoch's data order and augmentation are seeded from (seed, epoch, rank) alone, not
from what ran before, so a run resumed from its epoch-``k`` checkpoint continues exactly
as the uninterrupted run did: the final weights are bitwise equal on CPU.

**The same run on 1 or 8 GPUs.** The settings fix the *global* batch (samples per
optimizer step, over all ranks), not the batch per rank: with N ranks each rank takes
``global_batch / N`` samples, so the optimisation is the same whatever the number of
GPUs (chapter 05 proves that N ranks with batch b equal one process with batch Nb).
Where N does not divide the global batch, or a run asks for another global batch, the
learning rate follows the batch by the **square-root scaling rule** for Adam (Malladi et
al., 2022; SGD would scale linearly, Goyal et al., 2017), reached by a warm-up from the
reference rate over the first epoch.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision.transforms import v2

from ..data import ImageDataset, loader_generator, prepare_digits, seed_worker
from ..models import SeedCNN
from ..runtime.precision import AMP_CHOICES, amp_dtype, auto_amp
from ..runtime.ranks import device as rank_device
from ..runtime.ranks import is_main, print0, rank, world_size
from .preemption import NOTICE_SIGNALS, PreemptionNotice, requeue_job
from .train import evaluate, load_checkpoint, save_checkpoint, train_one_epoch

TO_TENSOR = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
AUGMENT = v2.Compose([v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1)),
                      v2.ColorJitter(brightness=0.3, contrast=0.3), *TO_TENSOR])
#: The global batch the learning rate ``DigitsRun.lr`` is tuned for.
REFERENCE_BATCH = 64


@dataclass
class DigitsRun:
    """Settings of one training run (most are the script's command-line options).

    ``global_batch`` is the number of samples per optimizer step over all ranks (and
    accumulated micro-batches): each rank's micro-batch is ``global_batch / (ranks x
    accumulate)``, rounded (see :func:`batch_plan`). ``lr`` is Adam's learning rate for
    a global batch of ``REFERENCE_BATCH``; it decays along a cosine to 0 at the end.
    ``stop_after`` ends the run after that many epochs (as if it had been interrupted);
    running again with the same checkpoint resumes. ``requeue_on`` ("USR1") makes the
    run stop at the next optimizer step when that signal comes (SLURM's warning before
    the time limit or a preemption, ``sbatch --signal=USR1@120``), save its place in the
    epoch, and requeue its SLURM job, which resumes there (``preemption``).

    A field's ``metadata`` holds its option's help text and allowed values:
    ``scripts/train_ddp.py`` derives its options from the fields (``cli.add_options``).
    """

    epochs: int = 4
    global_batch: int = field(default=REFERENCE_BATCH, metadata={
        "help": "samples per optimizer step over all ranks (split between them)"})
    lr: float = field(default=1e-3, metadata={
        "help": f"Adam's peak learning rate for a global batch of {REFERENCE_BATCH} "
                "(scaled by the square-root rule for other global batches)"})
    seed: int = 0
    checkpoint: Path | None = None
    stop_after: int | None = None
    limit: int | None = field(default=None, metadata={
        "help": "train on the first N training images only (quick runs)"})
    workers: int = field(default=0, metadata={"help": "DataLoader workers per rank"})
    requeue_on: str | None = field(default=None, metadata={
        "choices": NOTICE_SIGNALS,
        "help": "on this signal (sbatch --signal=USR1@120), save at the next step and "
                "requeue the SLURM job, which resumes there (needs a checkpoint)"})
    accumulate: int = field(default=1, metadata={
        "help": "batches per optimizer step (gradient accumulation, no_sync)"})
    amp: str | None = field(default=None, metadata={
        "choices": AMP_CHOICES,
        "help": "mixed precision: auto (bfloat16 where the hardware computes it; else "
                "float16 with a scaler on GPUs, float32 on CPUs), bfloat16 or float16"})
    augment: bool = True
    evaluate_every_epoch: bool = True
    progress: bool = True
    verbose: bool = True  # rank 0 prints the batch plan, each epoch's metrics, the test result

    def __post_init__(self):
        for name in ("epochs", "global_batch", "accumulate"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got "
                                 f"{getattr(self, name)!r}")
        for name in ("limit", "stop_after"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or a whole number >= 1, got {value!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")
        if self.amp is not None and self.amp not in AMP_CHOICES:
            raise ValueError(f"amp must be None or one of {', '.join(AMP_CHOICES)}, "
                             f"got {self.amp!r}")
        if self.checkpoint is not None:
            self.checkpoint = Path(self.checkpoint)
        if self.requeue_on is not None:
            PreemptionNotice(self.requeue_on)  # refuses a signal it cannot wait for
            if self.checkpoint is None:
                raise ValueError("requeue_on needs a checkpoint to save the run in: give "
                                 "checkpoint=Path(...) (the script's --checkpoint)")


@dataclass(frozen=True)
class BatchPlan:
    """How a run's global batch is split, and the learning rate that goes with it."""

    per_rank: int       # samples per micro-batch on each rank
    global_batch: int   # what is actually summed per optimizer step (per_rank x ranks x acc.)
    lr: float           # the peak learning rate, scaled from run.lr for this global batch


def batch_plan(run: DigitsRun, ranks: int) -> BatchPlan:
    """Each rank's micro-batch for ``ranks`` ranks, and the learning rate scaled by the
    square-root rule for the global batch that results: with 1, 2, 4 or 8 ranks the global
    batch is exactly ``run.global_batch``; with 3 ranks it is 3 x 21 = 63, and the rate is
    ``lr x sqrt(63 / 64)``."""
    per_rank = max(1, round(run.global_batch / (ranks * run.accumulate)))
    actual = per_rank * ranks * run.accumulate
    return BatchPlan(per_rank, actual, run.lr * math.sqrt(actual / REFERENCE_BATCH))


def lr_factor(step: int, total_steps: int, warmup_steps: int, start: float) -> float:
    """The learning rate at optimizer step ``step``, as a fraction of the peak: a linear
    warm-up from ``start`` to 1 over ``warmup_steps``, times a cosine decay to 0."""
    ramp = start + (1 - start) * min(1.0, step / warmup_steps) if warmup_steps else 1.0
    return ramp * 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps))


def spread_subset(dataset, size: int, seed: int = 0) -> Subset:
    """``size`` samples drawn from the whole dataset (a fixed random choice, kept in
    dataset order). The first ``size`` samples would not do: image folders list one
    class after the other, so they would hold one or two digits only."""
    if size > len(dataset):
        raise ValueError(f"asked for {size} samples of a dataset of {len(dataset)}")
    chosen = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    return Subset(dataset, sorted(chosen[:size].tolist()))


def digits_datasets(run: DigitsRun) -> tuple:
    """(train, test) datasets: the train split augmented, optionally cut to ``limit``
    samples spread over all classes."""
    digits = prepare_digits(progress=is_main())
    train_set = ImageDataset(digits / "train",
                             transform=AUGMENT if run.augment else v2.Compose(TO_TENSOR))
    if run.limit is not None:
        train_set = spread_subset(train_set, min(run.limit, len(train_set)))
    return train_set, ImageDataset(digits / "test", transform=v2.Compose(TO_TENSOR))


def train_digits(run: DigitsRun) -> dict:
    """One rank's whole run. Returns the settings, per-epoch history and test metrics.

    The history has one entry per epoch run in this call (not the resumed ones):
    train loss/accuracy, test accuracy (if ``evaluate_every_epoch``), seconds, and
    samples/s over all ranks. A run stopped by ``requeue_on``'s signal returns
    ``"preempted": {"epoch", "batches_done"}`` instead of test metrics.
    """
    # First of all: until the handler is in place, the signal would end the process.
    with (PreemptionNotice(run.requeue_on) if run.requeue_on is not None
          else nullcontext()) as notice:
        train_set, test_set = digits_datasets(run)
        sampler = DistributedSampler(train_set, shuffle=True, seed=run.seed)
        device = rank_device()
        batches = batch_plan(run, world_size())

        torch.manual_seed(run.seed)  # equal weights (DDP checks shapes, broadcasts rank 0's)
        model = SeedCNN().to(device)
        ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        # fused: one kernel for every tensor's update, on GPUs and CPUs alike (the CNN's
        # 8.4M-weight step took 6 ms fused against 63 ms in the default, on a CPU core)
        optimizer = torch.optim.Adam(ddp_model.parameters(), lr=batches.lr, fused=True)
        steps_per_epoch = math.ceil(math.ceil(len(sampler) / batches.per_rank) / run.accumulate)
        warmup = steps_per_epoch if batches.lr != run.lr else 0  # from run.lr to the scaled rate
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
            step, run.epochs * steps_per_epoch, warmup, run.lr / batches.lr))
        low_precision = amp_dtype(run.amp, device)
        scaler = (torch.amp.GradScaler(device.type) if low_precision == torch.float16 else None)

        say = print0 if run.verbose else (lambda *args, **kwargs: None)
        start_epoch, skip = 0, 0
        if run.checkpoint is not None and run.checkpoint.exists():
            state = load_checkpoint(run.checkpoint, ddp_model, optimizer, restore_rng=False)
            start_epoch = state["epoch"]
            # Saved on a warning in the middle of an epoch: that epoch's first batches are done.
            skip = state["extra"].get("batches_done", 0)
            scheduler.load_state_dict(state["extra"]["scheduler"])
            if scaler is not None and "scaler" in state["extra"]:
                scaler.load_state_dict(state["extra"]["scaler"])
            say(f"resuming from {run.checkpoint} at epoch {start_epoch}"
                + (f", batch {skip}" if skip else ""))
        if notice is not None:  # every rank holds its handler: all passed DDP's broadcast
            say(f"on SIG{notice.name}: save at the next step and requeue the job")
        say(f"global batch {batches.global_batch} = {world_size()} rank(s) x "
            f"{batches.per_rank}" + (f" x {run.accumulate} accumulated" if run.accumulate > 1
                                     else "") + f"; peak learning rate {batches.lr:.2g}")
        if run.amp == "auto":  # the choice depends on the hardware: say which, and why
            say(f"mixed precision auto: {auto_amp(device)}")

        last_epoch = run.epochs if run.stop_after is None else min(run.epochs, run.stop_after)
        history = []
        stopped_at = []  # the batches done in its epoch when every rank agreed to stop

        def stop(done: int) -> bool:
            if notice.agreed(device):
                stopped_at.append(done)
            return bool(stopped_at)

        for epoch in range(start_epoch, last_epoch):
            torch.manual_seed(run.seed + 1000 * epoch + rank())  # this epoch's augmentation
            sampler.set_epoch(epoch)  # without it every epoch repeats the same order
            loader = DataLoader(train_set, batch_size=batches.per_rank, sampler=sampler,
                                num_workers=run.workers, worker_init_fn=seed_worker,
                                generator=loader_generator(run.seed + epoch, rank()))
            started = time.perf_counter()
            metrics = train_one_epoch(ddp_model, loader, optimizer, device=device, epoch=epoch,
                                      progress=run.progress, accumulate=run.accumulate,
                                      amp_dtype=low_precision, scaler=scaler,
                                      scheduler=scheduler, skip=skip if epoch == start_epoch else 0,
                                      stop=stop if notice is not None else None)
            seconds = time.perf_counter() - started
            done = stopped_at[0] if stopped_at and stopped_at[0] < len(loader) else 0
            if run.checkpoint is not None:
                extra = {"scheduler": scheduler.state_dict(), "batches_done": done}
                if scaler is not None:
                    extra["scaler"] = scaler.state_dict()
                save_checkpoint(run.checkpoint, ddp_model, optimizer,
                                epoch=epoch if done else epoch + 1, extra=extra)
            if stopped_at:
                # Said before requeueing: SLURM ends this run as it requeues the job.
                say(f"SIG{notice.name}: saved {run.checkpoint} at epoch {epoch}, batch "
                    f"{stopped_at[0]} of {len(loader)}; requeueing")
                if is_main():
                    say(requeue_job())
                return {"settings": _settings(run), "history": history,
                        "preempted": {"epoch": epoch, "batches_done": stopped_at[0]}}
            entry = {"epoch": epoch, "loss": metrics.loss, "accuracy": metrics.accuracy,
                     "seconds": seconds, "samples_per_s": metrics.samples / seconds}
            message = f"epoch {epoch}: train {metrics}"
            if run.evaluate_every_epoch:
                entry["test_accuracy"] = evaluate(model, test_set, device=device).accuracy
                message += f"; test accuracy {entry['test_accuracy']:.2%}"
            say(message)
            history.append(entry)

        result = evaluate(model, test_set, device=device)
        say(f"test {result}")
        return {"settings": _settings(run), "history": history, "test": {
            "loss": result.loss, "accuracy": result.accuracy, "samples": result.samples}}


def _settings(run: DigitsRun) -> dict:
    return {key: str(value) if isinstance(value, Path) else value
            for key, value in asdict(run).items()}
