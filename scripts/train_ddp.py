"""Train the seed CNN on the digits with DDP: from a shell, under torchrun, or in SLURM.

    python scripts/train_ddp.py --nprocs 2                        # launches 2 ranks itself
    torchrun --standalone --nproc-per-node 2 scripts/train_ddp.py # one node
    torchrun --nnodes 2 --node-rank K --nproc-per-node 4 --rdzv-backend c10d \
        --rdzv-endpoint HOST0:29400 --rdzv-id JOB scripts/train_ddp.py
    srun --ntasks-per-node 4 python scripts/train_ddp.py          # SLURM, no torchrun

The training itself is chapter 05's `mgpu_helpers.recipe.train_digits`. It saves a
checkpoint after every epoch and resumes from it when restarted, so
`torchrun --max-restarts 1` survives a killed rank and finishes with the same weights as
an uninterrupted run (bitwise, on CPU): every epoch's data order and augmentation are
seeded from (seed, epoch, rank) alone, never from what happened before.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mgpu_helpers as mh
from mgpu_helpers.cluster import cluster_environment
from mgpu_helpers.precision import AMP_CHOICES
from mgpu_helpers.recipe import REFERENCE_BATCH, DigitsRun, train_digits


def parse_args(argv=None) -> tuple[DigitsRun, argparse.Namespace]:
    defaults = DigitsRun()  # the chapter's settings
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--global-batch", type=int, default=defaults.global_batch,
                        help="samples per optimizer step over all ranks (split between them)")
    parser.add_argument("--lr", type=float, default=defaults.lr,
                        help=f"Adam's peak learning rate for a global batch of {REFERENCE_BATCH} "
                             "(scaled by the square-root rule for other global batches)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--checkpoint", type=Path, default=Path("runs/train_ddp.pt"))
    parser.add_argument("--limit", type=int, default=None,
                        help="train on the first N training images only (quick runs)")
    parser.add_argument("--workers", type=int, default=defaults.workers,
                        help="DataLoader workers per rank")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="batches per optimizer step (gradient accumulation, no_sync)")
    parser.add_argument("--amp", choices=AMP_CHOICES, default=None,
                        help="mixed precision: auto (bfloat16 where supported, else float16 "
                             "with a scaler), bfloat16 or float16")
    parser.add_argument("--nprocs", type=int, default=None,
                        help="ranks to launch when not under torchrun/SLURM (default: GPUs)")
    parser.add_argument("--result", type=Path, default=None,
                        help="write the history and test metrics here as JSON (rank 0)")
    args = parser.parse_args(argv)
    try:
        run = DigitsRun(epochs=args.epochs, global_batch=args.global_batch, lr=args.lr,
                        seed=args.seed, checkpoint=args.checkpoint, limit=args.limit,
                        workers=args.workers, accumulate=args.accumulate, amp=args.amp)
    except ValueError as exc:
        parser.error(str(exc).replace("_", "-"))
    return run, args


def main(argv=None) -> None:
    run, args = parse_args(argv)
    result = mh.launch(train_digits, run, nprocs=args.nprocs)
    # Under torchrun or an srun step every process returns here; only global rank 0 writes.
    cluster = cluster_environment()
    if args.result is not None and (cluster is None or cluster.rank == 0):
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
