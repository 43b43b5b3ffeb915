"""Chapter 04's DDP training run of the seed CNN on the digits, shared with the script.

:func:`train_digits` is what one rank runs: join the group (done by ``launch``), build a
``DistributedSampler``, wrap the model in ``DistributedDataParallel``, train with
``set_epoch`` every epoch, checkpoint every epoch, resume from the checkpoint if there
is one, evaluate on the test split. The notebook launches it with ``launch``;
``scripts/train_ddp.py`` runs it under ``launch``, ``torchrun`` or SLURM.

Every epoch's data order and augmentation are seeded from (seed, epoch, rank) alone, not
from what ran before, so a run resumed from its epoch-``k`` checkpoint continues exactly
as the uninterrupted run did: the final weights are bitwise equal on CPU.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision.transforms import v2

from .data import ImageDataset, loader_generator, prepare_digits, seed_worker
from .dist import device as rank_device
from .dist import is_main, print0, rank
from .models import SeedCNN
from .train import evaluate, load_checkpoint, save_checkpoint, train_one_epoch

TO_TENSOR = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
AUGMENT = v2.Compose([v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1)),
                      v2.ColorJitter(brightness=0.3, contrast=0.3), *TO_TENSOR])
AMP_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class DigitsRun:
    """Settings of one training run (the script's command-line options).

    ``batch_size`` is per rank: the global batch is ``batch_size x ranks x accumulate``.
    ``stop_after`` ends the run after that many epochs (as if it had been interrupted);
    running again with the same checkpoint resumes. ``die_at_epoch``/``die_rank`` kill
    one rank with SIGKILL at the start of that epoch, on the first attempt only: the
    test hook for ``torchrun --max-restarts``.
    """

    epochs: int = 4
    batch_size: int = 32
    lr: float = 0.02
    seed: int = 0
    checkpoint: Path | None = None
    stop_after: int | None = None
    limit: int | None = None
    workers: int = 0
    accumulate: int = 1
    amp: str | None = None
    augment: bool = True
    evaluate_every_epoch: bool = True
    progress: bool = True
    die_at_epoch: int | None = None
    die_rank: int = 1

    def __post_init__(self):
        for name in ("epochs", "batch_size", "accumulate"):
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
        if self.amp is not None and self.amp not in AMP_DTYPES:
            raise ValueError(f"amp must be None or one of {sorted(AMP_DTYPES)}, "
                             f"got {self.amp!r}")
        if self.checkpoint is not None:
            self.checkpoint = Path(self.checkpoint)


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
    samples/s over all ranks.
    """
    train_set, test_set = digits_datasets(run)
    sampler = DistributedSampler(train_set, shuffle=True, seed=run.seed)
    device = rank_device()

    torch.manual_seed(run.seed)  # the same initial weights on every rank (DDP checks)
    model = SeedCNN().to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=run.lr, momentum=0.9)
    amp_dtype = AMP_DTYPES.get(run.amp)
    scaler = (torch.amp.GradScaler(device.type) if amp_dtype == torch.float16 else None)

    start_epoch = 0
    if run.checkpoint is not None and run.checkpoint.exists():
        state = load_checkpoint(run.checkpoint, ddp_model, optimizer, restore_rng=False)
        start_epoch = state["epoch"]
        if scaler is not None and "scaler" in state["extra"]:
            scaler.load_state_dict(state["extra"]["scaler"])
        print0(f"resuming from {run.checkpoint} at epoch {start_epoch}")

    last_epoch = run.epochs if run.stop_after is None else min(run.epochs, run.stop_after)
    history = []
    for epoch in range(start_epoch, last_epoch):
        if (run.die_at_epoch == epoch and rank() == run.die_rank
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            os.kill(os.getpid(), signal.SIGKILL)  # test hook: a rank killed mid-training
        torch.manual_seed(run.seed + 1000 * epoch + rank())  # this epoch's augmentation
        sampler.set_epoch(epoch)  # without it every epoch repeats the same order
        loader = DataLoader(train_set, batch_size=run.batch_size, sampler=sampler,
                            num_workers=run.workers, worker_init_fn=seed_worker,
                            generator=loader_generator(run.seed + epoch, rank()))
        started = time.perf_counter()
        metrics = train_one_epoch(ddp_model, loader, optimizer, device=device, epoch=epoch,
                                  progress=run.progress, accumulate=run.accumulate,
                                  amp_dtype=amp_dtype, scaler=scaler)
        seconds = time.perf_counter() - started
        entry = {"epoch": epoch, "loss": metrics.loss, "accuracy": metrics.accuracy,
                 "seconds": seconds, "samples_per_s": metrics.samples / seconds}
        if run.checkpoint is not None:
            extra = {"scaler": scaler.state_dict()} if scaler is not None else {}
            save_checkpoint(run.checkpoint, ddp_model, optimizer, epoch=epoch + 1,
                            extra=extra)
        message = f"epoch {epoch}: train {metrics}"
        if run.evaluate_every_epoch:
            entry["test_accuracy"] = evaluate(model, test_set, device=device).accuracy
            message += f"; test accuracy {entry['test_accuracy']:.2%}"
        print0(message)
        history.append(entry)

    result = evaluate(model, test_set, device=device)
    print0(f"test {result}")
    settings = {key: str(value) if isinstance(value, Path) else value
                for key, value in asdict(run).items()}
    return {"settings": settings, "history": history, "test": {
        "loss": result.loss, "accuracy": result.accuracy, "samples": result.samples}}
