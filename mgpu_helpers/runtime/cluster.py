"""Was this process started as one rank of a job by torchrun or by SLURM's srun?

``launch`` asks :func:`cluster_environment` first. When torchrun or an srun step started
the process, it joins the group they describe and starts nothing; otherwise it starts
its own ranks.

The SLURM case needs care. A JupyterLab server started by ``sbatch`` or ``salloc`` (how
Open OnDemand and most clusters serve notebooks) passes the allocation's variables to
every kernel: ``SLURM_NTASKS=4``, ``SLURM_PROCID=0``, ``SLURM_LOCALID=0``... Those
describe the *batch step* (one process, the script), not a rank of a parallel job.
Only ``srun`` starts tasks of a *job step*, and only a task of a step with several tasks
is a rank. ``srun`` marks its tasks with the step's id (``SLURM_STEP_ID``, a number from
0) and the step's task count (``SLURM_STEP_NUM_TASKS``); the batch step has no numbered
step id. Lightning guesses instead from the job name ("bash" or "interactive" means an
interactive shell), which misreads a batch-served notebook; the step id does not.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch.distributed as dist

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
SLURM_TASK_VARS = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_NODELIST")
# Step ids from here up are Slurm's special steps (batch, extern, interactive, pending).
_FIRST_SPECIAL_STEP_ID = 0xFFFFFFF0


class ClusterEnvironmentError(RuntimeError):
    """The environment says "a rank of a job", but not completely."""


@dataclass(frozen=True)
class ClusterRank:
    """This process's place in a job that torchrun or srun started."""

    launcher: str   # "torchrun" or "srun"
    rank: int
    world_size: int
    local_rank: int
    init_method: str  # "env://" under torchrun, "tcp://host:port" under srun


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list such as 'gpu[03-05,09],cpu1' (gives 'gpu03')."""
    prefix, bracket, ranges = nodelist.strip().partition("[")
    if "," in prefix or not bracket:  # the first host has no bracketed range
        return prefix.split(",")[0]
    return prefix + ranges.split("]")[0].split(",")[0].split("-")[0]


def _torchrun_rank(env) -> ClusterRank | None:
    present = [v for v in TORCHRUN_VARS if v in env]
    if not present:
        return None
    missing = [v for v in TORCHRUN_VARS if v not in env]
    if missing:
        raise ClusterEnvironmentError(
            f"{', '.join(present)} set but {', '.join(missing)} missing: set all of "
            f"{', '.join(TORCHRUN_VARS)} (torchrun does), or none to let launch() start "
            "the ranks itself"
        )
    return ClusterRank("torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]),
                       int(env["LOCAL_RANK"]), "env://")


def slurm_step_tasks(env=None) -> int | None:
    """How many tasks the srun step this process belongs to has; None when it belongs to
    no numbered step (a batch or interactive allocation, or no SLURM at all)."""
    env = os.environ if env is None else env
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if step is None or not step.strip().isdigit() or int(step) >= _FIRST_SPECIAL_STEP_ID:
        return None
    tasks = env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1"))
    return int(tasks) if tasks.strip().isdigit() else None


def _srun_rank(env) -> ClusterRank | None:
    tasks = slurm_step_tasks(env)
    if tasks is None or tasks < 2:
        return None  # a notebook kernel inside an allocation: launch starts its own ranks
    nodelist = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST",
                                                        env.get("SLURM_NODELIST")))
    missing = [v for v in SLURM_TASK_VARS if v not in env
               and not (v == "SLURM_JOB_NODELIST" and nodelist)]
    if missing:
        raise ClusterEnvironmentError(
            f"inside an srun step of {tasks} tasks, but {', '.join(missing)} missing; run "
            "the script with srun (which sets them), or with torchrun"
        )
    job_port = 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000
    port = int(env.get("MASTER_PORT", job_port))
    addr = env.get("MASTER_ADDR", first_slurm_host(nodelist))
    return ClusterRank("srun", int(env["SLURM_PROCID"]), tasks, int(env["SLURM_LOCALID"]),
                       f"tcp://{addr}:{port}")


def cluster_environment(env=None) -> ClusterRank | None:
    """This process's rank under torchrun or srun; None when neither started it as a
    rank (then ``launch`` starts the ranks itself).

    Raises:
        ClusterEnvironmentError: some of torchrun's variables are set but not all, or an
            srun step misses variables that srun always sets.
    """
    env = os.environ if env is None else env
    return _torchrun_rank(env) or _srun_rank(env)


def elastic_store(cluster: ClusterRank, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store under torchrun, with keys kept apart per restart attempt.

    torchrun's agent may serve one store for the whole job. After a restart
    (``--max-restarts``), keys written by the previous attempt's workers (their gloo
    addresses) are still there, and a new worker can read a dead worker's address before
    its replacement overwrites it ("Connection refused" in connectFullMesh). A prefix per
    attempt makes every attempt start from an empty namespace.
    """
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          cluster.world_size, not agent_hosts and cluster.rank == 0,
                          timeout=timeout)
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    return dist.PrefixStore(f"/mgpu_helpers/attempt_{attempt}", store)
