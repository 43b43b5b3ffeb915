"""Under torchrun or an srun step, launch joins the group the environment
describes (launcher/in_place.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.launching import SCRIPTS, free_port, run_script
from support.slurm_env import srun_task

import mgpu_helpers as mh
from mgpu_helpers import LaunchError, launch
from mgpu_helpers.runtime.cluster import first_slurm_host

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


# ---------------------------------------------------------------------------- clusters


@pytest.mark.slow
def test_torchrun_standalone_runs_the_function_once_per_process():
    torchrun = Path(sys.executable).with_name("torchrun")
    done = run_script(str(torchrun), "--standalone", "--nproc-per-node", "2",
                      str(SCRIPTS / "cluster.py"))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("pid"))
    assert len(lines) == 2, done.stdout
    assert [line.split(" rank ")[1] for line in lines] == ["0 world 2 sum 2",
                                                          "1 world 2 sum 2"]


@pytest.mark.slow
def test_simulated_slurm_step_derives_ranks_from_slurm_variables():
    port = str(free_port())
    tasks = [subprocess.Popen(
        [sys.executable, str(SCRIPTS / "cluster.py")],
        env={**os.environ, **srun_task(task, tasks=2), "MASTER_PORT": port},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for task in range(2)]
    outputs = [task.communicate(timeout=120) for task in tasks]
    for task, (out, err) in zip(tasks, outputs, strict=True):
        assert task.returncode == 0, out + err
    assert sorted(out.split(" rank ")[1].strip() for out, _ in outputs) == [
        "0 world 2 sum 2", "1 world 2 sum 2"]


def test_partial_torchrun_variables_are_listed(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(LaunchError, match="RANK set but WORLD_SIZE, LOCAL_RANK missing"):
        launch(mh.rank, nprocs=2)


def test_partial_slurm_variables_are_listed(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    for name in ("SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
                 "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LaunchError, match="SLURM_LOCALID, SLURM_JOB_NODELIST missing"):
        launch(mh.rank, nprocs=2)


@pytest.mark.parametrize(("nodelist", "first"), [
    ("node7", "node7"), ("gpu[03-05,09]", "gpu03"), ("a1,b2", "a1"), ("x[1,4],y", "x1"),
    ("a1,b[2-3]", "a1")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


