"""scripts/train_ddp.py: the same run by launch() and by torchrun, and surviving a killed rank."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "scripts" / "train_ddp.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
QUICK = ["--epochs", "2", "--limit", "128", "--batch-size", "32"]

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


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


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("runs") / "straight.pt"
    output = run([TORCHRUN, "--standalone", "--nproc-per-node", "2", SCRIPT, *QUICK,
                  "--checkpoint", str(checkpoint)])
    assert "epoch 1: train" in output and "test loss" in output
    return checkpoint


def test_torchrun_standalone_trains_two_epochs(uninterrupted):
    state = torch.load(uninterrupted, weights_only=True)
    assert (state["epoch"], state["world_size"]) == (2, 2)


def test_launch_from_a_plain_process_gives_the_same_weights(uninterrupted, tmp_path):
    checkpoint = tmp_path / "launched.pt"
    run([sys.executable, SCRIPT, "--nprocs", "2", *QUICK, "--checkpoint", str(checkpoint)])
    assert_same_weights(weights(checkpoint), weights(uninterrupted))


def test_killed_rank_restarts_resumes_and_matches_the_uninterrupted_run(uninterrupted,
                                                                         tmp_path):
    checkpoint = tmp_path / "restarted.pt"
    output = run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                  SCRIPT, *QUICK, "--checkpoint", str(checkpoint),
                  "--die-at-epoch", "1", "--die-rank", "1"])
    assert "resuming from" in output and "at epoch 1" in output
    assert_same_weights(weights(checkpoint), weights(uninterrupted))
