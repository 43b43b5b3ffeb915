"""Who is a rank of a cluster job? torchrun's and srun's tasks are; a notebook kernel
inside a SLURM allocation is not, and starts its own ranks.

The kernel tests start a real Jupyter kernel with the variables a 4-task batch job
carries (tests/support/slurm_env.py) and run launch() in a cell.
"""

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook
from support.slurm_env import batch_allocation, salloc_shell, srun_task

from mgpu_helpers.runtime.cluster import (
    ClusterEnvironmentError,
    cluster_environment,
    slurm_step_tasks,
)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


@pytest.mark.parametrize("allocation", [batch_allocation, salloc_shell])
def test_a_batch_step_or_a_salloc_command_is_not_a_rank(allocation):
    assert slurm_step_tasks(allocation(4)) is None
    assert cluster_environment(allocation(4)) is None


@pytest.mark.parametrize("task", [0, 1, 2])
def test_a_task_of_an_srun_step_is_a_rank(task):
    rank = cluster_environment({**srun_task(task, tasks=3), "MASTER_PORT": "29999"})
    assert (rank.launcher, rank.rank, rank.world_size, rank.local_rank) == ("srun", task, 3, task)
    assert rank.init_method == "tcp://localhost:29999"


def test_a_one_task_step_starts_its_own_ranks():
    # `srun --ntasks 1 jupyter lab` inside `salloc -n 4`: the allocation says 4 tasks,
    # the step says 1: the kernel is nobody's rank.
    env = {**srun_task(0, tasks=1), "SLURM_NTASKS": "4"}
    assert cluster_environment(env) is None


@pytest.mark.parametrize("step", ["batch", "extern", "4294967294", "4294967291"])
def test_special_steps_are_not_srun_steps(step):
    assert cluster_environment({**srun_task(1, tasks=2), "SLURM_STEP_ID": step,
                                "SLURM_STEPID": step}) is None


def test_the_step_task_count_wins_over_the_allocation():
    env = {**srun_task(1, tasks=2), "SLURM_NTASKS": "8"}
    assert cluster_environment(env).world_size == 2


def test_srun_step_without_its_variables_is_an_error():
    env = {key: value for key, value in srun_task(0, tasks=2).items()
           if key not in ("SLURM_LOCALID",)}
    with pytest.raises(ClusterEnvironmentError, match="SLURM_LOCALID missing"):
        cluster_environment(env)


def test_torchrun_variables_win():
    env = {**batch_allocation(4), "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    rank = cluster_environment(env)
    assert (rank.launcher, rank.rank, rank.world_size) == ("torchrun", 1, 2)


# ------------------------------------------------------------ in a real kernel


def run_cells(tmp_path, *sources):
    """Execute cells in a fresh kernel (which inherits this process's environment) and
    return the text each printed."""
    notebook = new_notebook(metadata={"kernelspec": {"name": "python3", "language": "python",
                                                     "display_name": "Python 3"}})
    notebook.cells = [new_code_cell(source) for source in sources]
    NotebookClient(notebook, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    nbformat.write(notebook, tmp_path / "executed.ipynb")
    return ["".join(output.get("text", "") for output in cell.outputs
                    if output.output_type == "stream" and output.name == "stdout")
            for cell in notebook.cells]


# A cell that launches 2 ranks and reports where they and the kernel are (also run in a
# real batch job and salloc shell by tests/workbook/test_slurm.py).
WHERE_AM_I = (Path(__file__).resolve().parents[1] / "launch_scripts" / "where_am_i.py").read_text()


@pytest.mark.slow
def test_kernel_in_a_4_task_batch_allocation_starts_2_local_ranks(tmp_path, monkeypatch):
    for key, value in batch_allocation(4).items():
        monkeypatch.setenv(key, value)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_STEP_ID", "SLURM_STEPID"):
        monkeypatch.delenv(key, raising=False)
    seen = json.loads(run_cells(tmp_path, WHERE_AM_I)[0])
    assert seen["slurm"]["SLURM_NTASKS"] == "4"  # the kernel did inherit the allocation
    assert [(r["rank"], r["world"]) for r in seen["ranks"]] == [(0, 2), (1, 2)]
    assert seen["launcher"] not in {r["pid"] for r in seen["ranks"]}  # ranks of its own


def test_srun_tasks_get_torchruns_variables(monkeypatch):
    from mgpu_helpers.launcher.in_place import torchrun_variables

    env = {**srun_task(1, tasks=4), "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
           "MASTER_PORT": "29511"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    variables = torchrun_variables(cluster_environment(env))
    assert variables == {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                         "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "localhost",
                         "MASTER_PORT": "29511"}
