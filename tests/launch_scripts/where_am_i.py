"""A notebook cell's launch, run as a script or as a cell (tests/launch_scripts/kernel_cells.py):
mh.launch starts 2 ranks of its own, and the ranks report who and where they are."""

import json
import os

import mgpu_helpers as mh
from mgpu_helpers.runtime.cluster import cluster_environment


def where_am_i():
    return {"rank": mh.rank(), "world": mh.world_size(), "pid": os.getpid()}


ranks = mh.launch(where_am_i, nprocs=2, backend="gloo", return_all=True, join_timeout=120)
print(json.dumps({"ranks": ranks, "launcher": os.getpid(),
                  "a_rank_itself": cluster_environment() is not None,
                  "slurm": {key: value for key, value in os.environ.items()
                            if key.startswith("SLURM")}}))
