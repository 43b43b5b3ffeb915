"""Train the seed CNN on the digits with DDP: from a shell, under torchrun, or in SLURM.

    python scripts/train_ddp.py --nprocs 2                        # launches 2 ranks itself
    torchrun --standalone --nproc-per-node 2 scripts/train_ddp.py # one node
    torchrun --nnodes 2 --node-rank K --nproc-per-node 4 --rdzv-backend c10d \
        --rdzv-endpoint HOST0:29400 --rdzv-id JOB scripts/train_ddp.py
    srun --ntasks-per-node 4 python scripts/train_ddp.py          # SLURM, no torchrun

It saves a checkpoint after every epoch and resumes from it when restarted, so
`torchrun --max-restarts 1` survives a killed rank and finishes with the same weights as
an uninterrupted run (bitwise, on CPU): every epoch's data order and augmentation are
seeded from (seed, epoch, rank) alone, never from what happened before.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision.transforms import v2

import mgpu_helpers as mh
from mgpu_helpers.data import ImageDataset, loader_generator, prepare_digits, seed_worker
from mgpu_helpers.models import SeedCNN
from mgpu_helpers.train import evaluate, load_checkpoint, save_checkpoint, train_one_epoch

TO_TENSOR = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
AUGMENT = v2.Compose([v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1)),
                      v2.ColorJitter(brightness=0.3, contrast=0.3), *TO_TENSOR])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", type=Path, default=Path("runs/train_ddp.pt"))
    parser.add_argument("--limit", type=int, default=None,
                        help="train on the first N training images only (quick runs)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank")
    parser.add_argument("--nprocs", type=int, default=None,
                        help="ranks to launch when not under torchrun/SLURM (default: GPUs)")
    parser.add_argument("--die-at-epoch", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--die-rank", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    return args


def train(args: argparse.Namespace) -> dict:
    """The whole training run of one rank; returns the final test metrics."""
    digits = prepare_digits(progress=mh.is_main())
    train_set = ImageDataset(digits / "train", transform=AUGMENT)
    if args.limit is not None:
        train_set = Subset(train_set, range(min(args.limit, len(train_set))))
    test_set = ImageDataset(digits / "test", transform=v2.Compose(TO_TENSOR))
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    device = mh.device()

    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP checks this too)
    model = SeedCNN().to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=0.9)

    start_epoch = 0
    if args.checkpoint.exists():
        start_epoch = load_checkpoint(args.checkpoint, ddp_model, optimizer,
                                      restore_rng=False)["epoch"]
        mh.print0(f"resuming from {args.checkpoint} at epoch {start_epoch}")

    for epoch in range(start_epoch, args.epochs):
        if (args.die_at_epoch == epoch and mh.rank() == args.die_rank
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            os.kill(os.getpid(), signal.SIGKILL)  # test hook: a rank killed mid-training
        torch.manual_seed(args.seed + 1000 * epoch + mh.rank())  # augmentation of this epoch
        sampler.set_epoch(epoch)
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                            num_workers=args.workers, worker_init_fn=seed_worker,
                            generator=loader_generator(args.seed + epoch, mh.rank()))
        metrics = train_one_epoch(ddp_model, loader, optimizer, epoch=epoch)
        save_checkpoint(args.checkpoint, ddp_model, optimizer, epoch=epoch + 1)
        mh.print0(f"epoch {epoch}: train {metrics}")

    result = evaluate(model, test_set, device=device)
    mh.print0(f"test {result}")
    return {"loss": result.loss, "accuracy": result.accuracy, "samples": result.samples}


def main(argv=None) -> None:
    args = parse_args(argv)
    mh.launch(train, args, nprocs=args.nprocs)


if __name__ == "__main__":
    main()
