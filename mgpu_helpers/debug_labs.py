"""Chapter 08's labs: distributed-training bugs reproduced on purpose, and their fixes.

Each ``lab_*`` function runs inside a rank (``launch(lab_..., nprocs=2, timeout=...)``).
With ``fixed=False`` it contains the bug and fails (or returns evidence of it) within the
launch's timeout; with ``fixed=True`` it runs the corrected code. They are small on
purpose: the point is the symptom, the tool that finds the cause, and the fix.
"""

from __future__ import annotations

import datetime
import os
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .data.loading import loader_generator
from .dist import rank, world_size

BUSY_SECONDS = 60  # how long a "busy" rank would stay away: far beyond every timeout


@contextmanager
def distributed_debug(level: str = "DETAIL"):
    """Set ``TORCH_DISTRIBUTED_DEBUG`` for ranks launched inside the block.

    PyTorch reads the variable when ``torch.distributed`` is imported; forked ranks
    inherit the parent's reading, so setting ``os.environ`` alone in a notebook does
    nothing. This sets the variable and re-reads it, and restores both afterwards.
    """
    if level not in ("OFF", "INFO", "DETAIL"):
        raise ValueError(f"level must be OFF, INFO or DETAIL, got {level!r}")
    before = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = level
    dist.set_debug_level_from_env()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        else:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = before
        dist.set_debug_level_from_env()


# ------------------------------------------------------------ hangs


def lab_collective_on_one_rank(fixed: bool = False) -> float:
    """Rank 0 sums a tensor with everybody; with the bug, the others never call it
    (they are "busy": a branch that only rank 0 takes, e.g. ``if is_main(): log(...)``
    with a collective inside). Rank 0 waits until the group's timeout."""
    tensor = torch.ones(4)
    if fixed or rank() == 0:
        dist.all_reduce(tensor)
    else:
        time.sleep(BUSY_SECONDS)
    return tensor.sum().item()


def lab_monitored_barrier(fixed: bool = False, seconds: float = 2.0) -> str:
    """``monitored_barrier`` names the ranks that did not arrive (gloo only; rank 0
    collects everyone's acknowledgement with its own timeout)."""
    if not fixed and rank() != 0:
        time.sleep(BUSY_SECONDS)
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=seconds))
    return "all ranks passed the barrier"


# --------------------------------------------------------- desyncs


def lab_mismatched_shapes(fixed: bool = False) -> list:
    """Every rank calls the collective, but with a different shape (e.g. the last
    partial batch of a rank). gloo aborts the process; with TORCH_DISTRIBUTED_DEBUG=
    DETAIL each collective is first checked across ranks and the mismatch is named."""
    tensor = torch.ones(4 if fixed else 4 + rank())
    dist.all_reduce(tensor)
    return tensor.tolist()


def lab_mismatched_order(fixed: bool = False) -> list:
    """Every rank calls the same two collectives, in a different order."""
    summed, shared = torch.ones(3), torch.full((3,), float(rank()))
    if fixed or rank() == 0:
        dist.all_reduce(summed)
        dist.broadcast(shared, src=0)
    else:
        dist.broadcast(shared, src=0)
        dist.all_reduce(summed)
    return summed.tolist() + shared.tolist()


# ------------------------------------------------------- DDP pitfalls


class TwoHeads(nn.Module):
    """A model with a head the forward pass does not use (an auxiliary head switched
    off, a layer left over from an experiment)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(32, 64)
        self.head = nn.Linear(64, 4)
        self.unused_head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def lab_unused_parameter(fix: str | None = None, steps: int = 20) -> float:
    """DDP waits for a gradient from every parameter before it finishes a step. One that
    never gets one leaves the reduction unfinished, and the next step raises.

    ``fix="find_unused"`` passes ``find_unused_parameters=True``: DDP then searches the
    autograd graph after every forward pass and marks unused parameters ready (correct,
    at a cost). ``fix="remove"`` deletes the unused head before wrapping (the real fix
    when the head is not needed). Returns seconds per training step.
    """
    if fix not in (None, "find_unused", "remove"):
        raise ValueError(f"fix must be None, 'find_unused' or 'remove', got {fix!r}")
    torch.manual_seed(0)
    module = TwoHeads()
    if fix == "remove":
        del module.unused_head
    model = DDP(module, find_unused_parameters=fix == "find_unused")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(256, 32)
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    return (time.perf_counter() - start) / steps


# ---------------------------------------------------- randomness per rank


def replicas_agree(model: nn.Module) -> bool:
    """Inside a rank: do all ranks hold the same weights? (all_gather of a checksum)"""
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
    gathered = [torch.zeros((), dtype=torch.float64) for _ in range(world_size())]
    dist.all_gather(gathered, checksum.reshape(()))
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def lab_rank_dependent_init(fixed: bool = False) -> bool:
    """Each rank seeds from its rank (a common "make workers differ" habit) and trains
    without DDP's initial broadcast (hand-written all-reduce, or parameters added after
    wrapping). The fix: broadcast rank 0's weights (or seed identically)."""
    torch.manual_seed(1234 + rank())
    model = nn.Linear(8, 2)
    if fixed:
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)
    return replicas_agree(model)


def lab_identical_augmentation(fixed: bool = False, samples: int = 8) -> list[float]:
    """Each rank draws the rotation angles of its own samples. With one loader seed on
    every rank, all ranks apply the *same* random sequence to different images; the
    fix seeds per rank (``loader_generator(seed, rank)``). Returns the angles drawn."""
    generator = loader_generator(0, rank() if fixed else 0)
    return [float(torch.empty(1).uniform_(-30, 30, generator=generator))
            for _ in range(samples)]
