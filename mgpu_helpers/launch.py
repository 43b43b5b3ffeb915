"""Run a function on N ranks, from a notebook cell, a script, torchrun or SLURM.

``launch(train, nprocs=2)`` starts one process per rank, joins them in a process group,
runs ``train()`` in each and returns rank 0's result. It is written for notebooks:

* functions defined in a cell work (fork needs no pickling; spawn uses cloudpickle);
* it refuses to fork a process that has touched CUDA, and says what to do;
* the rendezvous port is bound by the launcher itself on 127.0.0.1, so it cannot collide;
* the first failing rank is reported with its traceback, and the others are stopped;
* output of every rank reaches the cell line by line, prefixed ``[rank k]``;
* a timeout or an interrupted cell kills and reaps every rank.

Under ``torchrun`` (or as a task of a multi-task ``srun`` step) the same call starts
nothing: it joins the group described by the environment, runs the function once and
returns its value. A notebook kernel inside a SLURM allocation is not such a task: it
starts its own ranks (see ``cluster``). Code written for torchrun, which creates its
group itself, runs unchanged (see ``group_reuse``).
"""

from __future__ import annotations

import datetime
import errno
import faulthandler
import io
import multiprocessing as mp
import os
import pickle
import selectors
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field

import cloudpickle
import torch
import torch.distributed as dist

from .cluster import ClusterEnvironmentError, ClusterRank, cluster_environment, elastic_store
from .dist import gpu_index
from .env import auto_backend, backend_device_type, count_gpus, cuda_driver_loaded
from .group_reuse import reusing_launched_group

DEFAULT_TIMEOUT_S = 60.0
TERMINATE_GRACE_S = 2.0
# After an error that only says a peer went away ("Connection closed by peer"), how long
# to wait for that peer's own report (the root cause) before stopping every rank.
PEER_REPORT_GRACE_S = 1.5
PORT_ATTEMPTS = 3
STACK_DUMP_WAIT_S = 1.5
INSIDE_RANK_VAR = "MGPU_LAUNCH_RANK"
BACKENDS = ("auto", "gloo", "nccl", "cpu:gloo,cuda:nccl")


class LaunchError(RuntimeError):
    """A rank failed, or the launch could not start. The message starts with the cause."""


class _PortInUse(Exception):
    """Rank 0 could not listen on the rendezvous port (retried with another port)."""


# --------------------------------------------------------------------------- checks


def _check_callable(fn) -> None:
    if not callable(fn):
        raise TypeError(
            f"launch() needs a function to run on every rank, got {type(fn).__name__}. "
            "Likely cause: the function was called instead of passed, as in "
            "launch(train()). Pass it uncalled: launch(train, arg1, ...)."
        )


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_seconds(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _check_not_inside_rank() -> None:
    inside = os.environ.get(INSIDE_RANK_VAR)
    if inside is not None:
        raise LaunchError(
            f"launch() was called from inside rank {inside} of a running launch. "
            "Ranks cannot start ranks: call the function directly inside the rank, or "
            "call launch() only from the notebook or the script's top level."
        )


def _check_no_group_in_this_process() -> None:
    if dist.is_available() and dist.is_initialized():
        raise LaunchError(
            "a process group is already initialised in this process, so launch() would "
            "start ranks that cannot join it. Call dist.destroy_process_group() first, or "
            "restart the kernel."
        )


def resolve_backend(backend: str, gpus: int, nccl_available: bool | None = None) -> str:
    """The process-group backend a launch with ``backend`` uses on a machine with
    ``gpus`` visible GPUs: ``"auto"`` is NCCL for CUDA tensors plus gloo for CPU tensors
    (``"cpu:gloo,cuda:nccl"``) with GPUs, else gloo; ``"gloo"`` is gloo everywhere."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, "
                         f"got {backend!r}")
    nccl_available = dist.is_nccl_available() if nccl_available is None else nccl_available
    if backend == "auto":
        return auto_backend(gpus, nccl_available)
    if backend_device_type(backend) == "cuda":
        if not nccl_available:
            raise LaunchError(f"backend={backend!r} but this PyTorch build has no NCCL; "
                              "use 'gloo' or 'auto'")
        if gpus == 0:
            raise LaunchError(
                f"backend={backend!r} needs GPUs and none is visible here (check "
                "CUDA_VISIBLE_DEVICES and `python -m mgpu_helpers`); use backend='auto' (CPU "
                "ranks over gloo where there is no GPU) or backend='gloo'"
            )
    return backend


def resolve_nprocs(nprocs, backend: str, gpus: int) -> int:
    """How many ranks: ``nprocs``, or one per GPU when it is None; GPU ranks need a GPU
    each. ``backend`` is the resolved one (:func:`resolve_backend`)."""
    if nprocs is None:
        if gpus == 0 or backend_device_type(backend) != "cuda":
            raise ValueError(
                "nprocs=None means one rank per GPU, and this launch has no GPU to count "
                f"(backend {backend!r}, {gpus} GPU(s) visible). Say how many ranks to run "
                "as CPU processes, e.g. launch(fn, nprocs=2)."
            )
        return gpus
    _check_positive_int("nprocs", nprocs)
    if backend_device_type(backend) == "cuda" and nprocs > gpus:
        raise LaunchError(
            f"nprocs={nprocs} GPU ranks need {nprocs} GPUs, but {gpus} "
            f"{'is' if gpus == 1 else 'are'} visible. Use nprocs<={gpus} (the plan of "
            "mgpu_helpers.describe() gives one rank per GPU), or backend='gloo' for CPU ranks."
        )
    return nprocs


def _resolve_start_method(start_method: str) -> str:
    available = mp.get_all_start_methods()
    if start_method not in ("auto", "fork", "spawn", "forkserver"):
        raise ValueError(
            f"start_method must be 'auto', 'fork', 'spawn' or 'forkserver', got {start_method!r}"
        )
    if start_method == "auto":
        safe_platform = sys.platform.startswith("linux") and "fork" in available
        return "fork" if safe_platform and not cuda_driver_loaded() else "spawn"
    if start_method not in available:
        raise LaunchError(f"start_method={start_method!r} is not available on {sys.platform}; "
                          "use 'spawn'")
    if start_method == "fork" and cuda_driver_loaded():
        raise LaunchError(
            "refusing to fork: CUDA is already initialised in this process, and forked "
            "children cannot use it. Likely cause: an earlier call such as "
            "torch.cuda.is_available(), torch.cuda.device_count(), tensor.cuda() / "
            ".to('cuda') or nn.DataParallel. Restart the kernel and launch before touching "
            "CUDA (mgpu_helpers.describe() is safe), or pass start_method='spawn'."
        )
    return start_method


def _check_port(port) -> None:
    if port is None:
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"master_port must be an int in 1..65535 or None, got {port!r}")


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


def _loopback_interface() -> str | None:
    for _, name in socket.if_nameindex() if hasattr(socket, "if_nameindex") else ():
        if name.startswith("lo"):
            return name
    return None


# ------------------------------------------------------------------- inside a rank


@dataclass(frozen=True)
class _GroupSpec:
    world_size: int
    backend: str
    master_addr: str
    master_port: int
    timeout_s: float
    cpu_threads: int


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


def _rank_environment(rank: int, spec: _GroupSpec) -> dict[str, str]:
    env = {
        "MASTER_ADDR": spec.master_addr, "MASTER_PORT": str(spec.master_port),
        "RANK": str(rank), "WORLD_SIZE": str(spec.world_size),
        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(spec.world_size),
        INSIDE_RANK_VAR: str(rank),
    }
    if backend_device_type(spec.backend) == "cpu":
        env["OMP_NUM_THREADS"] = str(spec.cpu_threads)  # for subprocesses the rank starts
    loopback = _loopback_interface()
    on_loopback = spec.master_addr in ("127.0.0.1", "localhost", "::1")
    if on_loopback and loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = loopback  # gloo's own sockets stay on loopback too
    return env


def _join_group(rank: int, spec: _GroupSpec, listener: socket.socket | None) -> None:
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if backend_device_type(spec.backend) == "cuda":
        if torch.cuda._is_in_bad_fork():
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


def _report_exception(exc: BaseException, rank: int, phase: str) -> dict:
    return {
        "rank": rank, "phase": phase, "failed_at": time.time(),
        "type": type(exc).__name__, "message": str(exc).strip(),
        "traceback": "".join(traceback.format_exception(exc)),
    }


def _finish_group(clean: bool) -> None:
    if dist.is_available() and dist.is_initialized():
        if clean:
            dist.barrier()  # no rank tears down the store while another still needs it
        dist.destroy_process_group()


def _rank_main(rank, spec, work, listener, result_conn, stdout_conn, stderr_conn) -> None:
    """Entry point of every launched rank (fork or spawn)."""
    _become_rank(stdout_conn, stderr_conn)
    if listener is not None and rank != 0:
        listener.close()
    os.environ.update(_rank_environment(rank, spec))
    if backend_device_type(spec.backend) == "cpu":
        torch.set_num_threads(spec.cpu_threads)
    phase = "unpickle"
    try:
        fn, args, kwargs = cloudpickle.loads(work) if isinstance(work, bytes) else work
        phase = "rendezvous"
        _join_group(rank, spec, listener)
        phase = "run"
        with reusing_launched_group(fn, spec.backend, spec.world_size, rank):
            value = fn(*args, **kwargs)
        phase = "return"
        payload = _dumps_for_host(value)
    except BaseException as exc:  # reported to the launcher, which re-raises it there
        report = _report_exception(exc, rank, phase)
        result_conn.send_bytes(pickle.dumps(("error", report)))
        try:
            _finish_group(clean=False)
        finally:
            sys.exit(1)
    result_conn.send_bytes(pickle.dumps(("ok", payload)))
    _finish_group(clean=True)


# --------------------------------------------------------------- in the launcher


@dataclass
class _Rank:
    index: int
    process: mp.process.BaseProcess
    result_conn: object
    stdout_conn: object
    stderr_conn: object
    partial: dict = field(default_factory=lambda: {"stdout": b"", "stderr": b""})
    outcome: tuple | None = None  # ("ok", bytes) or ("error", report dict)
    exited_at: float | None = None
    stopped: bool = False  # the launcher signalled it while it still ran
    capture: list[str] | None = None  # collects stderr lines while dumping stacks

    def signal_tree(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(self.process.pid, signum)
            except ProcessLookupError:
                pass

    def kill_leftovers(self) -> None:
        """Kill what the rank started and left behind (its session outlives it)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def emit(self, stream: str, data: bytes) -> None:
        """Print complete lines; pass on a progress bar's carriage-return updates live.

        A ``\r`` means "overwrite the current line" (tqdm redraws its bar that way), so
        only the text after a line's last ``\r`` is kept, and an unfinished line whose
        latest update is complete is shown with ``end="\r"``, to be overwritten.
        """
        buffered = self.partial[stream] + data
        *lines, rest = buffered.split(b"\n")
        for line in lines:
            self._print(stream, line.rsplit(b"\r", 1)[-1].decode("utf-8", errors="replace"))
        if b"\r" in rest:
            updates = rest.split(b"\r")
            latest = next((u for u in reversed(updates[:-1]) if u.strip()), b"")
            if latest:
                self._print(stream, latest.decode("utf-8", errors="replace"), end="\r")
            rest = updates[-1]
        self.partial[stream] = rest

    def flush_partial(self) -> None:
        for stream, rest in self.partial.items():
            if rest.strip():
                self._print(stream, rest.decode("utf-8", errors="replace"))
            self.partial[stream] = b""

    def _print(self, stream: str, text: str, end: str = "\n") -> None:
        if self.capture is not None and stream == "stderr":
            self.capture.append(text)
            return
        print(f"[rank {self.index}] {text}", file=getattr(sys, stream), end=end, flush=True)

    def describe_end(self) -> str:
        code = self.process.exitcode
        if self.outcome and self.outcome[0] == "error":
            report = self.outcome[1]
            return f"{report['type']}: {_first_line(report['message'])}"
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        if self.outcome is None:
            return f"exited with code {code} without returning a result"
        return "finished normally"


_COLLATERAL_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _is_collateral(report: dict) -> bool:
    """A peer that gave up (a timeout, a crash) closes its connections: the others then
    fail with "Connection closed by peer", often a moment before the peer's own report.
    Such an error is never taken for the root cause while another exists."""
    return any(text in report["message"] for text in _COLLATERAL_ERRORS)


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


_ADVICE = [
    (("Cannot re-initialize CUDA in forked subprocess", "poisoned fork"),
     "CUDA was initialised in the launching process before it forked. Restart the kernel "
     "and avoid torch.cuda calls before launch(), or pass start_method='spawn'."),
    (("address already in use", "EADDRINUSE"),
     "Another program holds the rendezvous port. Pass master_port=None to pick a free one."),
    (("pickle", "Pickling"),
     "Everything sent between processes must be picklable: return plain data (numbers, "
     "tensors, dicts, lists), not open files, locks, generators or lambdas."),
    (("timed out", "Timed out", "Timeout"),
     "A collective waited longer than `timeout`: usually one rank skipped a collective the "
     "others entered, or a rank is far slower. TORCH_DISTRIBUTED_DEBUG=DETAIL names the "
     "collective each rank is in."),
]


def _advice_for(text: str) -> str:
    for needles, advice in _ADVICE:
        if any(n in text for n in needles):
            return advice
    return ""


class _Supervisor:
    """Drains output and results of every rank, and stops them all on the first failure."""

    def __init__(self, ranks: list[_Rank], join_timeout: float | None):
        self.ranks = ranks
        self.deadline = None if join_timeout is None else time.monotonic() + join_timeout
        self.join_timeout = join_timeout
        self.kill_at: float | None = None
        self.term_at: float | None = None  # when to stop the ranks, after a collateral error
        self.failed = False
        self.selector = selectors.DefaultSelector()
        for rank in ranks:
            self.selector.register(rank.result_conn, selectors.EVENT_READ, ("result", rank))
            self.selector.register(rank.stdout_conn, selectors.EVENT_READ, ("stdout", rank))
            self.selector.register(rank.stderr_conn, selectors.EVENT_READ, ("stderr", rank))
            self.selector.register(rank.process.sentinel, selectors.EVENT_READ, ("exit", rank))

    def run(self) -> None:
        last_exit = None
        while self.selector.get_map():
            if all(r.exited_at for r in self.ranks):
                last_exit = last_exit or time.monotonic()
                if time.monotonic() - last_exit > 0.5:  # a grandchild may hold a pipe open
                    break
            for key, _ in self.selector.select(self._wait_time()):
                self._handle(*key.data, key.fileobj)
            now = time.monotonic()
            if self.deadline is not None and now > self.deadline and not self.failed:
                self._expire()
            if self.term_at is not None and now > self.term_at:
                self._terminate()
            if self.kill_at is not None and now > self.kill_at:
                self.kill_all(signal.SIGKILL)
                self.kill_at = None

    def _wait_time(self) -> float:
        limits = [0.25]
        for limit in (self.deadline, self.kill_at, self.term_at):
            if limit is not None:
                limits.append(max(0.0, limit - time.monotonic()))
        return min(limits)

    def _handle(self, kind: str, rank: _Rank, fileobj) -> None:
        if kind in ("stdout", "stderr"):
            data = os.read(fileobj.fileno(), 65536)
            if data:
                rank.emit(kind, data)
            else:
                self.selector.unregister(fileobj)
        elif kind == "result":
            try:
                rank.outcome = pickle.loads(fileobj.recv_bytes())
            except EOFError:
                self.selector.unregister(fileobj)
                return
            if rank.outcome[0] == "error":
                self._fail(collateral=_is_collateral(rank.outcome[1]))
        else:
            self.selector.unregister(fileobj)
            rank.process.join(timeout=5)
            rank.exited_at = time.time()
            if rank.process.exitcode != 0 and not (rank.outcome and rank.outcome[0] == "error"):
                self._drain_result(rank)
                self._fail()

    def _drain_result(self, rank: _Rank) -> None:
        if rank.outcome is None and rank.result_conn.poll(0):
            try:
                rank.outcome = pickle.loads(rank.result_conn.recv_bytes())
            except EOFError:
                pass

    def _fail(self, collateral: bool = False) -> None:
        """Stop every rank: at once, or, when the first error only says that a peer went
        away, after giving that peer a moment to report why (the root cause)."""
        if self.failed:
            if not collateral and self.term_at is not None:
                self._terminate()  # the real cause has arrived
            return
        self.failed = True
        if collateral:
            self.term_at = time.monotonic() + PEER_REPORT_GRACE_S
        else:
            self._terminate()

    def _terminate(self) -> None:
        self.term_at = None
        self.kill_all(signal.SIGTERM)
        self.kill_at = time.monotonic() + TERMINATE_GRACE_S

    def kill_all(self, signum: int) -> None:
        for rank in self.ranks:
            if rank.process.exitcode is None:
                rank.stopped = True
                rank.signal_tree(signum)

    def _expire(self) -> None:
        running = [r for r in self.ranks if r.process.exitcode is None]
        for rank in running:
            rank.capture = []
            rank.signal_tree(signal.SIGUSR1)
        end = time.monotonic() + STACK_DUMP_WAIT_S
        while time.monotonic() < end:
            for key, _ in self.selector.select(0.1):
                kind, rank, fileobj = *key.data, key.fileobj
                if kind == "stderr":
                    self._handle(kind, rank, fileobj)
        self.kill_all(signal.SIGKILL)
        for rank in self.ranks:
            rank.process.join(timeout=5)
        stacks = "\n\n".join(
            f"rank {r.index} stack:\n" + "\n".join(r.capture or ["(no stack received)"])
            for r in running
        )
        names = ", ".join(str(r.index) for r in running)
        raise TimeoutError(
            f"launch: join_timeout of {self.join_timeout:g} s expired with rank(s) {names} "
            f"still running; all ranks were killed. Where they were:\n\n{stacks}"
        )

    def close(self) -> None:
        self.kill_all(signal.SIGKILL)
        for rank in self.ranks:
            rank.process.join(timeout=10)
            rank.kill_leftovers()
            rank.flush_partial()
            for conn in (rank.result_conn, rank.stdout_conn, rank.stderr_conn):
                conn.close()
        self.selector.close()


def _failure_message(ranks: list[_Rank]) -> tuple[str, bool]:
    """The launch error text (root cause first) and whether the port was in use."""
    def failed_at(rank: _Rank) -> float:
        if rank.outcome and rank.outcome[0] == "error":
            return rank.outcome[1]["failed_at"]
        return rank.exited_at or float("inf")

    # The root cause, in this order: the earliest error a rank raised itself; else the
    # first rank that died without a report (a crash, os._exit, a signal from outside)
    # and was not stopped by the launcher; else whatever failed first. An error that only
    # says a peer went away is the echo of another rank's death: it comes last. Ranks'
    # clocks are compared with ranks' clocks, exits noticed by the launcher with each other.
    failures = [r for r in ranks if not (r.outcome and r.outcome[0] == "ok")]
    errors = [r for r in failures if r.outcome and r.outcome[0] == "error"]
    genuine = [r for r in errors if not _is_collateral(r.outcome[1])]
    died = [r for r in failures if r not in errors and not r.stopped]
    root = min(genuine or died or failures, key=failed_at)
    if root.outcome and root.outcome[0] == "error":
        report = root.outcome[1]
        head = f"rank {root.index} failed: {report['type']}: {_first_line(report['message'])}"
        if report["phase"] == "return":
            head += " (while sending its return value back)"
        body = f"\n\nTraceback from rank {root.index}:\n{report['traceback']}"
        port_in_use = report["phase"] == "rendezvous" and (
            "EADDRINUSE" in report["message"] or "address already in use" in report["message"])
        advice = _advice_for(report["message"] + report["traceback"])
    else:
        head = f"rank {root.index} {root.describe_end()}"
        code = root.process.exitcode
        if code is not None and code > 0:
            head += " (os._exit, sys.exit or a crash in native code)"
        elif code is not None and -code == signal.SIGKILL:
            head += " (killed from outside: often the out-of-memory killer)"
        body, port_in_use, advice = "", False, ""
    others = "\n".join(f"  rank {r.index}: {r.describe_end()}"
                       for r in ranks if r is not root)
    text = f"{head}{body}\nOther ranks (stopped by the launcher after the failure):\n{others}"
    if advice:
        text += f"\n\nAdvice: {advice}"
    return text, port_in_use


def _start_ranks(ctx, nprocs: int, spec: _GroupSpec, work, listener) -> list[_Rank]:
    ranks = []
    for index in range(nprocs):
        result_r, result_w = ctx.Pipe(duplex=False)
        out_r, out_w = ctx.Pipe(duplex=False)
        err_r, err_w = ctx.Pipe(duplex=False)
        passed_listener = listener if index == 0 or ctx.get_start_method() == "fork" else None
        process = ctx.Process(
            target=_rank_main, name=f"mgpu-rank-{index}",
            args=(index, spec, work, passed_listener, result_w, out_w, err_w),
        )
        process.start()
        for conn in (result_w, out_w, err_w):
            conn.close()
        ranks.append(_Rank(index, process, result_r, out_r, err_r))
    return ranks


def _run_ranks(ctx, nprocs, spec_args: dict, work, listener, join_timeout, return_all):
    spec = _GroupSpec(master_port=listener.getsockname()[1], **spec_args)
    ranks: list[_Rank] = []
    supervisor = None
    try:
        ranks = _start_ranks(ctx, nprocs, spec, work, listener)
        listener.close()
        supervisor = _Supervisor(ranks, join_timeout)
        supervisor.run()
    finally:
        listener.close()
        if supervisor is not None:
            supervisor.close()
        else:
            for rank in ranks:
                rank.signal_tree(signal.SIGKILL)
                rank.process.join(timeout=10)
    if supervisor.failed or any(r.outcome is None or r.outcome[0] != "ok" for r in ranks):
        message, port_in_use = _failure_message(ranks)
        if port_in_use:
            raise _PortInUse(message)
        raise LaunchError(message)
    values = [pickle.loads(r.outcome[1]) for r in ranks]
    return values if return_all else values[0]


# ------------------------------------------------------------ torchrun and SLURM


def _torchrun_variables(cluster: ClusterRank) -> dict[str, str]:
    """The variables torchrun sets, derived from an srun task's, so that code reading
    RANK or LOCAL_RANK (and ``mh.local_rank()``) works under srun as under torchrun."""
    host, _, port = cluster.init_method.removeprefix("tcp://").rpartition(":")
    variables = {"RANK": str(cluster.rank), "WORLD_SIZE": str(cluster.world_size),
                 "LOCAL_RANK": str(cluster.local_rank), "MASTER_ADDR": host,
                 "MASTER_PORT": port}
    per_node = os.environ.get("SLURM_STEP_TASKS_PER_NODE",
                              os.environ.get("SLURM_TASKS_PER_NODE", ""))
    first = per_node.split("(")[0].split(",")[0]  # "4(x2)" or "4,2": this node's count
    if first.isdigit():  # exact on homogeneous steps, the usual case
        variables["LOCAL_WORLD_SIZE"] = first
    return variables


def _run_in_this_process(fn, args, kwargs, cluster: ClusterRank, backend: str,
                         timeout: float):
    if cluster.launcher == "srun":
        for name, value in _torchrun_variables(cluster).items():
            os.environ.setdefault(name, value)
    backend = resolve_backend(backend, count_gpus())
    if backend_device_type(backend) == "cuda":
        torch.cuda.set_device(gpu_index())  # after LOCAL_RANK is in the environment
    group_timeout = datetime.timedelta(seconds=timeout)
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        dist.init_process_group(backend, store=elastic_store(cluster, group_timeout),
                                rank=cluster.rank, world_size=cluster.world_size,
                                timeout=group_timeout)
    else:
        dist.init_process_group(backend, init_method=cluster.init_method,
                                rank=cluster.rank, world_size=cluster.world_size,
                                timeout=group_timeout)
    try:
        with reusing_launched_group(fn, backend, cluster.world_size, cluster.rank):
            value = fn(*args, **kwargs)
    except BaseException:
        _finish_group(clean=False)
        raise
    _finish_group(clean=True)
    return value


# --------------------------------------------------------------------------- API


def launch(fn, *args, nprocs: int | None = None, backend: str = "auto",
           start_method: str = "auto", master_addr: str = "127.0.0.1",
           master_port: int | None = None, timeout: float = DEFAULT_TIMEOUT_S,
           join_timeout: float | None = None, return_all: bool = False,
           cpu_threads: int = 1, **kwargs):
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

    Returns:
        Rank 0's return value (a list of all ranks' values with ``return_all=True``),
        with every tensor in it moved to the CPU and detached (also inside dataclasses,
        modules and other objects). Under torchrun or an srun step: this process's value.

    Raises:
        LaunchError: a rank failed (the message starts with "rank k failed: ...") or the
            launch could not start. TimeoutError: join_timeout expired.
    """
    _check_callable(fn)
    _check_not_inside_rank()
    _check_no_group_in_this_process()
    _check_seconds("timeout", timeout)
    _check_seconds("join_timeout", join_timeout, allow_none=True)
    _check_positive_int("cpu_threads", cpu_threads)
    _check_port(master_port)
    try:
        cluster = cluster_environment()
    except ClusterEnvironmentError as exc:
        raise LaunchError(str(exc)) from None
    if cluster is not None:
        return _run_in_this_process(fn, args, kwargs, cluster, backend, timeout)

    gpus = count_gpus()
    backend = resolve_backend(backend, gpus)
    nprocs = resolve_nprocs(nprocs, backend, gpus)
    method = _resolve_start_method(start_method)
    ctx = mp.get_context(method)
    if method == "fork":
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
    for attempt in range(1, PORT_ATTEMPTS + 1):
        listener = _listen(master_addr, master_port)
        try:
            return _run_ranks(ctx, nprocs, spec_args, work, listener, join_timeout, return_all)
        except _PortInUse as exc:
            if master_port is not None or attempt == PORT_ATTEMPTS:
                raise LaunchError(str(exc)) from None
    raise AssertionError("unreachable")
