"""Run under torchrun or SLURM: launch() spawns nothing and runs the function once here."""

import os

import torch
import torch.distributed as dist

import mgpu_helpers as mh


def work():
    value = torch.ones(1)
    dist.all_reduce(value)
    task = os.environ.get("SLURM_TASK_PID", "-")  # srun's task: this process, if srun started it
    return (f"pid {os.getpid()} task {task} rank {mh.rank()} world {mh.world_size()} "
            f"sum {value.item():.0f}")


if __name__ == "__main__":
    # One write per line: processes sharing a pipe cannot split each other's lines.
    os.write(1, (mh.launch(work) + "\n").encode())
