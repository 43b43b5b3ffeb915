"""``launch()``: checks its arguments, then runs in place (torchrun, srun) or starts
ranks on this machine."""

from __future__ import annotations

import contextlib
import errno
import importlib
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading

import cloudpickle

from ..runtime.cluster import ClusterEnvironmentError, cluster_environment
from ..runtime.devices import count_gpus, gpu_count
from .checks import (
    check_callable,
    check_count,
    check_no_group_in_this_process,
    check_not_inside_rank,
    check_port,
    check_positive_int,
    check_seconds,
    resolve_backend,
    resolve_nprocs,
    resolve_start_method,
)
from .failure import LaunchError
from .in_place import run_in_this_process
from .supervisor import run_ranks

DEFAULT_TIMEOUT_S = 60.0

#: What a rank imports on its first DDP or FSDP step, whatever it trains: DDP and FSDP2
#: consult the compiler (``torch._dynamo``, about 900 modules) on their first call.
#: Imported once here, before forking, every forked rank inherits it instead of importing
#: it again: 1.2 s of CPU a rank and a launch on a 2-core CPU. The import starts no thread
#: and asks nothing of CUDA, so forking after it stays safe.
RANK_IMPORTS = ("torch._dynamo",)


def _import_for_forked_ranks() -> None:
    """Import :data:`RANK_IMPORTS` here, leaving this process's environment as it was
    (importing the compiler sets TORCHINDUCTOR_CACHE_DIR to the default that PyTorch
    computes again wherever it is unset)."""
    if all(name in sys.modules for name in RANK_IMPORTS):
        return
    environment = dict(os.environ)
    with _interrupts_deferred():
        for name in RANK_IMPORTS:
            importlib.import_module(name)
    for key in set(os.environ) - set(environment):
        del os.environ[key]
    for key, value in environment.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@contextlib.contextmanager
def _interrupts_deferred():
    """Hold back Ctrl+C (Jupyter's stop button) until the block has finished, then deliver
    it to the handler it was meant for. An import cut by ``KeyboardInterrupt`` leaves
    modules half-initialised in ``sys.modules`` (``torch._dynamo`` failed with "module
    'sympy' has no attribute 'logic'"), and every later launch in that kernel failed or
    hung. Python runs signal handlers in the main thread only, so elsewhere the block runs
    as it is; so it does where the handler was not set from Python (it cannot be put
    back)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is None):
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)


#: Why GPUs are unusable, as already told on stderr by this process (told once each).
_told_no_gpu: set[str] = set()


def _resolve_on_this_machine(backend: str, nprocs: int | None) -> tuple[str, int]:
    """The backend and rank count on the GPUs ``describe()`` plans with: those CUDA can
    start on (``count_gpus``). Where the driver lists GPUs CUDA cannot start on,
    ``backend="auto"`` runs CPU ranks over gloo, as the plan does, and says so once."""
    gpus = count_gpus()
    reason = gpu_count().problem if gpus == 0 else None
    resolved = resolve_backend(backend, gpus, no_gpu_reason=reason)
    nprocs = resolve_nprocs(nprocs, resolved, gpus)
    if reason and backend == "auto" and reason not in _told_no_gpu:
        _told_no_gpu.add(reason)
        print(f"[launch] this machine has GPUs, but CUDA cannot start on them: {reason} "
              "Ranks run on the CPU over gloo; `python -m mgpu_helpers` says how to fix it.",
              file=sys.stderr, flush=True)
    return resolved, nprocs


def _listen(addr: str, port: int | None) -> socket.socket:
    """Bind and listen on the rendezvous port here, so no other program can take it."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((addr, port or 0))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise LaunchError(
                f"master_port={port} on {addr} is already in use by another program (or an "
                "earlier launch still running). Pass master_port=None to pick a free port, "
                "or free that port."
            ) from None
        raise LaunchError(f"cannot listen on {addr}:{port or 0}: {exc}") from None
    return sock


def launch(fn, *args, nprocs: int | None = None, backend: str = "auto",
           start_method: str = "auto", master_addr: str = "127.0.0.1",
           master_port: int | None = None, timeout: float = DEFAULT_TIMEOUT_S,
           join_timeout: float | None = None, return_all: bool = False,
           cpu_threads: int = 1, max_restarts: int = 0, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` ranks and return rank 0's value.

    Args:
        fn: the function every rank runs; may be defined in a notebook cell. Inside it,
            ``mgpu_helpers.rank()``, ``world_size()``, ``device()``... tell where it runs;
            the process group is ready before it starts and destroyed after it returns.
        nprocs: number of ranks; None means one per visible GPU (required without GPUs).
        backend: "auto": with GPUs, one per rank and a group that moves CUDA tensors
            over NCCL and CPU tensors over gloo ("cpu:gloo,cuda:nccl"); without GPUs,
            CPU ranks over gloo. "gloo": CPU ranks on every machine, for checks that
            must behave identically everywhere. "nccl": NCCL only (CUDA tensors only).
        start_method: "auto" (fork on Linux when CUDA is untouched, else spawn), "fork",
            "spawn" or "forkserver". Under spawn, fn and its arguments travel with
            cloudpickle, so notebook functions work there too.
        master_addr: rendezvous address; loopback by default (single machine).
        master_port: rendezvous port; None picks a free one.
        timeout: seconds a collective may wait before the process group gives up.
        join_timeout: seconds the whole run may take; then every rank is killed and
            TimeoutError shows where each one was. None waits for as long as it takes.
        return_all: return every rank's value, in rank order, instead of rank 0's.
        cpu_threads: intra-op threads per rank with gloo (one core per simulated GPU).
        max_restarts: when a rank fails, stop every rank and start them all again, up to
            this many times, as ``torchrun --max-restarts`` does (a run that saves
            checkpoints resumes from its last one). Each restart is reported on stderr;
            inside the ranks, ``mgpu_helpers.restart_count()`` says which attempt runs.
            ``join_timeout`` is never restarted: it bounds each attempt. Under torchrun
            or an srun step nothing is started here, so restarts are theirs to make.

    Returns:
        Rank 0's return value (a list of all ranks' values with ``return_all=True``),
        with every tensor in it moved to the CPU and detached (also inside dataclasses,
        modules and other objects). Under torchrun or an srun step: this process's value.

    Raises:
        LaunchError: a rank failed (the message starts with "rank k failed: ...") or the
            launch could not start. TimeoutError: join_timeout expired.
    """
    check_callable(fn)
    check_not_inside_rank()
    check_no_group_in_this_process()
    check_seconds("timeout", timeout)
    check_seconds("join_timeout", join_timeout, allow_none=True)
    check_positive_int("cpu_threads", cpu_threads)
    check_count("max_restarts", max_restarts)
    check_port(master_port)
    try:
        cluster = cluster_environment()
    except ClusterEnvironmentError as exc:
        raise LaunchError(str(exc)) from None
    if cluster is not None:
        return run_in_this_process(fn, args, kwargs, cluster, backend, timeout)

    backend, nprocs = _resolve_on_this_machine(backend, nprocs)
    method = resolve_start_method(start_method)
    ctx = mp.get_context(method)
    if method == "fork":
        _import_for_forked_ranks()
        work = (fn, args, kwargs)
    else:
        try:
            work = cloudpickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise LaunchError(
                f"cannot send the function or its arguments to spawned ranks: "
                f"{type(exc).__name__}: {exc}. Arguments must be picklable (no open files, "
                "locks or generators); create such objects inside the function instead."
            ) from exc
    spec_args = {"world_size": nprocs, "backend": backend, "master_addr": master_addr,
                 "timeout_s": float(timeout), "cpu_threads": cpu_threads}
    for restart in range(max_restarts + 1):
        # The rendezvous port is bound here, before any rank starts, and handed to rank
        # 0's store: no other program can take it in between.
        listener = _listen(master_addr, master_port)
        try:
            return run_ranks(ctx, nprocs, {**spec_args, "restart": restart}, work, listener,
                             join_timeout, return_all)
        except LaunchError as exc:
            if restart == max_restarts:
                raise
            print(f"[launch] {str(exc).splitlines()[0]}; every rank stopped, starting them "
                  f"again (restart {restart + 1} of {max_restarts})", file=sys.stderr,
                  flush=True)
    raise AssertionError("unreachable")
