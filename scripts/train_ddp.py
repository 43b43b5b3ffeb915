"""Train the tutorial CNN on the digits with DDP: from a shell, under torchrun, or in SLURM.

    python scripts/train_ddp.py --nprocs 2                        # launches 2 ranks itself
    torchrun --standalone --nproc-per-node 2 scripts/train_ddp.py # one node
    torchrun --nnodes 2 --node-rank K --nproc-per-node 4 --rdzv-backend c10d \
        --rdzv-endpoint HOST0:29400 --rdzv-id JOB scripts/train_ddp.py
    srun --ntasks-per-node 4 python scripts/train_ddp.py          # SLURM, no torchrun
    sbatch scripts/train_ddp.sbatch           # SLURM batch job: saves and requeues on warning

The training itself is chapter 05's `mgpu_helpers.training.recipe.train_digits`. It saves a
checkpoint after every epoch and resumes from it when restarted, so
`torchrun --max-restarts 1` survives a killed rank and finishes with the same weights as
an uninterrupted run (bitwise, on CPU): every epoch's data order and augmentation are
seeded from (seed, epoch, rank) alone, never from what happened before. With
`--requeue-on USR1` a SLURM job warned before its end (`sbatch --signal=USR1@120`, or
`scancel --signal=USR1 JOB`) saves at the next step and requeues itself; the requeued
job resumes at that batch, with the same final weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mgpu_helpers as mh
from mgpu_helpers.runtime.cluster import cluster_environment
from mgpu_helpers.training.cli import add_options, from_options
from mgpu_helpers.training.recipe import DigitsRun, train_digits

#: The fields of DigitsRun that are options, each with the chapter's default and the help
#: text beside the field. The others (stop_after, augment, evaluate_every_epoch, progress,
#: verbose) serve the notebook.
OPTIONS = ("epochs", "global_batch", "lr", "seed", "checkpoint", "limit", "workers",
           "accumulate", "amp", "requeue_on")


def parse_args(argv=None) -> tuple[DigitsRun, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The one default of the script's own: it always checkpoints, so that a restarted
    # run resumes (the chapter's runs checkpoint only where asked to).
    add_options(parser, DigitsRun, OPTIONS, defaults={"checkpoint": Path("runs/train_ddp.pt")})
    parser.add_argument("--nprocs", type=int, default=None,
                        help="ranks to launch when not under torchrun/SLURM (default: GPUs)")
    parser.add_argument("--result", type=Path, default=None,
                        help="write the history and test metrics here as JSON (rank 0)")
    args = parser.parse_args(argv)
    return from_options(parser, DigitsRun, args, OPTIONS), args


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
