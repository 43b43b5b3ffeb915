"""Chapter 03's checkers make the communication really happen: inputs drawn afresh (a
closed form fails), the data through send/recv only (the store, a connection of one's own
and a send the Python-level count does not see are refused), the ring's least traffic,
03.1's two rings (both neighbours, each half's bytes, one chunk per message, the rings
advancing together), the result in place, and a mismatch that names its first differing
position."""

import dataclasses
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist

from mgpu_helpers import exercises
from mgpu_helpers.exercises import ch03, core
from mgpu_helpers.measure import traffic
from solutions import ch03 as solutions

EXERCISES = exercises.registry()
ON_LINUX = sys.platform.startswith("linux")
linux_only = pytest.mark.skipif(not ON_LINUX, reason="the kernel's socket counters")

# what a reader's module could take before the checker wraps anything: the originals
_BACKEND_SEND = next(vars(k)["send"] for k in dist.ProcessGroupGloo.__mro__ if "send" in vars(k))
_STORE_SET, _STORE_GET = dist.Store.set, dist.Store.get


def one_case(key, index):
    exercise = EXERCISES[key]
    return dataclasses.replace(exercise, cases=[exercise.cases[index]],
                               timeout=min(exercise.timeout, 6.0))


def report_text(key, index, fn):
    report = core.evaluate(one_case(key, index), fn)
    assert not report.passed
    return "\n".join(report.lines())


# --------------------------------------------------------------------- cheats


def closed_form(tensor):
    """No message: each rank adds up what the old checker gave every rank."""
    length, world = tensor.numel(), dist.get_world_size()
    tensor.copy_(sum(torch.arange(length, dtype=torch.float32) % 7 + 10 * (rank + 1)
                     for rank in range(world)))


def _sum_from(tensor, read):
    total = tensor.clone()
    for peer in range(dist.get_world_size()):
        if peer != dist.get_rank():
            total += torch.frombuffer(bytearray(read(f"cheat{peer}")), dtype=torch.float32)
    tensor.copy_(total)


def through_the_default_store(tensor):
    store = dist.distributed_c10d._get_default_store()
    store.set(f"cheat{dist.get_rank()}", tensor.numpy().tobytes())
    _sum_from(tensor, store.get)


def through_a_store_client_of_its_own(tensor):
    """A client of its own to MASTER_ADDR:MASTER_PORT, through methods taken before the
    checker wrapped them, closed again before the call returns."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False)
    _STORE_SET(store, f"cheat{dist.get_rank()}", tensor.numpy().tobytes())
    _sum_from(tensor, lambda key: _STORE_GET(store, key))


def through_the_default_store_unseen_by_python(tensor):
    """The launcher's store, through methods taken before the checker wrapped them: only
    the kernel sees it."""
    store = dist.distributed_c10d._get_default_store()
    _STORE_SET(store, f"cheat{dist.get_rank()}", tensor.numpy().tobytes())
    _sum_from(tensor, lambda key: _STORE_GET(store, key))


def to_every_rank_through_the_backend(tensor):
    """Whole tensors to every rank, through gloo's own send below the process group."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = tensor.clone()
    works = [backend.send([mine], peer, 0) for peer in range(world) if peer != rank]
    for peer in range(world):
        if peer != rank:
            incoming = torch.empty_like(mine)
            backend.recv([incoming], peer, 0).wait()
            tensor += incoming
    for work in works:
        work.wait()


def ring_with_unwrapped_sends(tensor):
    """The reference ring, its sends through the backend's original method."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(tensor.tensor_split(world))

    def exchange(send, receive):
        incoming = torch.empty_like(chunks[receive])
        work = _BACKEND_SEND(backend, [chunks[send].contiguous()], right, 0)
        dist.recv(incoming, left)
        work.wait()
        return incoming

    for step in range(world - 1):
        receive = (rank - step - 1) % world
        chunks[receive] += exchange((rank - step) % world, receive)
    for step in range(world - 1):
        receive = (rank - step) % world
        chunks[receive].copy_(exchange((rank - step + 1) % world, receive))


CHEAT_FOLDER = []  # set by the test before the ranks start (they inherit it)


def through_files(tensor):
    """Each rank writes its values to a file the others know the name of, and reads
    theirs (waiting for them to appear)."""
    import time

    folder, rank = CHEAT_FOLDER[0], dist.get_rank()
    with open(os.path.join(folder, f"{rank}.tmp"), "wb") as file:
        file.write(tensor.numpy().tobytes())
    os.replace(os.path.join(folder, f"{rank}.tmp"), os.path.join(folder, str(rank)))

    def read(key):
        path = os.path.join(folder, key.removeprefix("cheat"))
        while not os.path.exists(path):
            time.sleep(0.01)
        return open(path, "rb").read()

    _sum_from(tensor, read)


# shared memory made in the notebook's process, before the ranks start: each inherits it
SHARED_SLOTS = torch.zeros(4, 64).share_memory_()
SHARED_READY = torch.zeros(4).share_memory_()


def through_inherited_shared_memory(tensor):
    import time

    rank, world, length = dist.get_rank(), dist.get_world_size(), tensor.numel()
    SHARED_SLOTS[rank, :length] = tensor
    SHARED_READY[rank] = 1
    while SHARED_READY[:world].sum() < world:
        time.sleep(0.01)
    tensor.copy_(SHARED_SLOTS[:world, :length].sum(0))


def ring_on_a_copy(tensor):
    result = tensor.clone()
    solutions.bidirectional_all_reduce(result)
    return result


# ------------------------------------------------------------- on real ranks


def test_a_closed_form_without_messages_fails_on_fresh_inputs():
    text = report_text("03.1", 1, closed_form)
    assert "values differ, the first at index 0: expected " in text


def test_the_default_store_is_refused():
    text = report_text("03.1", 0, through_the_default_store)
    assert "it exchanged data through a store (the rendezvous TCPStore" in text
    assert "(it called get, set)" in text and "the data must go through send/recv" in text


def test_a_store_client_of_its_own_is_refused():
    text = report_text("03.1", 0, through_a_store_client_of_its_own)
    assert "through a store" in text and "(it called TCPStore(...))" in text


@linux_only
def test_the_store_reached_around_the_python_count_is_seen_by_the_kernel():
    text = report_text("03.1", 0, through_the_default_store_unseen_by_python)
    assert "through a store" in text and "bytes went through the store's connection" in text


@linux_only  # /proc/self/maps, and ranks forked from this process (they inherit the memory)
def test_files_and_inherited_shared_memory_are_refused_as_channels(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "CHEAT_FOLDER", [str(tmp_path)])
    for cheat, what in ((through_files, "wrote to the file"),
                        (through_inherited_shared_memory, "wrote to shared memory")):
        text = report_text("03.1", 0, cheat)
        assert "outside messages" in text and what in text, text
        assert "not through files or shared memory" in text


def test_a_send_through_the_backend_is_counted_and_judged():
    text = report_text("03.1", 1, to_every_rank_through_the_backend)  # 3 ranks, 7 elements
    assert ("this rank sent a message of 7 elements (28 bytes) to rank 1; a message holds "
            "one chunk of one half, at most 2 elements") in text


@linux_only
def test_a_send_the_python_count_cannot_see_is_seen_by_the_kernel():
    text = report_text("03.1", 4, ring_with_unwrapped_sends)  # 3 ranks, 1000 elements
    assert "but its send calls account for 0 (with gloo's headers, at most" in text


def test_a_result_returned_instead_of_written_in_place_is_named():
    text = report_text("03.1", 0, ring_on_a_copy)
    assert ("the input tensor was left unchanged and a new tensor was returned: the result "
            "must be written into the input tensor, in place") in text


# ------------------------------------------------------ judges, crafted results


def test_a_mismatch_names_the_first_differing_index_with_both_values():
    expected = torch.arange(10, dtype=torch.float32) * 1000003
    got = expected.clone()
    got[[3, 7]] = torch.tensor([-1.0, 5.0])
    assert ch03.same_tensor(got, expected) == (
        "2 of 10 values differ, the first at index 3: expected 3000009, got -1")
    got = expected.clone()
    got[9] = float("nan")
    assert ch03.same_tensor(got, expected) == (
        "1 of 10 values differs, at index 9: expected 9000027, got nan")
    assert ch03.same_tensor(expected.clone(), expected) is None
    grid = torch.zeros(2, 3)
    assert "index (1, 2): expected 0, got 4" in ch03.same_tensor(
        grid.index_put((torch.tensor(1), torch.tensor(2)), torch.tensor(4.0)), grid)


def ring_sends(length, world, phases, split):
    """Elements each rank of a ring sends: every chunk but one per phase, leaving out a
    different chunk in each (rank + 1 in the first phase, rank + 2 in the second)."""
    sizes = [len(chunk) for chunk in split(torch.empty(length), world)]
    return [sum(sum(sizes) - sizes[(rank + 1 + phase) % world] for phase in range(phases))
            for rank in range(world)]


def test_every_correct_ring_sends_at_least_the_rings_least_and_some_exactly_that():
    met = 0
    for world in (2, 3, 4):
        for length in range(1, 41):
            least, most = ch03.ring_bounds(length, world, 2)
            for split in (torch.tensor_split, torch.chunk):
                if len(split(torch.empty(length), world)) < world:
                    continue  # chunk gives fewer chunks than ranks: not a ring of them
                sent = ring_sends(length, world, 2, split)
                assert least <= min(sent) and max(sent) <= most, (world, length, sent)
                met += least == min(sent)
    assert met > 100
    assert ch03.ring_bounds(8, 2, 2) == (8, 8)          # 2(N-1)/N of 8 elements
    assert ch03.ring_bounds(3, 2, 2) == (3, 4)          # chunks of 2 and 1
    assert ch03.ring_bounds(7, 3, 2) == (8, 12)         # chunk's 3, 3, 1: 4 + 4
    assert ch03.ring_bounds(5 * 3, 3, 1) == (10, 10)    # reduce-scatter: (N-1)/N


def crafted(into="the input tensor", unchanged=False, returned=None, **traffic):
    summary = {"elements": 8, "bytes": 32, "peers": [1], "least": 8, "budget": 8,
               "element_size": 4, "neighbours": (1, 1), "store_calls": [],
               "kernel": {"peer_written": 320, "store": 0, "new_sockets": 0},
               "allowance": 512}
    summary.update(traffic)
    return {"result": torch.zeros(8), "collectives": [], "into": into,
            "unchanged": unchanged, "returned": returned, "traffic": summary}


def test_the_judge_asks_for_the_rings_least_traffic_in_elements_and_bytes():
    expected = torch.zeros(8)
    assert ch03._judge_point_to_point(crafted(), expected) is None
    short = ch03._judge_point_to_point(crafted(elements=2, bytes=8), expected)
    assert short.startswith("the sums are right, but this rank sent 2 elements (8 bytes) to "
                            "rank 1; in a ring each rank sends at least 8 elements (32 bytes)")
    silent = ch03._judge_point_to_point(crafted(elements=0, bytes=0, peers=[]), expected)
    assert "this rank sent 0 elements (0 bytes); in a ring" in silent


def test_the_judge_refuses_other_channels_before_the_values():
    expected = torch.ones(8)  # the values are wrong too: the channel is named first
    new = crafted(kernel={"peer_written": 0, "store": 0, "new_sockets": 4096})
    assert ch03._judge_point_to_point(new, expected).startswith(
        "4,096 bytes went through a connection opened during the call")
    store = crafted(kernel={"peer_written": 0, "store": 150, "new_sockets": 0})
    assert "150 bytes went through the store's connection" in ch03._judge_point_to_point(
        store, expected)
    elsewhere = ch03._judge_point_to_point(crafted(kernel=None), expected)
    assert elsewhere.startswith("8 of 8 values differ")  # off Linux: the values decide


def test_a_reduce_scatter_returned_instead_of_written_names_output():
    expected = torch.ones(8)
    got = crafted(into="`output`", unchanged=True, returned=torch.ones(8))
    assert ch03._judge_point_to_point(got, expected).startswith(
        "`output` was left unchanged and a new tensor was returned: the result must be "
        "written into `output`, in place")
    partly = crafted(returned=torch.ones(8))  # changed, but not to the result
    assert ch03._judge_point_to_point(partly, expected).startswith(
        "the input tensor does not hold the result and a new tensor was returned")


# ------------------------------------------------- 03.1: two rings, turning opposite ways


def two_ring_messages(world, length, rank, skip_empty=False, left_first=False):
    """(peer, elements, bytes) of each message a rank of a correct two-ring all-reduce
    sends, in order: in every step a chunk of the first half to rank + 1 and one of the
    second half to rank - 1 (``left_first``: that one first); ``skip_empty``: no message
    for an empty chunk."""
    right, left = (rank + 1) % world, (rank - 1) % world
    first, second = ([len(c) for c in half.tensor_split(world)]
                     for half in torch.empty(length).tensor_split(2))
    messages = []
    for s in list(range(world - 1)) + list(range(-1, world - 2)):
        step = [(right, first[(rank - s) % world]), (left, second[(rank + s) % world])]
        for peer, n in (step[::-1] if left_first else step):
            if n or not skip_empty:
                messages.append((peer, n, 4 * n))
    return messages


def two_rings(messages, world, length, rank=0):
    """The trial's summary of a rank's traffic, for the judge."""
    return {"messages": messages, "halves": ((length + 1) // 2, length // 2),
            "world": world, "neighbours": ((rank + 1) % world, (rank - 1) % world),
            "element_size": 4}


def test_every_correct_two_ring_order_passes_empty_chunks_skipped_or_not():
    for world in (2, 3, 4, 5, 8):
        for length in range(1, 50):
            for rank in range(world):
                for skip_empty in (False, True):
                    for left_first in (False, True):
                        messages = two_ring_messages(world, length, rank, skip_empty,
                                                     left_first)
                        verdict = ch03._judge_two_rings(two_rings(messages, world, length,
                                                                  rank))
                        assert verdict is None, (world, length, rank, skip_empty, verdict)


def test_two_rings_one_after_the_other_fail_by_the_order_of_their_messages():
    for world in (3, 4, 5):
        for length in range(2 * world, 40):  # no chunk empty: every step sends both ways
            messages = two_ring_messages(world, length, 0, skip_empty=True)
            right = [m for m in messages if m[0] == 1]
            left = [m for m in messages if m[0] != 1]
            in_sequence = ch03._judge_two_rings(two_rings(right + left, world, length))
            assert in_sequence == (
                f"the sums are right, but this rank sent all {2 * (world - 1)} messages to "
                f"rank 1 before the first to rank {world - 1}: the two rings must advance "
                "together, one chunk each way per step")
            half = world - 1  # reduce-scatter, then all-gather, each ring in turn
            in_turns = right[:half] + left[:half] + right[half:] + left[half:]
            verdict = ch03._judge_two_rings(two_rings(in_turns, world, length))
            assert verdict.startswith(f"the sums are right, but this rank had sent 2 "
                                      f"messages to rank 1 and none to rank {world - 1}: "
                                      "the two rings must advance together"), verdict


def test_each_direction_carries_its_own_halfs_ring_bytes():
    messages = two_ring_messages(4, 10, 0)  # halves of 5 and 5, chunks of 2, 1, 1, 1
    twice = messages + [m for m in messages if m[0] == 1]  # every right chunk sent twice
    assert ch03._judge_two_rings(two_rings(twice, 4, 10)).startswith(
        "the sums are right, but this rank sent 16 elements (64 bytes) to rank 1; the first "
        "half's ring (to rank + 1, 5 elements) sends it at most 12 elements (48 bytes)")
    short = [m for m in messages if m[0] == 1] + [m for m in messages if m[0] == 3][:1]
    assert ch03._judge_two_rings(two_rings(short, 4, 10)).startswith(
        "the sums are right, but this rank sent 2 elements (8 bytes) to rank 3; the second "
        "half's ring (to rank − 1, 5 elements) sends it at least 6 elements (24 bytes)")
    idle = [(1, 2, 8)] * 12
    assert "and none to rank 3: the second half goes round the ring that turns the other " \
        "way, to rank − 1 (rank 3)" in ch03._judge_two_rings(two_rings(idle, 4, 10))


def test_on_two_ranks_a_message_holds_one_chunk_of_a_half_not_of_the_tensor():
    one_way = [(1, 5, 20), (1, 4, 16)]  # section 2's ring on 9 elements: chunks of 5, 4
    assert ch03._judge_two_rings(two_rings(one_way, 2, 9)) == (
        "the sums are right, but this rank sent a message of 5 elements (20 bytes) to rank "
        "1; a message holds one chunk of one half, at most 3 elements here (the larger half "
        "has 5 elements, in 2 chunks): split the tensor with tensor_split(2), each half into "
        "N chunks, and send one chunk of each half per step")
    stray = two_ring_messages(4, 10, 0) + [(2, 1, 4)]
    assert "sent messages to rank 2; each rank sends only to its two neighbours, rank 1 " \
        "(rank + 1, the first half's ring) and rank 3" in ch03._judge_two_rings(
            two_rings(stray, 4, 10))


def test_inputs_are_whole_numbers_drawn_afresh():
    first, second = ch03.fresh_input(1000), ch03.fresh_input(1000)
    assert not torch.equal(first, second)
    assert torch.equal(first, first.round()) and first.abs().max() <= 2 ** 20


# ------------------------------------------------------------- the counters


@linux_only
def test_the_kernel_counts_bytes_on_peer_and_store_sockets(monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        with client, accepted:
            monkeypatch.delenv("MASTER_PORT", raising=False)
            before = traffic.tcp_sockets()
            client.sendall(b"x" * 1000)
            assert len(accepted.recv(1000, socket.MSG_WAITALL)) == 1000
            counted = traffic.kernel_bytes_between(before, traffic.tcp_sockets())
            assert counted.peer_written == 1000 and counted.store == 0
            monkeypatch.setenv("MASTER_PORT", str(server.getsockname()[1]))
            before = traffic.tcp_sockets()  # client: a store client; accepted: the server
            client.sendall(b"y" * 300)
            assert len(accepted.recv(300, socket.MSG_WAITALL)) == 300
            counted = traffic.kernel_bytes_between(before, traffic.tcp_sockets())
            assert counted.store == 300 and counted.peer_written == 0
            fresh = socket.create_connection(server.getsockname())
            with fresh:
                monkeypatch.delenv("MASTER_PORT")
                before = traffic.tcp_sockets()
                fresh.close()
                late = socket.create_connection(server.getsockname())
                with late:
                    late.sendall(b"z" * 50)
                    counted = traffic.kernel_bytes_between(before, traffic.tcp_sockets())
            assert counted.new_sockets >= 50


def test_store_calls_are_counted_and_the_methods_restored():
    store = dist.HashStore()
    original = dist.Store.set
    with traffic.traffic_measured() as measured:
        store.set("key", "value")
        assert store.get("key") == b"value"
        with pytest.raises(Exception):  # noqa: B017  an attempt that fails counts too
            store.wait(["missing"], __import__("datetime").timedelta(milliseconds=10))
    assert measured.store_calls == ["set", "get", "wait"] and measured.sent == []
    assert dist.Store.set is original
    assert (measured.kernel is not None) == ON_LINUX
