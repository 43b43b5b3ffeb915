"""Lab 3, a DDP pitfall: a parameter that gets no gradient.

DDP waits for a gradient from every parameter before it finishes a step; one the forward
pass never uses leaves the reduction unfinished, and the next step raises.
:func:`lab_unused_parameter` runs the bug and its two fixes, and measures what each fix
costs: what DDP's reducer all-reduced, which collectives ran, what DDP's own debugging
record says.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ...measure.flight_recorder import collectives_so_far
from ...runtime.private_apis import ddp_logging_data


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


@dataclass
class DDPSteps:
    """What one rank saw while training with DDP: its cost and what DDP's reducer did.

    ``reduced_bytes``, ``reduced_parameters`` and ``zero_gradients`` are measured in the
    last step by a communication hook (DDP's default all-reduce, with a note of each
    bucket it is handed); ``step_collectives`` by the flight recorder, which also sees the
    collectives DDP runs outside the hook. ``found_unused_bytes`` and ``buckets_rebuilt``
    come from DDP's own debugging record (``DistributedDataParallel._get_ddp_logging_data()``,
    a prototype interface that DDP's documentation points to for this kind of check).
    """

    seconds_per_step: float
    reduced_bytes: int          # bytes of the gradient buckets all-reduced in the last step
    reduced_parameters: list[str]  # the parameters whose gradients those buckets held
    zero_gradients: list[str]   # ... of which the gradient was exactly zero everywhere
    step_collectives: list[tuple[str, int]]  # the last step's collectives: (name, elements)
    found_unused_bytes: int     # bytes of parameters the graph search found unused
    buckets_rebuilt: bool       # DDP re-ordered its buckets after step 1 (an optimisation)
    trained: dict[str, torch.Tensor]  # the final weights of the parameters the loss uses


def lab_unused_parameter(fix: str | None = None, steps: int = 20) -> DDPSteps:
    """DDP waits for a gradient from every parameter before it finishes a step. One that
    never gets one leaves the reduction unfinished, and the next step raises.

    ``fix="find_unused"`` passes ``find_unused_parameters=True``: DDP then searches the
    autograd graph after every forward pass and marks unused parameters ready (correct,
    at a cost: the search, the unused parameters' zero gradients all-reduced with the
    others, and a second all-reduce per step of which parameters each rank used).
    ``fix="remove"`` deletes the unused head before wrapping (the real fix when the head
    is not needed).
    """
    if fix not in (None, "find_unused", "remove"):
        raise ValueError(f"fix must be None, 'find_unused' or 'remove', got {fix!r}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    torch.manual_seed(0)
    module = TwoHeads()
    if fix == "remove":
        del module.unused_head
    names = {id(p): name for name, p in module.named_parameters()}
    model = DDP(module, find_unused_parameters=fix == "find_unused")
    buckets: list[dict] = []

    def noted_allreduce(state, bucket):  # DDP's default hook, with a note of each bucket
        buffer = bucket.buffer()
        held = [names[id(p)] for p in bucket.parameters()]
        buckets.append({"bytes": buffer.numel() * buffer.element_size(), "parameters": held,
                        "zero": [name for name, grad in zip(held, bucket.gradients(),
                                                            strict=True)
                                 if not grad.count_nonzero()]})
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, noted_allreduce)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(256, 32)
    start = time.perf_counter()
    for step in range(steps):
        buckets.clear()  # keep the last step's
        if step == steps - 1:
            recorded = len(collectives_so_far())  # the flight recorder's entries so far
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    seconds = (time.perf_counter() - start) / steps
    step_collectives = [(entry["profiling_name"], sum(math.prod(size) for size in
                                                      entry["input_sizes"]))
                        for entry in collectives_so_far()[recorded:]]
    record = ddp_logging_data(model)
    return DDPSteps(
        seconds_per_step=seconds, reduced_bytes=sum(b["bytes"] for b in buckets),
        reduced_parameters=sorted(name for b in buckets for name in b["parameters"]),
        zero_gradients=sorted(name for b in buckets for name in b["zero"]),
        step_collectives=step_collectives,
        found_unused_bytes=record["unused_parameter_size"],
        buckets_rebuilt=bool(record["has_rebuilt_buckets"]),
        trained={name: tensor.detach().clone() for name, tensor in module.state_dict().items()
                 if not name.startswith("unused_head.")})
