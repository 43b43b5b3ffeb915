"""mgpu_helpers.measure.traffic.side_channels: the ways ranks on one machine can pass data outside
sockets (a file, shared memory made or inherited), seen while a block runs; reading a
file or shared memory is no message."""

import os

import pytest
import torch

import mgpu_helpers as mh

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

# made before the ranks start: each rank inherits the mapping (fork), a channel between them
INHERITED = torch.zeros(16).share_memory_()
KEPT = []


def _attempts(folder):
    import torch.distributed as dist

    from mgpu_helpers.measure.traffic import side_channels

    rank = dist.get_rank()
    attempts = {
        "nothing": lambda: torch.ones(3).sum(),
        "read a file": lambda: open(__file__).read(),
        "read inherited memory": lambda: INHERITED.sum(),
        "open() for writing": lambda: open(os.path.join(folder, f"w{rank}"), "w").close(),
        "os.open with O_CREAT": lambda: os.close(os.open(os.path.join(folder, f"o{rank}"),
                                                         os.O_CREAT | os.O_WRONLY)),
        "write inherited memory": lambda: INHERITED.fill_(rank + 1),
        "SharedMemory": _shared_memory_block,
        "a tensor's share_memory_()": lambda: KEPT.append(torch.ones(4).share_memory_()),
    }
    seen = {}
    for name, attempt in attempts.items():
        dist.barrier()  # one attempt at a time: a rank sees another's write to shared memory
        with side_channels() as found:
            attempt()
        seen[name] = list(found)
    with side_channels((folder,)) as found:  # the checker's own folder is ignored
        open(os.path.join(folder, f"ignored{rank}"), "w").close()
    seen["under an ignored path"] = list(found)
    return seen


def _shared_memory_block():
    from multiprocessing import shared_memory

    block = shared_memory.SharedMemory(create=True, size=64)
    block.buf[0] = 1
    block.close()
    block.unlink()


def test_files_written_and_shared_memory_made_or_written_are_seen_reads_are_not(tmp_path):
    # CPU check (gloo on every machine): processes on one machine, the channels in question
    for seen in mh.launch(_attempts, str(tmp_path), nprocs=2, backend="gloo", return_all=True):
        assert seen["nothing"] == seen["read a file"] == seen["read inherited memory"] == []
        assert seen["under an ignored path"] == []
        assert [line.split(" /")[0] for line in seen["open() for writing"]] == [
            "wrote to the file"]
        assert seen["os.open with O_CREAT"][0].startswith("wrote to the file " + str(tmp_path))
        assert seen["write inherited memory"] == [
            next(line for line in seen["write inherited memory"]
                 if line.startswith("wrote to shared memory (/dev/shm/"))]
        assert seen["SharedMemory"][0].startswith("mapped a file into memory")
        assert seen["a tensor's share_memory_()"][0].startswith("created shared memory")
