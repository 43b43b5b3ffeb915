"""Save and requeue when SLURM warns that a job is about to end.

A cluster ends jobs: at their time limit, or early, to make room for another (preemption).
SLURM can warn a job first. ``#SBATCH --signal=USR1@120`` sends SIGUSR1 to every task of
the job's steps 120 s before the time limit (or up to 60 s earlier: the resolution sbatch's
manual gives); ``scancel --signal=USR1 JOB`` sends it at once (by hand, or in a test). A
preemption sends it only where the site asks for it
(``SlurmctldParameters=preempt_send_user_signal``, with the job's ``--signal``). What a
training run does with the warning:

1. **Notice it without dying.** SIGUSR1's default action ends the process; a handler
   (:class:`PreemptionNotice`) only records that it came.
2. **Agree on where to stop.** The ranks get the signal at slightly different moments,
   maybe in different steps. After every optimizer step each rank adds its flag to an
   all-reduce (:meth:`PreemptionNotice.agreed`): every rank gets the same answer at the
   same step, and they stop together.
3. **Save** a checkpoint of that step (weights, optimizer, schedule, and where in the
   epoch: ``recipe.train_digits`` saves the batches done).
4. **Requeue** the job (:func:`requeue_job`: ``scontrol requeue $SLURM_JOB_ID``, from
   one rank). SLURM ends this run and queues the same job again; when it starts, the
   script finds the checkpoint and resumes. ``#SBATCH --requeue`` allows it, and
   ``--open-mode=append`` keeps the first run's log.

A job ended without warning (a node failure, ``scancel`` without ``--signal``) loses
what it trained since its last regular checkpoint; the warning makes that nothing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading

import torch
import torch.distributed as dist

#: The signals a run may be warned with: SIGTERM is not one, since SLURM sends it to end
#: every job (scancel, the time limit, the requeue itself).
NOTICE_SIGNALS = ("USR1", "USR2")


class PreemptionNotice:
    """Records a warning signal (SIGUSR1 by default) while the ``with`` block runs.

    The handler only sets a flag: the run stops at the next step boundary that every rank
    agrees on (:meth:`agreed`). Python runs signal handlers in the main thread, so the
    notice must be entered there (a script's, or a rank's started by ``mh.launch``).
    """

    def __init__(self, name: str = "USR1"):
        if name not in NOTICE_SIGNALS:
            raise ValueError(f"the warning signal must be one of {', '.join(NOTICE_SIGNALS)}"
                             f" (as in sbatch --signal=USR1@120), got {name!r}")
        self.name = name
        self.signum = getattr(signal, f"SIG{name}")
        self._received = False
        self._previous = None

    def __enter__(self) -> PreemptionNotice:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionNotice must be entered in the main thread: only "
                               "there can Python handle a signal")
        self._previous = signal.signal(self.signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(self.signum, self._previous)

    def _record(self, signum, frame) -> None:
        self._received = True

    @property
    def received(self) -> bool:
        """Whether this process got the signal."""
        return self._received

    def agreed(self, device: torch.device | None = None) -> bool:
        """Whether any rank got the signal: a collective, so every rank calls it at the
        same point (after each optimizer step) and all get the same answer there.
        ``device`` is where the group's backend reduces (the rank's GPU under NCCL); on a
        GPU, reading the answer waits for the step's kernels, a small cost per step."""
        if not (dist.is_available() and dist.is_initialized()):
            return self._received
        flag = torch.tensor([int(self._received)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def requeue_job(env=None) -> str:
    """Put this SLURM job back in the queue (``scontrol requeue``): SLURM ends the running
    job and starts it again later, with ``SLURM_RESTART_COUNT`` one higher. Returns what
    was done, in words; outside a SLURM job, requeues nothing and says to run again.

    Raises:
        RuntimeError: scontrol failed (the job was submitted without ``--requeue`` on a
            cluster whose ``JobRequeue`` is 0, for instance).
    """
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if job is None:
        return "not a SLURM job: nothing to requeue; run the same command again to resume"
    if shutil.which("scontrol") is None:
        raise RuntimeError(f"SLURM job {job}, but no scontrol on PATH to requeue it")
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                          timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"scontrol requeue {job} failed: {done.stderr.strip()} (submit "
                           "with sbatch --requeue)")
    return f"requeued SLURM job {job}"
