"""The SLURM variables three kinds of process see, for tests, as a real SLURM sets them.

Recorded with ``env`` on Slurm 22.05 (Debian 12) on the one-node cluster of
``tools/slurm_cluster.py``; ``tests/workbook/test_slurm.py`` records them again on every run there
and fails if a name differs from these (values that change from job to job are
placeholders here: ids, pids, ports, folders).

``batch_allocation``: the batch step of ``sbatch --ntasks N``, the process that runs the
script, and so a JupyterLab server it starts and that server's kernels (Open OnDemand's
way). It holds the allocation's task count and rank-like variables of its own
(``SLURM_PROCID=0``, ``SLURM_LOCALID=0``, ``SLURM_GTIDS=0``) but no step id and no
``SLURM_NTASKS_PER_NODE`` (only ``--ntasks-per-node`` sets that).

``salloc_shell``: a command that ``salloc --ntasks N`` runs (a shell, or JupyterLab started
from it). It runs where salloc runs, outside any step: the allocation's description only,
with no ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_GTIDS`` or
``SLURMD_NODENAME``.

``srun_task``: task ``k`` of a step that ``srun --ntasks N`` started (outside a batch job;
inside one, srun adds ``SLURM_DISTRIBUTION`` and ``SLURM_JOB_CPUS_PER_NODE_PACK_GROUP_0``
and drops ``SLURM_NODE_ALIASES``). Only a step's tasks have ``SLURM_STEP_ID`` and
``SLURM_STEP_NUM_TASKS``.
"""

from __future__ import annotations

CONF = "/etc/slurm/slurm.conf"


def _job(job_id: str, name: str, tasks: int) -> dict[str, str]:
    """What every process of a one-node job of ``tasks`` tasks sees."""
    return {
        "SLURM_CLUSTER_NAME": "mgpu", "SLURM_CONF": CONF,
        "SLURM_JOBID": job_id, "SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": name,
        "SLURM_JOB_CPUS_PER_NODE": str(tasks), "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_PARTITION": "debug",
        "SLURM_NNODES": "1", "SLURM_NODELIST": "localhost",
        "SLURM_NPROCS": str(tasks), "SLURM_NTASKS": str(tasks),
        "SLURM_SUBMIT_DIR": "/home/reader/workbook", "SLURM_SUBMIT_HOST": "login1",
        "SLURM_TASKS_PER_NODE": str(tasks),
    }


def _on_the_node(job_id: str, pid: str) -> dict[str, str]:
    """What slurmd adds for a process it starts on the node."""
    return {
        "SLURMD_NODENAME": "localhost", "SLURM_JOB_GID": "1000", "SLURM_JOB_UID": "1000",
        "SLURM_JOB_USER": "reader", "SLURM_NODEID": "0", "SLURM_PRIO_PROCESS": "0",
        "SLURM_TASK_PID": pid, "SLURM_TOPOLOGY_ADDR": "localhost",
        "SLURM_TOPOLOGY_ADDR_PATTERN": "node",
        "SLURM_WORKING_CLUSTER": "mgpu:127.0.0.1:6817:9728:109",
    }


def batch_allocation(tasks: int = 4, job_id: str = "200505") -> dict[str, str]:
    return {
        **_job(job_id, "jupyter", tasks), **_on_the_node(job_id, "16360"),
        "SLURM_CPUS_ON_NODE": str(tasks), "SLURM_NODE_ALIASES": "(null)",
        "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_GTIDS": "0",
    }


def salloc_shell(tasks: int = 4, job_id: str = "200506") -> dict[str, str]:
    return {**_job(job_id, "interactive", tasks), "SLURM_NODE_ALIASES": "(null)"}


def srun_task(task: int, tasks: int = 2, job_id: str = "77", step_id: str = "0") -> dict:
    return {
        **_job(job_id, "python", tasks), **_on_the_node(job_id, str(4058 + task)),
        "SLURM_CPUS_ON_NODE": str(tasks), "SLURM_GTIDS": ",".join(map(str, range(tasks))),
        "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task),
        "SLURM_STEP_ID": step_id, "SLURM_STEPID": step_id,
        "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": str(tasks),
        "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "SLURM_SRUN_COMM_HOST": "127.0.0.1",
        "SLURM_SRUN_COMM_PORT": "46203", "SLURM_STEP_LAUNCHER_PORT": "46203",
        "SLURM_UMASK": "0022",
    }
