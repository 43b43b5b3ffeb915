"""mgpu_helpers.launch (package mgpu_helpers.launcher) on 2 gloo ranks: results, output,
failures, hangs, ports, clusters."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from support.slurm_env import srun_task

import mgpu_helpers as mh
from mgpu_helpers import LaunchError, launch
from mgpu_helpers.launcher import api, checks, failure, rank_handle, rank_main, supervisor
from mgpu_helpers.launcher.records import ErrorReport, GroupSpec, Raised, Returned
from mgpu_helpers.runtime.cluster import first_slurm_host

SCRIPTS = Path(__file__).resolve().parent / "launch_scripts"
pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def run_script(*command, env=None, timeout=180):
    return subprocess.run([*command], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------- ranks and results


def where_am_i():
    return {"rank": mh.rank(), "world": mh.world_size(), "local": mh.local_rank(),
            "device": str(mh.device()), "main": mh.is_main(),
            "threads": torch.get_num_threads(), "addr": os.environ["MASTER_ADDR"]}


def test_every_rank_knows_where_it_runs():
    results = launch(where_am_i, nprocs=2, return_all=True)
    assert results == [
        {"rank": r, "world": 2, "local": r, "device": "cpu", "main": r == 0, "threads": 1,
         "addr": "127.0.0.1"} for r in range(2)
    ]


def test_cpu_threads_is_configurable():
    assert launch(torch.get_num_threads, nprocs=2, cpu_threads=2) == 2


def reduce_and_return(kind):
    value = torch.tensor([float(mh.rank() + 1)], requires_grad=False)
    dist.all_reduce(value)
    if kind == "dict":
        return {"sum": value.item(), "rank": mh.rank()}
    if kind == "tensor":
        return value * torch.ones(2, requires_grad=True)  # a non-leaf: comes back detached
    if kind == "bytes":
        return bytes([mh.rank()]) * 50_000_000
    raise AssertionError(kind)


def test_returns_rank0_value_or_all_values_and_leaves_the_environment_unchanged():
    before = dict(os.environ)
    assert launch(reduce_and_return, "dict", nprocs=2) == {"sum": 3.0, "rank": 0}
    all_values = launch(reduce_and_return, "dict", nprocs=2, return_all=True)
    assert all_values == [{"sum": 3.0, "rank": 0}, {"sum": 3.0, "rank": 1}]
    # two launches in a row: neither leaves its settings or its group behind
    assert dict(os.environ) == before
    assert not dist.is_initialized()


def test_tensors_come_back_on_cpu_detached():
    value = launch(reduce_and_return, "tensor", nprocs=2)
    assert value.device.type == "cpu" and not value.requires_grad
    assert value.tolist() == [3.0, 3.0]


@dataclass
class Trained:
    model: torch.nn.Module
    losses: list
    gradients: dict


def return_a_trained_module():
    model = torch.nn.Linear(3, 2)
    loss = model(torch.ones(1, 3)).square().sum()  # a non-leaf tensor that requires grad
    loss.backward()
    return Trained(model, [loss], {"weight": model.weight.grad})


def test_tensors_inside_dataclasses_and_modules_come_back_detached():
    # Before, only dicts, lists and tuples were walked: a loss inside a dataclass could not
    # be pickled, and a CUDA module would have come back on the GPU (initialising CUDA in
    # the notebook, so that later launches had to spawn).
    trained = launch(return_a_trained_module, nprocs=1, backend="gloo")
    assert isinstance(trained.model.weight, torch.nn.Parameter)
    assert trained.model.weight.requires_grad and trained.model.weight.device.type == "cpu"
    assert not trained.losses[0].requires_grad
    gradient = trained.gradients["weight"]
    assert gradient.shape == (2, 3) and gradient.device.type == "cpu"


def test_50_mb_return_values_do_not_deadlock():
    values = launch(reduce_and_return, "bytes", nprocs=2, return_all=True)
    assert [len(v) for v in values] == [50_000_000, 50_000_000]
    assert values[1][:3] == b"\x01\x01\x01"


def return_a_lock():
    return threading.Lock()


def test_unpicklable_return_value_names_the_rank():
    with pytest.raises(LaunchError) as caught:
        launch(return_a_lock, nprocs=2)
    message = str(caught.value)
    assert message.startswith("rank ")
    assert "cannot pickle '_thread.lock' object (while sending its return value back)" in message
    assert "Advice: A rank's return value travels back to the launcher pickled" in message


def chatty():
    print(f"hello from {mh.rank()}")
    print(f"warning from {mh.rank()}", file=sys.stderr)
    mh.print0("only rank 0 says this")


def test_output_is_prefixed_line_by_line(capfd):
    launch(chatty, nprocs=2)
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == ["[rank 0] hello from 0", "[rank 0] only rank 0 says this",
                                        "[rank 1] hello from 1"]
    assert sorted(err.splitlines()) == ["[rank 0] warning from 0", "[rank 1] warning from 1"]


@pytest.mark.slow
def test_function_from_main_module_under_fork_and_spawn():
    done = run_script(sys.executable, str(SCRIPTS / "main_module.py"))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "fork: 21" in lines and "spawn: 21" in lines
    # DDP's and FSDP2's first call imports torch._dynamo; the parent did, once, before
    # forking, so no forked rank pays for it again
    assert "forked ranks inherit the parent's imports: True" in lines
    assert lines.count("[rank 0] printed once") == 2
    assert "[rank 1] rank 1 of 2 on cpu" in lines
    assert "environment unchanged" in lines


# ---------------------------------------------------------------------- failures


def rank1_raises_while_rank0_waits():
    if mh.rank() == 1:
        time.sleep(0.2)
        raise ValueError("boom")
    dist.barrier()


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


def rank1_dies(how):
    if mh.rank() == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


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
def test_interrupt_kills_every_rank_and_next_launch_works():
    done = run_script(sys.executable, str(SCRIPTS / "interrupt.py"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "interrupted" in done.stdout
    assert "children left: []" in done.stdout
    assert "second launch: 42" in done.stdout


def launch_inside():
    return launch(mh.rank, nprocs=2)


def test_launch_inside_a_rank_is_refused():
    with pytest.raises(LaunchError, match="called from inside rank 0"):
        launch(launch_inside, nprocs=1)


# ------------------------------------------------------------------- under spawn
# On a GPU node launch spawns once the notebook has initialised CUDA (a forked rank could
# not use the GPU): ranks start from a fresh interpreter, the function reaches them by
# cloudpickle, and they end differently (see rank_exit.end_rank). The rest of this file
# forks; these run the main paths again under spawn, on CPU ranks.


def report_and_return_a_tensor():
    if mh.rank() == 1 and mh.restart_count() == 0:
        raise ValueError("first attempt")
    print(f"hello from {mh.rank()} on attempt {mh.restart_count()}")
    value = torch.tensor([float(mh.rank() + 1)])
    dist.all_reduce(value)
    return {**where_am_i(), "sum": value * torch.ones(2, requires_grad=True),
            "restarts": (mh.restart_count(), int(os.environ["MGPU_RESTART_COUNT"]))}


@pytest.mark.slow
def test_under_spawn_values_output_tensors_and_restarts(capfd):
    # rank 1 fails on the first attempt: max_restarts starts every rank again, and the
    # second attempt's values, output and tensors come back
    values = launch(report_and_return_a_tensor, nprocs=2, return_all=True, max_restarts=1,
                    start_method="spawn")
    assert [(v["rank"], v["world"], v["device"], v["threads"]) for v in values] == [
        (0, 2, "cpu", 1), (1, 2, "cpu", 1)]
    assert all(v["sum"].tolist() == [3.0, 3.0] and not v["sum"].requires_grad
               for v in values)
    assert [v["restarts"] for v in values] == [(1, 1), (1, 1)]  # both on the second attempt
    out, err = capfd.readouterr()
    assert "[rank 0] hello from 0 on attempt 1" in out
    assert "[rank 1] hello from 1 on attempt 1" in out
    assert "(restart 1 of 1)" in err


@pytest.mark.slow
def test_under_spawn_failures_are_reported_as_under_fork():
    with pytest.raises(LaunchError) as caught:
        launch(rank1_raises_while_rank0_waits, nprocs=2, timeout=30, start_method="spawn")
    assert str(caught.value).startswith("rank 1 failed: ValueError: boom")
    assert 'raise ValueError("boom")' in str(caught.value)  # the rank's own traceback
    with pytest.raises(LaunchError, match=r"^rank 1 exited with code 3 without returning"):
        launch(rank1_dies, "exit", nprocs=2, timeout=30, start_method="spawn")


# ------------------------------------------------------------------------- ports


def test_busy_fixed_port_fails_fast_naming_it():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(LaunchError, match=f"master_port={port} on 127.0.0.1 is already"):
            launch(mh.rank, nprocs=2, master_port=port)
        assert time.monotonic() - start < 10  # no rank was started, nothing waited


# ------------------------------------------------------------------------ clusters


@pytest.mark.slow
def test_torchrun_standalone_runs_the_function_once_per_process():
    torchrun = Path(sys.executable).with_name("torchrun")
    done = run_script(str(torchrun), "--standalone", "--nproc-per-node", "2",
                      str(SCRIPTS / "cluster.py"))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("pid"))
    assert len(lines) == 2, done.stdout
    assert [line.split(" rank ")[1] for line in lines] == ["0 world 2 sum 2",
                                                          "1 world 2 sum 2"]


@pytest.mark.slow
def test_simulated_slurm_step_derives_ranks_from_slurm_variables():
    port = str(free_port())
    tasks = [subprocess.Popen(
        [sys.executable, str(SCRIPTS / "cluster.py")],
        env={**os.environ, **srun_task(task, tasks=2), "MASTER_PORT": port},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for task in range(2)]
    outputs = [task.communicate(timeout=120) for task in tasks]
    for task, (out, err) in zip(tasks, outputs, strict=True):
        assert task.returncode == 0, out + err
    assert sorted(out.split(" rank ")[1].strip() for out, _ in outputs) == [
        "0 world 2 sum 2", "1 world 2 sum 2"]


def test_partial_torchrun_variables_are_listed(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(LaunchError, match="RANK set but WORLD_SIZE, LOCAL_RANK missing"):
        launch(mh.rank, nprocs=2)


def test_partial_slurm_variables_are_listed(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    for name in ("SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
                 "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LaunchError, match="SLURM_LOCALID, SLURM_JOB_NODELIST missing"):
        launch(mh.rank, nprocs=2)


@pytest.mark.parametrize(("nodelist", "first"), [
    ("node7", "node7"), ("gpu[03-05,09]", "gpu03"), ("a1,b2", "a1"), ("x[1,4],y", "x1"),
    ("a1,b[2-3]", "a1")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize("nprocs", [0, -1, True, "2", 1.5])
def test_bad_nprocs(nprocs):
    with pytest.raises(ValueError, match="nprocs must be a positive int"):
        launch(mh.rank, nprocs=nprocs)


def test_nprocs_required_without_gpus(monkeypatch):
    monkeypatch.setattr(api, "count_gpus", lambda: 0)
    with pytest.raises(ValueError, match=r"no GPU to count .* Say how many ranks .* nprocs=2"):
        launch(mh.rank)


def test_called_function_instead_of_function():
    with pytest.raises(TypeError, match=r"launch\(train\(\)\)"):
        launch(mh.rank(), nprocs=2)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'gloo', 'nccl'"):
        launch(mh.rank, nprocs=2, backend="mpi")


def test_nccl_without_gpus(monkeypatch):
    monkeypatch.setattr(api, "count_gpus", lambda: 0)
    monkeypatch.setattr(checks.dist, "is_nccl_available", lambda: True)
    with pytest.raises(LaunchError, match="backend='nccl' needs GPUs"):
        launch(mh.rank, nprocs=2, backend="nccl")


def test_nccl_with_more_ranks_than_gpus(monkeypatch):
    monkeypatch.setattr(api, "count_gpus", lambda: 1)
    monkeypatch.setattr(checks.dist, "is_nccl_available", lambda: True)
    with pytest.raises(LaunchError, match="nprocs=2 GPU ranks need 2 GPUs, but 1 is visible"):
        launch(mh.rank, nprocs=2, backend="nccl")


@pytest.mark.parametrize("port", [0, 70000, "29500", True])
def test_invalid_port(port):
    with pytest.raises(ValueError, match="master_port must be an int in 1..65535"):
        launch(mh.rank, nprocs=2, master_port=port)


@pytest.mark.parametrize(("name", "value"), [("timeout", 0), ("join_timeout", -1),
                                             ("cpu_threads", 0)])
def test_invalid_limits(name, value):
    with pytest.raises(ValueError, match=name):
        launch(mh.rank, nprocs=2, **{name: value})


def test_process_group_already_initialised_here():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(LaunchError, match="already initialised in this process"):
            launch(mh.rank, nprocs=2)
    finally:
        dist.destroy_process_group()


def test_fork_refused_once_cuda_is_initialised(monkeypatch):
    monkeypatch.setattr(checks, "cuda_driver_loaded", lambda: True)
    with pytest.raises(LaunchError, match=r"refusing to fork: .*torch.cuda.is_available\(\)"):
        launch(mh.rank, nprocs=2, start_method="fork")
    assert checks.resolve_start_method("auto") == "spawn"


def test_nccl_rank_detects_a_poisoned_fork(monkeypatch):
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    spec = GroupSpec(2, "nccl", "127.0.0.1", 1, 5.0, 1)
    with pytest.raises(RuntimeError, match="poisoned fork"):
        rank_main.join_group(0, spec, None)


def test_unknown_start_method():
    with pytest.raises(ValueError, match="start_method must be"):
        launch(mh.rank, nprocs=2, start_method="thread")


def test_unpicklable_argument_under_spawn_is_refused_before_starting():
    with pytest.raises(LaunchError, match="cannot send the function or its arguments"):
        launch(lambda lock: None, threading.Lock(), nprocs=2, start_method="spawn")


def progress_bar():
    sys.stderr.write("\rstep 1/3")
    sys.stderr.write("\rstep 2/3")
    sys.stderr.write("\rstep 3/3\n")
    sys.stderr.write("\rhalf a line\rlatest update\r")


def test_carriage_returns_keep_only_the_latest_update(capfd):
    launch(progress_bar, nprocs=1)
    err = capfd.readouterr().err
    assert "[rank 0] step 3/3\n" in err
    assert "[rank 0] step 1/3\n" not in err, "overwritten updates never end a line"
    assert "[rank 0] latest update\r" in err
