"""The launcher: run a function on N ranks, from a notebook cell, a script, torchrun or SLURM.

``launch(train, nprocs=2)`` starts one process per rank, joins them in a process group,
runs ``train()`` in each and returns rank 0's result. It is written for notebooks:

* functions defined in a cell work (fork needs no pickling; spawn uses cloudpickle);
* it refuses to fork a process that has touched CUDA, and says what to do;
* the rendezvous port is bound by the launcher itself on 127.0.0.1, so it cannot collide;
* the first failing rank is reported with its traceback, and the others are stopped;
* output of every rank reaches the cell line by line, prefixed ``[rank k]``;
* a failure, a timeout or an interrupted cell stops every rank the same way (SIGTERM, a
  short grace, SIGKILL) and reaps them, also when starting the ranks fails.

Under ``torchrun`` (or as a task of a multi-task ``srun`` step) the same call starts
nothing: it joins the group described by the environment, runs the function once and
returns its value. A notebook kernel inside a SLURM allocation is not such a task: it
starts its own ranks (see ``cluster``). Code written for torchrun, which creates its
group itself, runs unchanged (see ``group_reuse``).

Its parts, one job each:

* :mod:`.api`: :func:`launch` itself, and where its arguments go;
* :mod:`.checks`: argument checks, and the backend, rank count and start method a launch
  resolves to;
* :mod:`.records`: what both sides of the fork share (group spec, a rank's outcome, its error);
* :mod:`.streams`: flushing output, by a rank before it exits and the launcher before it forks;
* :mod:`.rank_main`: what runs in a started rank's process (environment, group, its outcome);
* :mod:`.rank_exit`: how a rank's process ends (its group, threads, output, ``os._exit``);
* :mod:`.rank_handle`: the launcher's handle on one started rank (its output, its end);
* :mod:`.supervisor`: starting the ranks, watching them, stopping them all;
* :mod:`.failure`: the error a failed launch raises, root cause first, with advice;
* :mod:`.in_place`: under torchrun or an ``srun`` step, run in this process instead.

Imports run one way (``tests/workbook/test_layout.py`` checks it): ``records`` and ``streams``
import no other part, and both sides of the fork import them.
"""

from .api import DEFAULT_TIMEOUT_S, launch
from .checks import BACKENDS, resolve_backend, resolve_nprocs
from .failure import LaunchError

__all__ = ["BACKENDS", "DEFAULT_TIMEOUT_S", "LaunchError", "launch", "resolve_backend",
           "resolve_nprocs"]
