"""Chapter 09's labs: distributed-training bugs reproduced on purpose, and their fixes.

Each ``lab_*`` function runs inside a rank (``launch(lab_..., nprocs=2, timeout=...)``).
With ``fixed=False`` it contains the bug and fails (or returns evidence of it) within the
launch's ``timeout`` (the group's: the labs that hang wait exactly that long, so a short
one makes them fail fast); with ``fixed=True`` it runs the corrected code. They are small
on purpose: the point is the symptom, the tool that finds the cause, and the fix.

:func:`failure_summary` condenses a failed lab's report to the phrases that carry its
lesson, identical on every run and machine (the full report varies: which rank reported
first, gloo's source paths, timestamps).
"""

from __future__ import annotations

import datetime
import math
import os
import re
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, get_worker_info
from torchvision import transforms

from .. import recipe
from ..data.loading import loader_generator, seed_worker
from ..flight_recorder import collectives_so_far
from ..private_apis import ddp_logging_data, flight_recorder_dump
from ..ranks import rank, restart_count, world_size

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


# ------------------------------------------------------------ reading failures

#: Phrases that carry a lab's lesson, as they appear in the launcher's report or in
#: what the ranks printed before dying; :func:`failure_summary` quotes those it finds.
LESSON_PHRASES = (
    r"Ranks? \d+(?:, \d+)* failed to pass monitoredBarrier in \d+ ms",
    r"Timed out waiting \d+ms for \w+ operation",
    r"Expected to have finished reduction in the prior iteration",
    r"find_unused_parameters=True",
    r"Received data size doesn't match expected size",
)
_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\("
                          r"SequenceNumber=\d+, OpType=(\w+), TensorShape=\[([^\]]*)\]")
# "rank 1 killed by signal SIGKILL" (the root cause) or "  rank 1: killed by ..." (another
# rank); SIGTERM is the launcher stopping the others, not a cause.
_KILLED = re.compile(r"rank (\d+):? killed by signal (SIG(?!TERM\b)\w+)")
_ROOT_ERROR = re.compile(r"rank \d+ failed: (\w+): ")


def failure_summary(report: str, rank_output: str = "") -> str:
    """One line that says what went wrong, the same on every run and every machine.

    ``report`` is a ``LaunchError``'s text, ``rank_output`` what the ranks printed (gloo
    prints its last words there before aborting). The line names a rank killed by a
    signal, else the first failing rank's exception type; then the collectives each rank
    was running (from ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s report, in rank order) and the
    :data:`LESSON_PHRASES` found. Left out on purpose: which rank reported first (two
    ranks that time out together race for it), gloo's source paths, timestamps.
    """
    killed = sorted(set(_KILLED.findall(report)), key=lambda found: int(found[0]))
    if killed:
        head = ", ".join(f"rank {index} killed by signal {name}" for index, name in killed)
    else:
        root = _ROOT_ERROR.match(report)
        head = root.group(1) if root else "failed"
    details = []
    fingerprints = sorted(set(_FINGERPRINT.findall(report)), key=lambda f: int(f[0]))
    if fingerprints:
        details.append("Detected mismatch between collectives: " + ", ".join(
            f"rank {index} {op} of shape [{shape}]" for index, op, shape in fingerprints))
    text = f"{report}\n{rank_output}"
    phrases = [found.group(0) for pattern in LESSON_PHRASES
               if (found := re.search(pattern, text))]
    if any("monitoredBarrier" in phrase for phrase in phrases):
        # the barrier quotes its own wait's timeout as the cause, in the time it had left
        # (2000 ms, or 1999): the barrier's message, naming who is missing, says it all
        phrases = [phrase for phrase in phrases if not phrase.startswith("Timed out")]
    details += phrases
    if not details and not killed:  # an unexpected error: the launcher's first line
        details.append(_ROOT_ERROR.sub("", report.splitlines()[0]) if report else "no report")
    return ": ".join([head, " ... ".join(details)] if details else [head])


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


def lab_monitored_barrier(fixed: bool = False, seconds: float = 2.0,
                          wait_all_ranks: bool = False) -> str:
    """``monitored_barrier`` names the ranks that did not arrive (gloo only; rank 0
    collects everyone's acknowledgement with its own timeout). With the bug every rank
    but 0 stays away; it names the first missing rank, or with ``wait_all_ranks`` all of
    them."""
    if not fixed and rank() != 0:
        time.sleep(BUSY_SECONDS)
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=seconds),
                           wait_all_ranks=wait_all_ranks)
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


# ---------------------------------------------------- randomness per rank


def replicas_agree(model: nn.Module) -> bool:
    """Inside a rank: do all ranks hold exactly the same parameters? Every rank returns
    the same answer.

    Every byte of every parameter is compared with rank 0's (one broadcast), so weights
    that are permuted, or differ in ways that cancel in a sum, are caught too; a checksum
    (the sum of all weights) would miss both.
    """
    as_bytes = [p.detach().contiguous().reshape(-1).view(torch.uint8)
                for p in model.parameters()]
    device = as_bytes[0].device if as_bytes else torch.device("cpu")
    mine = torch.cat(as_bytes) if as_bytes else torch.zeros(0, dtype=torch.uint8, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size())]
    dist.all_gather(sizes, torch.tensor([mine.numel()], device=device))
    if any(size.item() != mine.numel() for size in sizes):
        return False  # every rank sees the same sizes, so all of them return here
    reference = mine.clone()
    dist.broadcast(reference, src=0)
    agree = torch.tensor([int(torch.equal(reference, mine))], device=device)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    return bool(agree.item())


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


def lab_fsdp_rank_dependent_init(fixed: bool = False) -> dict:
    """The same habit under FSDP2: ``fully_shard`` keeps each rank's own shard of the
    weights that rank initialised, and broadcasts nothing. With rank-dependent seeds the
    model is stitched from different ranks' initialisations. The fix: one seed for the
    model on every rank (for models too big to build whole, build on the ``meta`` device,
    shard, then ``to_empty`` and ``reset_parameters()`` under that seed, or load rank 0's
    weights with ``set_model_state_dict(..., broadcast_from_rank0=True)``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1234 if fixed else 1234 + rank())
    model = nn.Linear(8, 4)
    built = model.weight.detach().clone()  # what this rank initialised
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size(),)))
    return {"built": built, "sharded": model.weight.full_tensor()}


def lab_flight_recorder(folder: str, dump_after: float = 1.5) -> None:
    """Lab 2's collectives in a different order on each rank, with PyTorch's flight
    recorder: after ``dump_after`` seconds a timer thread writes this rank's record of
    its recent collectives to ``folder`` (what ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` does for
    NCCL when the watchdog fires), while the rank hangs until the group's timeout."""
    import threading
    from pathlib import Path

    def dump():
        records = flight_recorder_dump()
        Path(folder, f"rank{rank()}.pkl").write_bytes(records)

    timer = threading.Timer(dump_after, dump)
    timer.daemon = True
    timer.start()
    dist.all_reduce(torch.ones(2))  # a matched collective first
    lab_mismatched_order()


def lab_one_recorder_per_process() -> list[dict]:
    """Inside a rank: one all-reduce on the default group, one on a second group, then
    one dump of the flight recorder. The recorder is one per process, shared by its
    groups: the dump holds both collectives, each tagged with its group's ``pg_id`` and
    numbered in that group's own sequence, and each with the Python stack of its call
    (``frames``, recorded unless the dump leaves them out). Returns, per collective,
    ``{"pg_id", "seq", "name", "called_here"}`` (``called_here``: this function is in
    the recorded stack)."""
    import pickle

    group = dist.new_group()
    dist.all_reduce(torch.ones(2))
    dist.all_reduce(torch.ones(3), group=group)
    dump = flight_recorder_dump(stack_traces=True)
    return [{"pg_id": entry["pg_id"], "seq": entry["collective_seq_id"],
             "name": entry["profiling_name"],
             "called_here": any(frame["name"] == "lab_one_recorder_per_process"
                                for frame in entry["frames"])}
            for entry in pickle.loads(dump)["entries"][-2:]]


def flight_records(folder: str, ranks: int) -> list[dict]:
    """Each rank's dump from :func:`lab_flight_recorder`: its collectives as
    ``(sequence number, name, input sizes)`` and the last one it completed."""
    import pickle
    from pathlib import Path

    records = []
    for index in range(ranks):
        dump = pickle.loads(Path(folder, f"rank{index}.pkl").read_bytes())
        entries = [(e["collective_seq_id"], e["profiling_name"],
                    [list(size) for size in e["input_sizes"]]) for e in dump["entries"]]
        (status,) = dump["pg_status"].values()
        records.append({"collectives": entries,
                        "last_completed": status["last_completed_collective"]})
    return records


class AugmentationDraws(Dataset):
    """Stands in for an augmenting dataset: each sample draws its rotation angle exactly
    as torchvision's ``RandomAffine`` does (from torch's random generator, which the
    DataLoader seeds in each worker) and returns what it drew instead of an image."""

    def __init__(self, size: int, degrees: float = 30.0):
        self.size = size
        self.degrees = degrees

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[int, int, float]:
        angle, _, _, _ = transforms.RandomAffine.get_params(
            degrees=[-self.degrees, self.degrees], translate=None, scale_ranges=None,
            shears=None, img_size=[28, 28])
        worker = get_worker_info()
        return index, worker.id if worker is not None else -1, angle


def lab_identical_augmentation(fixed: bool = False, samples_per_rank: int = 8,
                               seed: int = 0) -> list[tuple[int, int, float]]:
    """Each rank loads its own samples (``DistributedSampler``) with 2 DataLoader
    workers, and every sample draws a rotation angle. The DataLoader seeds each worker
    from the loader's generator plus the worker's id, so the workers of one rank differ;
    with the same generator seed on every rank (the bug), the ranks draw the same angles
    for their different samples. The fix seeds each rank's loader differently
    (``loader_generator(seed, rank)``). Returns ``(sample, worker, angle)`` for every
    sample, in the order loaded."""
    dataset = AugmentationDraws(samples_per_rank * world_size())
    loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=False),
                        num_workers=2, collate_fn=list, worker_init_fn=seed_worker,
                        generator=loader_generator(seed, rank() if fixed else 0))
    return [draw for batch in loader for draw in batch]


# ------------------------------------------------------------- Lab 4: a rank crashes


@contextmanager
def rank_killed_at_epoch(epoch: int, victim: int = 1):
    """Inside a rank: while active, rank ``victim`` of :func:`~mgpu_helpers.recipe.train_digits`
    kills itself with SIGKILL as it starts training epoch ``epoch``, as a rank dies of an
    out-of-memory kill or a lost node: no exception, no report, no cleanup. Only on the
    first attempt: ranks restarted (``launch(max_restarts=...)``, torchrun) train on."""
    train_one_epoch = recipe.train_one_epoch

    def dying(*args, **kwargs):
        if kwargs.get("epoch") == epoch and rank() == victim and restart_count() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return train_one_epoch(*args, **kwargs)

    recipe.train_one_epoch = dying
    try:
        yield
    finally:
        recipe.train_one_epoch = train_one_epoch


def train_digits_with_a_crash(run: recipe.DigitsRun, epoch: int = 1, victim: int = 1) -> dict:
    """:func:`~mgpu_helpers.recipe.train_digits`, with rank ``victim`` killed as epoch
    ``epoch`` starts (see :func:`rank_killed_at_epoch`)."""
    with rank_killed_at_epoch(epoch, victim):
        return recipe.train_digits(run)

