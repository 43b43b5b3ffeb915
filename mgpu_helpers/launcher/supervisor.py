"""Starting the ranks, watching their output and results, stopping them all.

One stop policy, whatever the reason (a failed rank, ``join_timeout``, an interrupted
cell, a failure while starting): SIGTERM to every rank still running, up to
``TERMINATE_GRACE_S`` for them to exit, then SIGKILL (as ``torch.multiprocessing.spawn``
does); then whatever a rank started and left behind in its session is killed too.
"""

from __future__ import annotations

import os
import pickle
import selectors
import signal
import time

from .failure import LaunchError, failure_message, is_collateral
from .rank_handle import RankHandle
from .rank_main import run_rank
from .records import GroupSpec, Raised, Returned
from .streams import flush_all_streams

TERMINATE_GRACE_S = 2.0
# After an error that only says a peer went away ("Connection closed by peer"), how long
# to wait for that peer's own report (the root cause) before stopping every rank.
PEER_REPORT_GRACE_S = 1.5
STACK_DUMP_WAIT_S = 1.5


class _Supervisor:
    """Drains output and results of every rank, and stops them all on the first failure."""

    def __init__(self, ranks: list[RankHandle], join_timeout: float | None):
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

    def _handle(self, kind: str, rank: RankHandle, fileobj) -> None:
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
            if isinstance(rank.outcome, Raised):
                self._fail(collateral=is_collateral(rank.outcome.report))
        else:
            self.selector.unregister(fileobj)
            rank.process.join(timeout=5)
            rank.exited_at = time.time()
            if rank.process.exitcode != 0 and not isinstance(rank.outcome, Raised):
                self._drain_result(rank)
                self._fail()

    def _drain_result(self, rank: RankHandle) -> None:
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
        stop_ranks(self.ranks)
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
        stop_ranks(self.ranks)
        for rank in self.ranks:
            rank.flush_partial()
            rank.close_pipes()
        self.selector.close()


def stop_ranks(ranks: list[RankHandle], grace: float = TERMINATE_GRACE_S) -> None:
    """The stop policy: SIGTERM to every rank still running, ``grace`` seconds for them
    to exit, SIGKILL to the rest; then kill what each left behind in its session."""
    running = [rank for rank in ranks if rank.process.exitcode is None]
    for rank in running:
        rank.stopped = True
        rank.signal_tree(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for rank in running:
        rank.process.join(timeout=max(0.0, deadline - time.monotonic()))
    for rank in running:
        if rank.process.exitcode is None:
            rank.signal_tree(signal.SIGKILL)
    for rank in ranks:
        rank.process.join(timeout=10)
        rank.kill_leftovers()


def start_rank(ctx, index: int, spec: GroupSpec, work, listener) -> RankHandle:
    result_r, result_w = ctx.Pipe(duplex=False)
    out_r, out_w = ctx.Pipe(duplex=False)
    err_r, err_w = ctx.Pipe(duplex=False)
    passed_listener = listener if index == 0 or ctx.get_start_method() == "fork" else None
    process = ctx.Process(
        target=run_rank, name=f"mgpu-rank-{index}",
        args=(index, spec, work, passed_listener, result_w, out_w, err_w),
    )
    if ctx.get_start_method() == "fork":
        flush_all_streams()  # or the rank would inherit, and print again, pending output
    try:
        process.start()
    except BaseException:
        for conn in (result_r, result_w, out_r, out_w, err_r, err_w):
            conn.close()
        raise
    for conn in (result_w, out_w, err_w):
        conn.close()
    return RankHandle(index, process, result_r, out_r, err_r)


def run_ranks(ctx, nprocs, spec_args: dict, work, listener, join_timeout, return_all):
    spec = GroupSpec(master_port=listener.getsockname()[1], **spec_args)
    ranks: list[RankHandle] = []
    supervisor = None
    try:
        for index in range(nprocs):  # each started rank is in `ranks` at once
            try:
                ranks.append(start_rank(ctx, index, spec, work, listener))
            except Exception as exc:
                raise LaunchError(
                    f"could not start rank {index} of {nprocs}: {type(exc).__name__}: "
                    f"{exc}. The {len(ranks)} rank(s) already started were stopped."
                ) from exc
        listener.close()
        supervisor = _Supervisor(ranks, join_timeout)
        supervisor.run()
    finally:
        listener.close()
        if supervisor is not None:
            supervisor.close()
        else:  # interrupted or failed while starting: stop the ranks already started
            stop_ranks(ranks)
            for rank in ranks:
                rank.close_pipes()
    if supervisor.failed or any(not isinstance(r.outcome, Returned) for r in ranks):
        raise LaunchError(failure_message(ranks))
    values = [pickle.loads(r.outcome.payload) for r in ranks]
    return values if return_all else values[0]
