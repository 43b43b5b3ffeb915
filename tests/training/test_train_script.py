"""scripts/train_ddp.py: the same run by launch() and by torchrun, and surviving a killed rank."""

import contextlib
import io
import json
import os
import runpy
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.slurm_env import srun_task

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "train_ddp.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# The script with rank 1 killed as epoch 1 starts, on torchrun's first attempt only.
CRASH_ONCE = str(ROOT / "tests" / "launch_scripts" / "train_ddp_crash_once.py")
# 2 epochs of 2 steps on 2 ranks (16 images a rank a step)
QUICK = ["--epochs", "2", "--limit", "64", "--global-batch", "32"]

pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.slow]


def run(command, timeout=300):
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def weights(path):
    return torch.load(path, weights_only=True)["model"]


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def script_main():
    """scripts/train_ddp.py's main(argv), run in this process."""
    return runpy.run_path(SCRIPT)["main"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, digits_ready):
    """The reference run: the script's main from a plain process (this one), which
    launches its own ranks, as `python scripts/train_ddp.py --nprocs 2` in the README.
    (The tests below run the script as __main__ in processes of their own.)"""
    checkpoint = tmp_path_factory.mktemp("runs") / "launched.pt"
    printed = io.StringIO()  # the launcher writes the ranks' lines to sys.stdout/stderr
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        script_main()(["--nprocs", "2", *QUICK, "--checkpoint", str(checkpoint)])
    output = printed.getvalue()
    assert "epoch 1: train" in output and "test loss" in output
    return checkpoint


def test_launch_from_a_plain_process_trains_two_epochs_on_two_ranks(uninterrupted):
    state = torch.load(uninterrupted, weights_only=True)
    assert (state["epoch"], state["world_size"]) == (2, 2)


def test_torchrun_restarts_a_killed_rank_resumes_and_matches_the_uninterrupted_run(
        uninterrupted, tmp_path):
    # torchrun --standalone, as on one node; a rank killed in epoch 1 takes the group
    # down, torchrun restarts both, and they resume from epoch 0's checkpoint.
    checkpoint = tmp_path / "restarted.pt"
    output = run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                  CRASH_ONCE, *QUICK, "--checkpoint", str(checkpoint)])
    assert "resuming from" in output and "at epoch 1" in output
    state = torch.load(checkpoint, weights_only=True)
    assert (state["epoch"], state["world_size"]) == (2, 2)
    assert_same_weights(state["model"], weights(uninterrupted))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Bitwise equality needs the same intra-op thread count as the other runs: torchrun sets
# OMP_NUM_THREADS=1 only when it starts several processes per node, launch() uses 1.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def run_together(commands, envs, timeout=300):
    """Start one process per (command, env) at once, like nodes or SLURM tasks."""
    processes = [subprocess.Popen(command, env={**os.environ, **env}, cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for command, env in zip(commands, envs, strict=True)]
    try:
        outputs = [process.communicate(timeout=timeout)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
            process.wait()
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 0, output[-3000:]
    return outputs


def test_two_torchrun_nodes_on_localhost_give_the_same_weights(uninterrupted, tmp_path):
    # Also the launcher's multi-node test: launch() under torchrun runs the function once
    # per process (a second set of ranks would change the weights and the printing).
    checkpoint, result = tmp_path / "nodes.pt", tmp_path / "nodes.json"
    endpoint = f"127.0.0.1:{free_port()}"
    commands = [[TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "nodes",
                 "--master-addr", "127.0.0.1", SCRIPT, *QUICK, "--checkpoint", str(checkpoint),
                 "--result", str(result)] for node in range(2)]
    outputs = run_together(commands, [ONE_THREAD, ONE_THREAD])
    assert sum("test loss" in output for output in outputs) == 1  # printed by rank 0 only
    assert_same_weights(weights(checkpoint), weights(uninterrupted))
    assert json.loads(result.read_text())["test"]["samples"] == 355


def test_simulated_slurm_step_gives_the_same_weights(uninterrupted, tmp_path):
    checkpoint = tmp_path / "slurm.pt"
    command = [sys.executable, SCRIPT, *QUICK, "--checkpoint", str(checkpoint)]
    port = str(free_port())
    envs = [{**ONE_THREAD, **srun_task(task, tasks=2), "MASTER_PORT": port} for task in (0, 1)]
    run_together([command, command], envs)
    assert_same_weights(weights(checkpoint), weights(uninterrupted))


def test_bad_options_are_refused_before_anything_starts(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        script_main()(["--accumulate", "0", "--nprocs", "2",
                       "--checkpoint", str(tmp_path / "never.pt")])
    assert exited.value.code == 2  # argparse's refusal, before launch starts a rank
    assert "accumulate must be a whole number >= 1" in capsys.readouterr().err
    assert not (tmp_path / "never.pt").exists()
