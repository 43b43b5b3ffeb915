"""Train Part III's GPT with FSDP2 (HSDP with --replicate): from a shell, torchrun or SLURM.

    python scripts/train_gpt.py --nprocs 2                         # launches 2 ranks itself
    torchrun --standalone --nproc-per-node 8 scripts/train_gpt.py  # one node, 8 GPUs
    torchrun --nnodes 2 --node-rank K --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29400 --rdzv-id JOB scripts/train_gpt.py --replicate 2
    srun --ntasks-per-node 8 python scripts/train_gpt.py --replicate 2   # SLURM

The training is chapter 10's `mgpu_helpers.training.gpt_recipe.train_gpt`: per-block `fully_shard`
with a `MixedPrecisionPolicy`, optional activation checkpointing and `torch.compile` per
block, gradient accumulation, and a distributed checkpoint every `--save-every` steps in
`--checkpoint`, resumed when the script runs again with the same settings (exactly: the
weights, AdamW's state, the schedule and the data continue as in an uninterrupted run;
the number of ranks may change). Other settings are refused: give another --checkpoint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mgpu_helpers as mh
from mgpu_helpers.runtime.cluster import cluster_environment
from mgpu_helpers.training.cli import add_options, from_options
from mgpu_helpers.training.gpt_recipe import GPTRun, train_gpt

#: The fields of GPTRun that are options (verbose serves the notebook).
OPTIONS = ("steps", "global_batch", "accumulate", "lr", "warmup", "seed", "dim", "layers",
           "heads", "pairs", "queries", "replicate", "precision", "checkpointing", "compile",
           "checkpoint", "save_every", "stop_after")


def parse_args(argv=None) -> tuple[GPTRun, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The script's own default: it always checkpoints, so that a restarted run resumes.
    add_options(parser, GPTRun, OPTIONS, defaults={"checkpoint": Path("runs/train_gpt")})
    parser.add_argument("--nprocs", type=int, default=None,
                        help="ranks to launch when not under torchrun/SLURM (default: GPUs)")
    parser.add_argument("--result", type=Path, default=None,
                        help="write the losses and the held-out accuracy here as JSON (rank 0)")
    args = parser.parse_args(argv)
    run = from_options(parser, GPTRun, args, OPTIONS)
    run.verbose = True
    return run, args


def main(argv=None) -> None:
    run, args = parse_args(argv)
    result = mh.launch(train_gpt, run, nprocs=args.nprocs)
    cluster = cluster_environment()  # under torchrun every process returns here
    if cluster is None or cluster.rank == 0:
        if result["losses"]:
            trained = (f"{len(result['losses'])} steps from step {result['resumed_at']}: "
                       f"loss {result['losses'][-1]:.4f}")
        else:
            trained = (f"nothing to train: the checkpoint is at step {result['resumed_at']} "
                       f"of {run.steps} (raise --steps, or give another --checkpoint)")
        print(f"{trained}, held-out exact match {result['exact_match']:.0%}")
        if args.result is not None:
            args.result.parent.mkdir(parents=True, exist_ok=True)
            args.result.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
