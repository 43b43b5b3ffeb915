"""A training function defined in __main__, launched with fork and with spawn.

Spawn would normally fail here ("Can't get attribute 'work' on <module '__main__'>");
the launcher sends the function with cloudpickle instead.
"""

import os

import torch
import torch.distributed as dist

import mgpu_helpers as mh


def work(offset):
    value = torch.tensor([float(mh.rank() + offset)])
    dist.all_reduce(value)
    print(f"rank {mh.rank()} of {mh.world_size()} on {mh.device()}")
    mh.print0("printed once")
    return value


if __name__ == "__main__":
    before = dict(os.environ)
    for method in ("fork", "spawn"):
        result = mh.launch(work, 10, nprocs=2, start_method=method)
        print(f"{method}: {result.item():.0f}")
    assert dict(os.environ) == before, "launch() changed the parent's environment"
    print("environment unchanged")
