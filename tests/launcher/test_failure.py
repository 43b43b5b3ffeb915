"""How a failed launch ends: the root cause first, the other ranks stopped,
restarts, timeouts and interrupts (launcher/failure.py, supervisor.py, rank_exit.py)."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from support.launching import SCRIPTS, rank1_dies, rank1_raises_while_rank0_waits, run_script

import mgpu_helpers as mh
from mgpu_helpers import LaunchError, launch
from mgpu_helpers.launcher import failure, rank_handle, supervisor
from mgpu_helpers.launcher.records import ErrorReport, Raised, Returned

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


# ---------------------------------------------------------------------------- failures


def test_failing_rank_is_reported_first_and_others_are_stopped():
    start = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        launch(rank1_raises_while_rank0_waits, nprocs=2, timeout=30)
    assert time.monotonic() - start < 20
    message = str(caught.value)
    assert message.startswith("rank 1 failed: ValueError: boom")
    assert 'raise ValueError("boom")' in message
    assert "rank 0:" in message.split("Other ranks")[1]


def failed_rank(index: int, message: str, failed_at: float):
    report = ErrorReport(rank=index, phase="run", failed_at=failed_at, type_name="RuntimeError",
                         message=message, traceback=f"RuntimeError: {message}\n")
    process = SimpleNamespace(exitcode=1)
    return rank_handle.RankHandle(index, process, None, None, None, outcome=Raised(report))


def test_a_peers_closed_connection_is_not_taken_for_the_root_cause():
    # Seen in chapter 09: rank 0 timed out and closed its connections; rank 1's
    # "Connection closed by peer" was stamped a moment earlier than rank 0's own report.
    ranks = [failed_rank(0, "Timed out waiting 5000ms for recv operation", 10.002),
             failed_rank(1, "Connection closed by peer [127.0.0.1]:41177", 10.001)]
    message = failure.failure_message(ranks)
    assert message.startswith("rank 0 failed: RuntimeError: Timed out waiting")
    only_collateral = [failed_rank(1, "Connection reset by peer", 3.0),
                       failed_rank(0, "Broken pipe", 4.0)]
    assert failure.failure_message(only_collateral).startswith("rank 1 failed")


def test_a_rank_that_died_is_blamed_over_the_peer_that_saw_its_connection_reset():
    # Seen under load: rank 1 called os._exit(3); rank 0's "Connection reset by peer" was
    # stamped (rank 0's clock) before the launcher noticed rank 1's exit (its own clock).
    reset = failed_rank(0, "Read error [127.0.0.1]:5557: Connection reset by peer", 10.0)
    died = rank_handle.RankHandle(1, SimpleNamespace(exitcode=3), None, None, None,
                                  exited_at=10.5)
    message = failure.failure_message([reset, died])
    assert message.startswith("rank 1 exited with code 3 without returning a result")
    # A rank the launcher stopped (SIGTERM after the failure) is never the root cause.
    stopped = rank_handle.RankHandle(1, SimpleNamespace(exitcode=-15), None, None, None,
                                     exited_at=10.5, stopped=True)
    message = failure.failure_message([reset, stopped])
    assert message.startswith("rank 0 failed: RuntimeError: Read error")


def test_a_rank_that_died_is_blamed_over_a_peer_that_returned_then_failed_to_end():
    # rank 1 called os._exit(3) while rank 0, done, was in its final barrier: that barrier
    # failed (exit code 1), and the launcher may notice rank 0's exit first
    returned = rank_handle.RankHandle(0, SimpleNamespace(exitcode=1), None, None, None,
                                      outcome=Returned(b""), exited_at=10.0)
    died = rank_handle.RankHandle(1, SimpleNamespace(exitcode=3), None, None, None,
                                  exited_at=10.1)
    message = failure.failure_message([returned, died])
    assert message.startswith("rank 1 exited with code 3 without returning a result")
    assert "rank 0: returned its result, then exited with code 1 as its process ended" in message
    alone = failure.failure_message([returned, rank_handle.RankHandle(
        1, SimpleNamespace(exitcode=0), None, None, None, outcome=Returned(b""))])
    assert alone.startswith("rank 0 returned its result, then exited with code 1 as its "
                            "process ended (an error while its process ended")
    stopped = rank_handle.RankHandle(0, SimpleNamespace(exitcode=-15), None, None, None,
                                     outcome=Returned(b""), stopped=True)
    assert stopped.describe_end() == ("returned its result, then was stopped by the "
                                      "launcher as it ended")


def peer_gives_up_first():
    # rank 1 sees the connection close (collateral); rank 0's own error comes a moment later
    if mh.rank() == 1:
        raise RuntimeError("[pair.cc:561] Connection closed by peer [127.0.0.1]:41177")
    time.sleep(0.5)
    raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")


def test_the_launcher_waits_for_the_root_cause_after_a_collateral_error():
    # Before, the first error stopped every rank at once: rank 0 was killed before it could
    # report its timeout, and the launch blamed rank 1's closed connection.
    with pytest.raises(LaunchError) as caught:
        launch(peer_gives_up_first, nprocs=2, backend="gloo", join_timeout=60)
    assert str(caught.value).startswith("rank 0 failed: RuntimeError: Timed out waiting")


def rank0_raises():
    if mh.rank() == 0:
        raise KeyError("missing")
    dist.barrier()


def test_rank0_failure():
    with pytest.raises(LaunchError, match=r"^rank 0 failed: KeyError: 'missing'"):
        launch(rank0_raises, nprocs=2, timeout=30)


def test_os_exit_is_reported_with_exit_code():
    with pytest.raises(LaunchError, match=r"^rank 1 exited with code 3 without returning"):
        launch(rank1_dies, "exit", nprocs=2, timeout=30)


def test_killed_rank_is_reported_with_signal_name():
    with pytest.raises(LaunchError, match=r"^rank 1 killed by signal SIGKILL"):
        launch(rank1_dies, "kill", nprocs=2, timeout=30)


def after_the_group_ends(action):
    """Runs `action` on a thread once the launcher has destroyed this rank's group, that
    is after the rank's result was sent back: the rank's process is then ending."""
    def wait_then_act():
        while dist.is_initialized():
            time.sleep(0.01)
        action()
    threading.Thread(target=wait_then_act).start()  # not a daemon: the rank waits for it


_KEPT = []  # what a rank's work leaves alive after it returns


def rank_leaves_a_thread_pool_a_finalizer_and_a_thread(path):
    import multiprocessing.util
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    pool.submit(time.sleep, 0.05)
    _KEPT.append(pool)  # its worker thread waits for work until the pool is shut down
    multiprocessing.util.Finalize(pool, Path(f"{path}.finalized.{mh.rank()}").write_text,
                                  args=("finalized",), exitpriority=0)
    written = Path(f"{path}.thread.{mh.rank()}")  # mh.rank() says 0 once the group ended
    after_the_group_ends(lambda: written.write_text("done"))
    return mh.rank()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_rank_ends_as_multiprocessing_ends_a_process(method, tmp_path):
    # A thread pool still referenced when the work returns is shut down (it hung the rank
    # until join_timeout), multiprocessing's finalizers run (they terminate daemonic
    # children such as DataLoader workers), and the rank waits for its own (non-daemon)
    # threads before ending.
    values = launch(rank_leaves_a_thread_pool_a_finalizer_and_a_thread,
                    str(tmp_path / "marker"), nprocs=2, return_all=True, join_timeout=60,
                    start_method=method)
    assert values == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "marker.finalized.0", "marker.finalized.1", "marker.thread.0", "marker.thread.1"]
    assert (tmp_path / "marker.thread.1").read_text() == "done"


@pytest.mark.slow
def test_what_native_code_printed_is_not_lost_when_a_rank_ends():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run([sys.executable, str(SCRIPTS / "native_output.py")],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for method in ("fork", "spawn"):
        block = lines[:lines.index(f"{method} done")]
        assert {"[rank 0] native hello from 0", "[rank 1] native hello from 1"} <= set(block)
        lines = lines[len(block) + 1:]


def abort_without_a_core_file():
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the working folder
    os.abort()


def rank1_aborts_after_returning():
    if mh.rank() == 1:
        after_the_group_ends(abort_without_a_core_file)
    return mh.rank()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_crash_after_returning_is_reported_not_swallowed(method):
    # The launcher used to fail on this with "min() arg is an empty sequence".
    with pytest.raises(LaunchError, match=r"^rank 1 returned its result, then was killed "
                                          r"by signal SIGABRT as its process ended"):
        launch(rank1_aborts_after_returning, nprocs=2, timeout=30, start_method=method)


def rank1_hangs(path: str):
    if mh.rank() == 1:
        def record(signum, frame):
            Path(path).write_text("SIGTERM")
            os._exit(0)
        signal.signal(signal.SIGTERM, record)
        time.sleep(600)


@pytest.mark.slow
def test_join_timeout_kills_and_shows_stacks(tmp_path):
    marker = str(tmp_path / "rank1")
    start = time.monotonic()
    with pytest.raises(TimeoutError) as caught:
        launch(rank1_hangs, marker, nprocs=2, join_timeout=3)
    assert time.monotonic() - start < 15
    message = str(caught.value)
    assert "join_timeout of 3 s expired with rank(s) 0, 1 still running" in message
    assert "in rank1_hangs" in message  # rank 1's Python stack, from faulthandler
    assert Path(marker).read_text() == "SIGTERM"  # the stop policy: SIGTERM first


def stop_marker(path: str, ignore_sigterm: bool = False):
    """Rank 1 records the SIGTERM it gets (or ignores it), then waits to be stopped."""
    if mh.rank() == 0:
        while not Path(path + ".ready").exists():  # rank 1's handler is in place
            time.sleep(0.05)
        raise ValueError("rank 0 fails")
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        def record(signum, frame):
            Path(path).write_text("SIGTERM")
            os._exit(0)
        signal.signal(signal.SIGTERM, record)
    Path(path + ".ready").write_text("")
    # Short sleeps: the kernel may deliver SIGTERM to one of gloo's threads, and Python
    # runs the handler only when the main thread next executes bytecode; one long
    # sleep(600) would then outlast the launcher's grace and end in SIGKILL.
    for _ in range(12000):
        time.sleep(0.05)


def test_a_failure_stops_the_other_ranks_with_sigterm_first(tmp_path, monkeypatch):
    # What is checked is the order (SIGTERM, then SIGKILL), not the grace's length: a
    # long grace keeps a loaded CI machine from turning this into a SIGKILL.
    monkeypatch.setattr(supervisor, "TERMINATE_GRACE_S", 30.0)
    marker = str(tmp_path / "rank1")
    with pytest.raises(LaunchError, match="^rank 0 failed: ValueError: rank 0 fails") as caught:
        launch(stop_marker, marker, nprocs=2, backend="gloo", join_timeout=120)
    assert Path(marker).exists(), f"rank 1 never ran its SIGTERM handler:\n{caught.value}"
    assert Path(marker).read_text() == "SIGTERM"


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace(tmp_path, monkeypatch):
    monkeypatch.setattr(supervisor, "TERMINATE_GRACE_S", 0.5)  # a rank ignoring it: no wait
    marker = str(tmp_path / "rank1")
    with pytest.raises(LaunchError) as caught:
        launch(stop_marker, marker, True, nprocs=2, backend="gloo", join_timeout=120)
    assert "rank 1: killed by signal SIGKILL" in str(caught.value)
    assert not Path(marker).exists()


def test_a_failure_while_starting_ranks_stops_those_started(monkeypatch):
    real_start = supervisor.start_rank
    started = []

    def second_start_fails(ctx, index, *args):
        if index == 1:
            raise OSError("[Errno 12] Cannot allocate memory")
        rank = real_start(ctx, index, *args)
        started.append(rank.process)
        return rank

    monkeypatch.setattr(supervisor, "start_rank", second_start_fails)
    with pytest.raises(LaunchError, match=r"^could not start rank 1 of 2: OSError: "
                                          r"\[Errno 12\] Cannot allocate memory\. The 1 rank"):
        launch(time.sleep, 600, nprocs=2, backend="gloo")
    (rank0,) = started
    assert rank0.exitcode == -signal.SIGTERM  # stopped by the policy, not left running


def report(kind: str, message: str, phase: str = "run") -> ErrorReport:
    return ErrorReport(rank=0, phase=phase, failed_at=0.0, type_name=kind, message=message,
                       traceback="")


def test_advice_is_matched_on_the_error_not_on_words_in_the_traceback():
    collective = failure.advice_for(report("RuntimeError",
                                            "Timed out waiting 5000ms for recv operation"))
    assert collective.startswith("A collective waited longer than `timeout`")
    assert failure.advice_for(report("DistBackendError", "Watchdog caught collective "
                                      "operation timeout: WorkNCCL(SeqNum=3)")) == collective
    # The user's own timeout, or torch.load failing on a damaged file, is not about
    # collectives or return values.
    assert failure.advice_for(report("TimeoutError", "queue.get timed out")) == ""
    assert failure.advice_for(report("UnpicklingError", "invalid load key, 'x'.")) == ""
    assert "return plain data" in failure.advice_for(
        report("TypeError", "cannot pickle 'generator' object", phase="return"))
    assert "spawn" in failure.advice_for(report("AttributeError", "Can't get attribute "
                                                 "'train' on <module '__main__'>",
                                                 phase="unpickle"))
    assert "start_method='spawn'" in failure.advice_for(
        report("RuntimeError", "Cannot re-initialize CUDA in forked subprocess."))

def fails_on_the_first_attempt():
    if mh.rank() == 1 and mh.restart_count() == 0:
        raise ValueError("first attempt")
    return mh.rank(), mh.restart_count(), int(os.environ["MGPU_RESTART_COUNT"])


def test_max_restarts_starts_every_rank_again_after_a_failure(capfd):
    values = launch(fails_on_the_first_attempt, nprocs=2, backend="gloo", max_restarts=2,
                    return_all=True)
    assert values == [(0, 1, 1), (1, 1, 1)]  # both ranks are on the second attempt
    err = capfd.readouterr().err
    assert ("[launch] rank 1 failed: ValueError: first attempt; every rank stopped, "
            "starting them again (restart 1 of 2)") in err
    assert "restart 2 of 2" not in err


def always_fails():
    raise ValueError(f"attempt {mh.restart_count()}")


def test_when_restarts_run_out_the_last_failure_is_raised(capfd):
    with pytest.raises(LaunchError, match=r"^rank \d failed: ValueError: attempt 2"):
        launch(always_fails, nprocs=2, backend="gloo", max_restarts=2)
    assert capfd.readouterr().err.count("[launch] rank") == 2


@pytest.mark.parametrize("value", [-1, 1.5, True, "1"])
def test_invalid_max_restarts(value):
    with pytest.raises(ValueError, match="max_restarts must be an int >= 0"):
        launch(mh.rank, nprocs=2, max_restarts=value)

def rank1_is_late():
    if mh.rank() == 1:
        time.sleep(30)
    dist.barrier()


@pytest.mark.slow
def test_timeout_reaches_the_process_group():
    start = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        launch(rank1_is_late, nprocs=2, timeout=2)
    assert time.monotonic() - start < 20
    assert str(caught.value).startswith("rank 0 failed:")
    assert "Advice: A collective waited longer than `timeout`" in str(caught.value)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["running", "importing"])
def test_interrupt_kills_every_rank_and_next_launch_works(when):
    # "importing": Ctrl+C during the compiler's import before the first fork is held
    # back until the import ends (a half-initialised torch._dynamo broke later launches)
    done = run_script(sys.executable, str(SCRIPTS / "interrupt.py"), when)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "interrupted" in done.stdout
    assert "children left: []" in done.stdout
    assert "second launch: 42" in done.stdout
    if when == "importing":
        assert "started" not in done.stdout, "the ranks started after the interrupt"


def launch_inside():
    return launch(mh.rank, nprocs=2)


def test_launch_inside_a_rank_is_refused():
    with pytest.raises(LaunchError, match="called from inside rank 0"):
        launch(launch_inside, nprocs=1)


