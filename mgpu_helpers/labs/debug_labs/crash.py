"""Lab 4, a rank that crashes mid-epoch: killed with ``SIGKILL`` as a training epoch
starts, as an out-of-memory kill or a lost node kills it, on the first attempt only.

The crash wraps :func:`mgpu_helpers.training.recipe.train_digits` from outside (the recipe has no
switch for it): chapter 09 and the tests call :func:`train_digits_with_a_crash`, and
``tests/launch_scripts/train_ddp_crash_once.py`` runs ``scripts/train_ddp.py`` under
:func:`rank_killed_at_epoch`.
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

from ...runtime.ranks import rank, restart_count
from ...training import recipe


@contextmanager
def rank_killed_at_epoch(epoch: int, victim: int = 1):
    """Inside a rank: while active, rank ``victim`` of
    :func:`~mgpu_helpers.training.recipe.train_digits` kills itself with SIGKILL as it
    starts training epoch ``epoch``, as a rank dies of an out-of-memory kill or a lost
    node: no exception, no report, no cleanup. Only on the
    first attempt: ranks restarted (``launch(max_restarts=...)``, torchrun) train on."""
    train_one_epoch = recipe.train_one_epoch

    def dying(*args, **kwargs):
        if kwargs.get("epoch") == epoch and rank() == victim and restart_count() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return train_one_epoch(*args, **kwargs)

    recipe.train_one_epoch = dying
    try:
        yield
    finally:
        recipe.train_one_epoch = train_one_epoch


def train_digits_with_a_crash(run: recipe.DigitsRun, epoch: int = 1, victim: int = 1) -> dict:
    """:func:`~mgpu_helpers.training.recipe.train_digits`, with rank ``victim`` killed as epoch
    ``epoch`` starts (see :func:`rank_killed_at_epoch`)."""
    with rank_killed_at_epoch(epoch, victim):
        return recipe.train_digits(run)
