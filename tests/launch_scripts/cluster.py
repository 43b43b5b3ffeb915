"""Run under torchrun or SLURM: launch() spawns nothing and runs the function once here."""

import os

import torch
import torch.distributed as dist

import mgpu_helpers as mh


def work():
    value = torch.ones(1)
    dist.all_reduce(value)
    return f"pid {os.getpid()} rank {mh.rank()} world {mh.world_size()} sum {value.item():.0f}"


if __name__ == "__main__":
    print(mh.launch(work), flush=True)
