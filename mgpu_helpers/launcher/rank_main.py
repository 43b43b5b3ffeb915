"""What runs inside a started rank's process: its output, environment, process group, and
the outcome it sends back to the launcher."""

from __future__ import annotations

import datetime
import faulthandler
import gc
import io
import os
import pickle
import signal
import socket
import sys
import traceback

import cloudpickle
import torch
import torch.distributed as dist

from ..runtime.backend import backend_device_type
from ..runtime.group_reuse import reusing_launched_group
from ..runtime.private_apis import cuda_in_bad_fork
from ..runtime.ranks import INSIDE_RANK_VAR, RESTART_COUNT_VAR
from .rank_exit import end_rank, finish_group
from .records import ErrorReport, GroupSpec, Raised, Returned


def _as_is(value):
    """Rebuilds a value that was converted while pickling (see :class:`_HostPickler`)."""
    return value


def _as_parameter(data: torch.Tensor, requires_grad: bool) -> torch.nn.Parameter:
    return torch.nn.Parameter(data, requires_grad=requires_grad)


class _HostPickler(pickle.Pickler):
    """Pickles a rank's return value with every tensor on the CPU and detached, wherever
    it sits: in a dict, a dataclass, a module's parameters, any object.

    A CUDA tensor pickled as it is would be rebuilt on the GPU in the launching process,
    initialising CUDA there: in a notebook, every later ``launch`` would then have to
    spawn instead of fork. Parameters stay parameters (a returned module still works).
    """

    def reducer_override(self, obj):
        if isinstance(obj, torch.nn.Parameter):
            if obj.device.type == "cpu":
                return NotImplemented
            return _as_parameter, (obj.detach().cpu(), obj.requires_grad)
        if isinstance(obj, torch.Tensor) and (obj.device.type != "cpu" or obj.requires_grad):
            return _as_is, (obj.detach().cpu(),)
        return NotImplemented


def _dumps_for_host(value) -> bytes:
    buffer = io.BytesIO()
    _HostPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def _text_stream(fd: int) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw, encoding="utf-8", errors="replace", line_buffering=True)


def _become_rank(stdout_conn, stderr_conn) -> None:
    """Own session (so the launcher can kill the rank's whole process tree), own output."""
    os.setsid()
    if sys.platform.startswith("linux"):  # die with the launcher, even if it is SIGKILLed
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    os.dup2(stdout_conn.fileno(), 1)
    os.dup2(stderr_conn.fileno(), 2)
    stdout_conn.close()
    stderr_conn.close()
    sys.stdout, sys.stderr = _text_stream(1), _text_stream(2)
    if faulthandler.is_enabled():  # inherited (pytest enables it): dump into this rank's
        faulthandler.enable(file=sys.stderr, all_threads=True)  # stderr, not the parent's
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


def _loopback_interface() -> str | None:
    for _, name in socket.if_nameindex() if hasattr(socket, "if_nameindex") else ():
        if name.startswith("lo"):
            return name
    return None


def _rank_environment(rank: int, spec: GroupSpec) -> dict[str, str]:
    env = {
        "MASTER_ADDR": spec.master_addr, "MASTER_PORT": str(spec.master_port),
        "RANK": str(rank), "WORLD_SIZE": str(spec.world_size),
        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(spec.world_size),
        INSIDE_RANK_VAR: str(rank), RESTART_COUNT_VAR: str(spec.restart),
    }
    if backend_device_type(spec.backend) == "cpu":
        env["OMP_NUM_THREADS"] = str(spec.cpu_threads)  # for subprocesses the rank starts
    loopback = _loopback_interface()
    on_loopback = spec.master_addr in ("127.0.0.1", "localhost", "::1")
    if on_loopback and loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = loopback  # gloo's own sockets stay on loopback too
    return env


def join_group(rank: int, spec: GroupSpec, listener: socket.socket | None) -> None:
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if backend_device_type(spec.backend) == "cuda":
        if cuda_in_bad_fork():
            raise RuntimeError(
                "this rank was forked from a process that had initialised CUDA, so it "
                "cannot use the GPU (poisoned fork). Restart the kernel, or launch with "
                "start_method='spawn'."
            )
        torch.cuda.set_device(rank)
    store = _create_store(rank, spec, listener, timeout)
    dist.init_process_group(spec.backend, store=store, rank=rank,
                            world_size=spec.world_size, timeout=timeout)


def _create_store(rank, spec, listener, timeout) -> dist.TCPStore:
    if rank == 0:
        return dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, True,
                             timeout=timeout, master_listen_fd=listener.fileno())
    return dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, False,
                         timeout=timeout)


def run_rank(rank, spec, work, listener, result_conn, stdout_conn, stderr_conn) -> None:
    """Entry point of every launched rank (fork or spawn)."""
    # A forked rank shares its parent's memory until it writes to it, and Python's cyclic
    # garbage collector writes to every object it inspects: a rank forked from a kernel
    # or a test process holding millions of objects copied most of its parent's memory
    # on its first full collection (a launch of 2 ranks that collect, from a parent of 2
    # million dicts: 1.5 s, and 0.2 s with the freeze). Frozen, the inherited objects are
    # never inspected (still freed when no longer referenced); the rank's own are.
    gc.freeze()
    _become_rank(stdout_conn, stderr_conn)
    if listener is not None and rank != 0:
        listener.close()
    os.environ.update(_rank_environment(rank, spec))
    if backend_device_type(spec.backend) == "cpu":
        torch.set_num_threads(spec.cpu_threads)
    code = 1
    try:
        _run_and_report(rank, spec, work, listener, result_conn)
        code = 0
    except _WorkFailed:  # reported to the launcher already
        pass
    except BaseException:  # the report or the group's end failed: say it on stderr
        traceback.print_exc()
    finally:
        end_rank(code)


def _run_and_report(rank, spec, work, listener, result_conn) -> None:
    """Run the work in the group; send back its value or its error; end the group.
    Raises only when the report itself fails (or the rank's work failed: it was sent)."""
    phase = "unpickle"
    try:
        fn, args, kwargs = cloudpickle.loads(work) if isinstance(work, bytes) else work
        phase = "rendezvous"
        join_group(rank, spec, listener)
        phase = "run"
        with reusing_launched_group(fn, spec.backend, spec.world_size, rank):
            value = fn(*args, **kwargs)
        phase = "return"
        payload = _dumps_for_host(value)
    except BaseException as exc:  # reported to the launcher, which re-raises it there
        report = ErrorReport.from_exception(exc, rank, phase)
        try:
            result_conn.send_bytes(pickle.dumps(Raised(report)))
        finally:
            finish_group(clean=False, process_ends=True)
        raise _WorkFailed from None
    result_conn.send_bytes(pickle.dumps(Returned(payload)))
    finish_group(clean=True, process_ends=True)


class _WorkFailed(Exception):
    """The rank's work raised, and its report was sent: the process ends with code 1."""
