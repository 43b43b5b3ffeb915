"""What a failed distributed case tells the reader (issue 32): the real cause first (a
rank's native abort, with gloo's last message in the reader's terms), where each rank was
stuck in a hang (the reader's frames only), a 05.1 hook that returns no Future; and a
case's time counted from when every rank is ready, not from when the ranks start."""

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

from mgpu_helpers import exercises
from mgpu_helpers.exercises import ch05, core
from mgpu_helpers.launcher import rank_main
from solutions.ch03 import bidirectional_all_reduce

EXERCISES = exercises.registry()
pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def one_case(key, timeout=None):
    """The exercise's first case only; a short timeout where a test waits for a hang."""
    exercise = EXERCISES[key]
    return dataclasses.replace(exercise, cases=exercise.cases[:1],
                               timeout=timeout or exercise.timeout)


def chunks_that_disagree(tensor):
    if dist.get_rank() == 0:
        dist.recv(torch.empty(2), 1)  # the line the verdict names
    else:
        dist.send(torch.ones(3), 0)


def test_a_size_mismatch_names_the_receiving_rank_and_the_elements_first():
    (outcome,) = core.evaluate(one_case("03.1"), chunks_that_disagree).outcomes
    assert outcome.status == "error"
    first = outcome.detail.splitlines()[0]
    assert first.startswith("rank 0 received 3 elements where its recv expected 2: the two "
                            "ranks' chunk sizes disagree"), outcome.detail
    assert "chunks_that_disagree" in outcome.detail and "dist.recv(torch.empty(2), 1)" in (
        outcome.detail)
    assert "killed by signal" not in first and "mgpu_helpers" not in outcome.detail


def test_a_native_abort_leads_before_a_bystanders_connection_reset():
    # crafted: rank 1's error only echoes rank 0's death; rank 0 wrote gloo's last words
    detail = core.diagnose(
        "rank 1 failed: RuntimeError: Connection reset by peer",
        errors={1: "Traceback (most recent call last):\n  File \"cell.py\", line 5, in ring\n"
                   "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection reset by peer"},
        fatal={0: "Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call "
                  "first):\n  File \"cell.py\", line 3 in ring\n"
                  f"  File \"{core.__file__}\", line 200 in _in_rank\n"},
        stderr={0: ["terminate called after throwing an instance of 'gloo::EnforceNotMet'",
                    "  what():  [enforce fail at pair.cc:464] op.preamble.length <= "
                    "op.nbytes. 20 vs 16. Received data size doesn't match expected size. "
                    "Is there a distributed collective mismatch in your code?"]})
    lines = detail.splitlines()
    assert lines[0].startswith("rank 0 received 5 elements where its recv expected 4: "
                               "the two ranks' chunk sizes disagree"), detail
    assert "Connection reset by peer" in detail
    assert detail.index("rank 0") < detail.index("Connection reset by peer")


def test_an_unrecognised_native_abort_still_shows_the_ranks_last_message():
    detail = core.diagnose(
        "rank 0 killed by signal SIGSEGV", errors={},
        fatal={0: "Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most "
                  "recent call first):\n  File \"cell.py\", line 9 in mine\n"
                  f"  File \"{core.__file__}\", line 200 in _in_rank\n"},
        stderr={0: ["some native library: index 7 out of range"]})
    first = detail.splitlines()[0]
    assert first.startswith("rank 0 crashed in native code (Segmentation fault)"), detail
    assert "index 7 out of range" in detail and "line 9 of mine" in detail


def both_receive(tensor):
    dist.recv(torch.empty(4), 1 - dist.get_rank())  # nobody sends: every rank waits here


def test_a_hang_says_where_each_rank_waited_in_the_readers_code():
    (outcome,) = core.evaluate(one_case("03.1", timeout=2), both_receive).outcomes
    assert outcome.status == "hang", outcome.detail
    assert "never comes" in outcome.detail
    for rank in (0, 1):
        assert f"rank {rank}: in recv, at line" in outcome.detail, outcome.detail
    assert "of both_receive" in outcome.detail and "dist.recv(torch.empty(4)" in outcome.detail
    assert "mgpu_helpers" not in outcome.detail and "multiprocessing" not in outcome.detail


def test_where_ranks_waited_is_read_from_the_launchers_timeout_too():
    stack = ("Current thread 0x1 (most recent call first):\n"
             f"  File \"{torch.distributed.__file__}\", line 3 in isend\n"
             "  File \"/tmp/cell.py\", line 12 in ring\n"
             f"  File \"{core.__file__}\", line 200 in _in_rank\n"
             f"  File \"{rank_main.__file__}\", line 160 in _run_and_report\n")
    text = (f"launch: join_timeout of 5 s expired with rank(s) 1 still running; all ranks "
            f"were killed. Where they were:\n\nrank 1 stack:\n{stack}")
    assert core.where_ranks_waited(core.stacks_in_timeout(text)) == [
        "rank 1: in isend, at line 12 of ring (/tmp/cell.py)"]


def test_a_slow_start_does_not_count_against_a_cases_time(monkeypatch):
    # rank 1 takes longer to start than the case may take: the time starts at rendezvous
    join_group = rank_main.join_group

    def slow_join(rank, spec, listener):
        if rank == 1:
            time.sleep(3)
        return join_group(rank, spec, listener)

    monkeypatch.setattr(rank_main, "join_group", slow_join)  # inherited by forked ranks
    report = core.evaluate(one_case("03.1", timeout=2), bidirectional_all_reduce)
    assert report.passed, "\n".join(report.lines())


def hook_returning_a_tensor(state, bucket):
    half = bucket.buffer().half()
    dist.all_reduce(half)
    return half.float() / dist.get_world_size()  # the line the verdict names


def test_a_hook_that_returns_no_future_is_told_so_in_its_own_frame():
    (outcome,) = core.evaluate(one_case("05.1"), hook_returning_a_tensor).outcomes
    assert outcome.status == "fail", outcome.detail
    assert "returned a Tensor, not a torch.futures.Future" in outcome.detail
    assert "hook_returning_a_tensor" in outcome.detail
    assert "return half.float() / dist.get_world_size()" in outcome.detail


def crafted_hook_result(**changes):
    got = {"gradients": [], "dtypes": ["Half"], "library": [], "results": [],
           "returned": []}
    return {**got, **changes}


def test_a_hook_returning_work_is_told_what_it_returned():
    returned = [("Work", "my_hook", "cell.py", 4, "return dist.all_reduce(x, async_op=True)")]
    message = ch05._hook_judge(crafted_hook_result(returned=returned), {})
    assert message.startswith("the hook returned a Work (what async_op=True gives), not a "
                              "torch.futures.Future"), message
    assert "line 4 of my_hook" in message


def test_torchs_hooks_are_refused_before_the_future_is_looked_at():
    returned = [("Tensor", "my_hook", "cell.py", 4, "return x")]
    got = crafted_hook_result(returned=returned, library=["fp16_compress_hook"])
    assert "calls torch's fp16_compress_hook" in ch05._hook_judge(got, {})


def test_a_peers_echo_never_leads_when_the_launcher_saw_the_cause():
    # rank 0 left with os._exit; rank 1 only raised that its peer went away
    detail = core.diagnose(
        "rank 0 exited with code 3 without returning a result (os._exit, sys.exit or a "
        "crash in native code)\nOther ranks (stopped by the launcher after the failure):\n"
        "  rank 1: RuntimeError: Connection closed by peer",
        errors={1: "RuntimeError: [pair.cc:534] Connection closed by peer [127.0.0.1]:1"},
        fatal={}, stderr={})
    assert detail.startswith("rank 0 exited with code 3"), detail
    assert "then rank 1 raised RuntimeError" in detail and "a consequence" in detail
