"""Shared fixtures: no test may leave a process behind. Tests start with make's flags
removed from the environment."""

import os
import time

import psutil
import pytest


def _is_resource_tracker(process: psutil.Process) -> bool:
    """multiprocessing's resource tracker: started by the first spawned child, it serves
    this test process until it exits. It is not a rank or a worker left behind."""
    return any("multiprocessing.resource_tracker" in part for part in process.cmdline())


def child_pids() -> list[int]:
    """Live (non-zombie) processes whose parent is this test process (Linux and macOS)."""
    found = []
    for child in psutil.Process().children(recursive=False):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and not _is_resource_tracker(child):
                found.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


# Some tests run `make lab`, `make nbval`... themselves. Under `make test` the parent
# make's flags (its jobserver, --output-sync) would reach those runs: output held back
# until JupyterLab exits, and "jobserver unavailable" warnings. Each test's make starts
# as if typed at a shell.
for variable in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"):
    os.environ.pop(variable, None)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Work in this process on one thread, as in the notebooks (tests/notebook.env) and
    in every rank: the two lanes of `make test` share 2 cores, where a second intra-op
    thread made in-process trainings and checks several times slower, up to 50 times."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_leftover_processes():
    yield
    deadline = time.monotonic() + 5
    while child_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert child_pids() == [], "a test left child processes running"


# ------------------------------------------------- chapter 05's run, shared by its tests

#: Chapter 05's run (mgpu_helpers.training.recipe.train_digits) at test size: on 2 ranks, 4
#: optimizer steps an epoch (32 images a rank, micro-batches of 8), 2 epochs.
DIGITS_QUICK = {"epochs": 2, "limit": 64, "global_batch": 16, "progress": False}


@pytest.fixture(scope="session")
def digits_ready():
    """The digits tree, written once before any test's ranks start. Building it imports
    scikit-learn here, once: ranks forked by launch() inherit the import."""
    from mgpu_helpers.data import prepare_digits

    return prepare_digits(progress=False)


@pytest.fixture(scope="session")
def digits_runs(tmp_path_factory, digits_ready):
    """Two runs of chapter 05's recipe on 2 ranks with DIGITS_QUICK, shared by the tests
    of exact resume (test_recipe, test_preemption, test_ablation):

    * ``straight``: uninterrupted, verbose, evaluating every epoch;
    * ``first``: stopped after epoch 0 (``stop_after=1``), quiet (``verbose=False``,
      ``evaluate_every_epoch=False``).

    Each is ``(result, checkpoint, printed)``: ``printed`` is what its ranks wrote (the
    launcher relays it to sys.stdout/stderr). The checkpoints are the runs' own: copy one
    before resuming from it."""
    import contextlib
    import io
    from types import SimpleNamespace

    from mgpu_helpers import launch
    from mgpu_helpers.training.recipe import DigitsRun, train_digits

    folder = tmp_path_factory.mktemp("digits_runs")

    def run(name, **settings):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            result = launch(train_digits, DigitsRun(**DIGITS_QUICK, **settings,
                                                    checkpoint=folder / f"{name}.pt"), nprocs=2)
        return result, folder / f"{name}.pt", printed.getvalue()

    return SimpleNamespace(settings=dict(DIGITS_QUICK), straight=run("straight"),
                           first=run("first", stop_after=1, verbose=False,
                                     evaluate_every_epoch=False))
