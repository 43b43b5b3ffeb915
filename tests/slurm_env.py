"""The SLURM variables two kinds of process see, for tests.

``batch_allocation``: a process started by the batch script of ``sbatch --ntasks 4`` (or
a shell of ``salloc``), such as a JupyterLab server and its kernels. The variables are
those a real 4-task batch job printed (``env | grep SLURM``): the allocation's task
count and the batch step's own rank 0, but no step id, since no srun step runs it.

``srun_task``: task ``k`` of a step that ``srun --ntasks N`` started: the same, plus the
step's id and task count, which only srun sets.
"""

from __future__ import annotations


def batch_allocation(tasks: int = 4, job_id: str = "200505") -> dict[str, str]:
    return {
        "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_JOB_NAME": "jupyter",
        "SLURM_NTASKS": str(tasks), "SLURM_NPROCS": str(tasks),
        "SLURM_TASKS_PER_NODE": str(tasks), "SLURM_NTASKS_PER_NODE": str(tasks),
        "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0",
        "SLURM_JOB_NODELIST": "localhost", "SLURM_NODELIST": "localhost",
        "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_GTIDS": "0",
        "SLURM_CPUS_ON_NODE": str(tasks), "SLURM_TASK_PID": "16360",
        "SLURM_SUBMIT_DIR": "/tmp", "SLURM_CLUSTER_NAME": "test",
    }


def srun_task(task: int, tasks: int = 2, job_id: str = "77", step_id: str = "0") -> dict:
    return {
        **batch_allocation(tasks, job_id),
        "SLURM_STEP_ID": step_id, "SLURM_STEPID": step_id,
        "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": str(tasks),
        "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task), "SLURM_GTIDS": ",".join(
            str(t) for t in range(tasks)),
    }
