"""Saving and requeueing on SLURM's warning, without SLURM: the signal handler, the ranks'
agreement, the requeue command, and chapter 05's run stopped mid-epoch and resumed.
(tests/workbook/test_slurm.py runs the whole pattern on a real cluster.)"""

import os
import signal
import stat
import threading

import pytest
import torch
from torch import nn

import mgpu_helpers as mh
from mgpu_helpers.training import recipe
from mgpu_helpers.training.preemption import PreemptionNotice, requeue_job
from mgpu_helpers.training.recipe import DigitsRun, train_digits
from mgpu_helpers.training.train import train_one_epoch

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def test_the_notice_records_the_signal_and_puts_the_old_handler_back():
    before = signal.getsignal(signal.SIGUSR2)
    with PreemptionNotice("USR2") as notice:
        assert not notice.received and not notice.agreed()
        signal.raise_signal(signal.SIGUSR2)  # would end the process without the handler
        assert notice.received and notice.agreed()  # one process: its own flag
    assert signal.getsignal(signal.SIGUSR2) is before


@pytest.mark.parametrize("name", ["TERM", "SIGUSR1", "KILL", 10])
def test_signals_it_cannot_wait_for_are_refused(name):
    with pytest.raises(ValueError, match="must be one of USR1, USR2"):
        PreemptionNotice(name)


def test_the_notice_needs_the_main_thread():
    errors = []

    def enter():
        try:
            with PreemptionNotice():
                pass
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]


def signalled_on_rank_1():
    with PreemptionNotice() as notice:
        if mh.rank() == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return notice.received, notice.agreed()


def test_every_rank_agrees_when_one_got_the_signal():
    results = mh.launch(signalled_on_rank_1, nprocs=2, backend="gloo", return_all=True)
    assert results == [(False, True), (True, True)]


def fake_scontrol(folder, code):
    """An scontrol on PATH that records its arguments and exits with ``code``."""
    script = folder / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" > {folder}/called\n'
                      f'[ {code} -eq 0 ] || echo "Requested operation is presently disabled"'
                      f' >&2\nexit {code}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def test_requeue_runs_scontrol_for_this_job(tmp_path, monkeypatch):
    for name, value in fake_scontrol(tmp_path, 0).items():
        monkeypatch.setenv(name, value)
    assert requeue_job({"SLURM_JOB_ID": "4242"}) == "requeued SLURM job 4242"
    assert (tmp_path / "called").read_text().split() == ["requeue", "4242"]


def test_a_refused_requeue_says_why(tmp_path, monkeypatch):
    for name, value in fake_scontrol(tmp_path, 1).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match="scontrol requeue 7 failed: Requested operation "
                                           r"is presently disabled \(submit with sbatch "
                                           "--requeue"):
        requeue_job({"SLURM_JOB_ID": "7"})


def test_outside_slurm_nothing_is_requeued():
    assert requeue_job({}).startswith("not a SLURM job: nothing to requeue; run the same")


# ---------------------------------------------------------- stopping mid-epoch


def test_an_epoch_stopped_and_resumed_by_skipping_equals_a_whole_one():
    data = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(6)]

    def trained(pieces):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        for skip, stop_at in pieces:
            train_one_epoch(model, data, optimizer, device="cpu", progress=False,
                            accumulate=2, skip=skip,
                            stop=lambda done, at=stop_at: done == at)
        return model.weight.detach().clone()

    whole = trained([(0, None)])
    assert torch.equal(trained([(0, 2), (2, None)]), whole)
    assert torch.equal(trained([(0, 4), (4, None)]), whole)
    assert not torch.equal(trained([(0, 2), (0, None)]), whole)  # the skip matters


def test_a_skip_inside_an_accumulation_group_is_refused():
    with pytest.raises(ValueError, match="multiple of accumulate=2"):
        train_one_epoch(nn.Linear(3, 2), [], None, device="cpu", accumulate=2, skip=3)


def test_requeue_on_needs_a_checkpoint_and_a_signal_it_can_wait_for(tmp_path):
    with pytest.raises(ValueError, match="requeue_on needs a checkpoint"):
        DigitsRun(requeue_on="USR1")
    with pytest.raises(ValueError, match="must be one of USR1, USR2"):
        DigitsRun(requeue_on="TERM", checkpoint=tmp_path / "x.pt")


def warned_at_batch_2_on_rank_1(run):
    """Chapter 05's run, where rank 1 alone gets SIGUSR1 after its second batch."""
    os.environ.pop("SLURM_JOB_ID", None)  # never requeue a job these tests run in
    original = recipe.train_one_epoch

    def warned(*args, stop=None, **kwargs):
        def stop_or_warn(done):
            if done == 2 and mh.rank() == 1 and kwargs["epoch"] == 0:
                signal.raise_signal(signal.SIGUSR1)
            return stop(done)
        return original(*args, stop=stop_or_warn, **kwargs)

    recipe.train_one_epoch = warned
    return train_digits(run)


@pytest.mark.slow
def test_a_warned_run_stops_on_every_rank_saves_and_resumes_to_the_same_weights(
        digits_runs, tmp_path, capsys):
    # digits_runs (conftest): the same run uninterrupted, 4 batches a rank an epoch
    _, straight, _ = digits_runs.straight
    warned = tmp_path / "warned.pt"
    run = DigitsRun(**digits_runs.settings, checkpoint=warned, requeue_on="USR1")
    first = mh.launch(warned_at_batch_2_on_rank_1, run, nprocs=2, return_all=True)
    # Both ranks stopped after batch 2 (4 a rank an epoch), though only rank 1 was warned.
    assert [result["preempted"] for result in first] == [{"epoch": 0, "batches_done": 2}] * 2
    output = capsys.readouterr().out
    assert f"SIGUSR1: saved {warned} at epoch 0, batch 2 of 4; requeueing" in output
    assert "not a SLURM job: nothing to requeue" in output
    resumed = mh.launch(train_digits, run, nprocs=2)
    assert f"resuming from {warned} at epoch 0, batch 2" in capsys.readouterr().out
    assert resumed["test"]["samples"] == 355
    a, b = (torch.load(path, weights_only=True) for path in (straight, warned))
    assert (b["epoch"], b["extra"]["batches_done"]) == (2, 0)
    for key, value in a["model"].items():
        assert torch.equal(b["model"][key], value), key
