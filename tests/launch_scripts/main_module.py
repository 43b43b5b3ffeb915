"""A training function defined in __main__, launched with fork and with spawn.

Spawn would normally fail here ("Can't get attribute 'work' on <module '__main__'>");
the launcher sends the function with cloudpickle instead. Forked ranks start with the
imports every DDP or FSDP rank makes (mgpu_helpers.launcher.api.RANK_IMPORTS) done.
"""

import os
import sys

import torch
import torch.distributed as dist

import mgpu_helpers as mh
from mgpu_helpers.launcher.api import RANK_IMPORTS


def work(offset):
    inherited = all(name in sys.modules for name in RANK_IMPORTS)
    value = torch.tensor([float(mh.rank() + offset)])
    dist.all_reduce(value)
    print(f"rank {mh.rank()} of {mh.world_size()} on {mh.device()}")
    mh.print0("printed once")
    return value, inherited


if __name__ == "__main__":
    before = dict(os.environ)
    assert not any(name in sys.modules for name in RANK_IMPORTS), "imported too early"
    for method in ("fork", "spawn"):
        result, inherited = mh.launch(work, 10, nprocs=2, start_method=method)
        print(f"{method}: {result.item():.0f}")
        if method == "fork":
            print(f"forked ranks inherit the parent's imports: {inherited}")
    assert dict(os.environ) == before, "launch() changed the parent's environment"
    print("environment unchanged")
