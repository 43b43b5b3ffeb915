"""Under torchrun, or as a task of an ``srun`` step: no ranks to start; join the group
the environment describes and run the function once, in this process."""

from __future__ import annotations

import datetime
import gc
import os

import torch
import torch.distributed as dist

from ..runtime.backend import backend_device_type
from ..runtime.cluster import ClusterRank, elastic_store
from ..runtime.devices import count_gpus, gpu_count
from ..runtime.group_reuse import reusing_launched_group
from ..runtime.ranks import gpu_index
from .checks import resolve_backend
from .rank_exit import finish_group


def torchrun_variables(cluster: ClusterRank) -> dict[str, str]:
    """The variables torchrun sets, derived from an srun task's, so that code reading
    RANK or LOCAL_RANK (and ``mh.local_rank()``) works under srun as under torchrun."""
    host, _, port = cluster.init_method.removeprefix("tcp://").rpartition(":")
    variables = {"RANK": str(cluster.rank), "WORLD_SIZE": str(cluster.world_size),
                 "LOCAL_RANK": str(cluster.local_rank), "MASTER_ADDR": host,
                 "MASTER_PORT": port}
    per_node = os.environ.get("SLURM_STEP_TASKS_PER_NODE",
                              os.environ.get("SLURM_TASKS_PER_NODE", ""))
    first = per_node.split("(")[0].split(",")[0]  # "4(x2)" or "4,2": this node's count
    if first.isdigit():  # exact on homogeneous steps, the usual case
        variables["LOCAL_WORLD_SIZE"] = first
    return variables


def run_in_this_process(fn, args, kwargs, cluster: ClusterRank, backend: str,
                        timeout: float):
    if cluster.launcher == "srun":
        for name, value in torchrun_variables(cluster).items():
            os.environ.setdefault(name, value)
    gpus = count_gpus()  # the GPUs CUDA starts on, as launch() and describe() count them
    reason = gpu_count().problem if gpus == 0 else None
    backend = resolve_backend(backend, gpus, no_gpu_reason=reason)
    if backend_device_type(backend) == "cuda":
        torch.cuda.set_device(gpu_index())  # after LOCAL_RANK is in the environment
    group_timeout = datetime.timedelta(seconds=timeout)
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        dist.init_process_group(backend, store=elastic_store(cluster, group_timeout),
                                rank=cluster.rank, world_size=cluster.world_size,
                                timeout=group_timeout)
    else:
        dist.init_process_group(backend, init_method=cluster.init_method,
                                rank=cluster.rank, world_size=cluster.world_size,
                                timeout=group_timeout)
    try:
        with reusing_launched_group(fn, backend, cluster.world_size, cluster.rank):
            value = fn(*args, **kwargs)
    except BaseException:
        finish_group(clean=False)
        raise
    finish_group(clean=True)
    # DDP (its reducer and hooks) and FSDP hold the group in reference cycles, freed by
    # the garbage collector, which may first run while the interpreter shuts down: the
    # group's destructor then joins gloo's worker threads, one of which drops the tensors
    # of its last collective when it can no longer take the GIL, and the process aborts
    # ("terminate called without an active exception", 2 torchrun runs of 3 ranks in
    # 40 here). Collected now, the group goes while the interpreter is whole.
    gc.collect()
    return value
