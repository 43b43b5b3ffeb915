"""Chapter 10's production recipe: the GPT trained with FSDP2, as one function a rank runs.

:func:`train_gpt` is what every rank runs, under ``mh.launch``, ``torchrun`` or SLURM
(``scripts/train_gpt.py`` is its command line):

* the ranks form a mesh, ``(dp, fsdp)``: ``fsdp`` ranks shard every block, ``dp``
  replicas of that arrangement average their gradients (HSDP; ``replicate=1`` is plain
  FSDP2);
* each block is its own ``fully_shard`` unit (gathered just before it runs, freed after),
  then the root, with a ``MixedPrecisionPolicy``: 16-bit weights for the compute, float32
  for the gradient reduction; the sharded weights and AdamW's state stay float32. That
  wrapping step is the lesson: chapter 10 writes it in a cell and hands it to
  :func:`train_gpt` as ``shard``; :func:`shard_model` is the same step for the script;
* optionally each block is recomputed in backward (activation checkpointing) and
  compiled (``torch.compile``, one graph per block);
* gradient accumulation: ``set_requires_gradient_sync(False)`` on all but the last
  micro-batch of a step, so the gradients are reduced once per step;
* a distributed checkpoint every ``save_every`` steps (:mod:`mgpu_helpers.training.checkpoints`);
  a run started again with the same settings resumes from the newest one and continues
  exactly as the uninterrupted run (the data of a step is a function of the step), on
  the same or another number of ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..data.recall import RecallTask
from ..runtime.precision import amp_dtype_for
from ..runtime.ranks import device as rank_device
from ..runtime.ranks import print0, rank, world_size
from ..runtime.topology import ParallelDims
from .checkpoints import load, newest_to_resume, save, state_digest
from .lm import HELD_OUT_SEED, exact_match, lm_loss, model_for, rank_rows, step_batch

PRECISIONS = ("auto", "float32", "bfloat16", "float16")
CHOICES = ("none", "block")
#: What a resumed run must share with the run that saved: the model, its data and the
#: schedule. The ranks, the mesh, precision, recomputation and compilation may change.
RESUME_MUST_MATCH = ("steps", "global_batch", "lr", "warmup", "seed", "dim", "layers",
                     "heads", "pairs", "queries")


@dataclass
class GPTRun:
    """Settings of one run (the script's options). Sizes are the chapter's laptop model."""

    steps: int = field(default=300, metadata={"help": "optimizer steps"})
    global_batch: int = field(default=64, metadata={
        "help": "sequences per optimizer step over all ranks and micro-batches"})
    accumulate: int = field(default=1, metadata={
        "help": "micro-batches per optimizer step (gradients reduced once per step)"})
    lr: float = field(default=2e-3, metadata={"help": "AdamW's peak learning rate"})
    warmup: int = field(default=10, metadata={
        "help": "steps of linear warm-up; the rate then stays, and decays to 0 over the "
        "last fifth of the steps"})
    seed: int = field(default=0, metadata={"help": "seed of the weights and the data"})
    dim: int = field(default=64, metadata={"help": "the model's width"})
    layers: int = field(default=2, metadata={"help": "transformer blocks"})
    heads: int = field(default=4, metadata={"help": "attention heads per block"})
    pairs: int = field(default=4, metadata={"help": "key-value pairs per sequence"})
    queries: int = field(default=2, metadata={"help": "keys asked per sequence"})
    replicate: int = field(default=1, metadata={
        "help": "replicas of the sharded model (HSDP); 1 shards over every rank (FSDP2)"})
    precision: str = field(default="auto", metadata={
        "choices": PRECISIONS, "help": "weights for the compute: auto is bfloat16 on GPUs "
        "that have it, float16 with a gradient scaler on older ones, float32 on CPUs"})
    checkpointing: str = field(default="none", metadata={
        "choices": CHOICES, "help": "activation checkpointing: recompute each block"})
    compile: str = field(default="none", metadata={
        "choices": CHOICES, "help": "torch.compile each block"})
    checkpoint: Path | None = field(default=None, metadata={
        "help": "folder of distributed checkpoints; an existing one is resumed"})
    save_every: int = field(default=20, metadata={"help": "steps between checkpoints"})
    stop_after: int | None = field(default=None, metadata={
        "help": "end after this step, as if interrupted (resume by running again)"})
    verbose: bool = False  # rank 0 prints every save and resume

    def __post_init__(self):
        for name in ("steps", "global_batch", "accumulate", "dim", "layers", "heads", "pairs",
                     "queries", "replicate", "save_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.warmup < 0 or self.lr <= 0:
            raise ValueError(f"warmup must be >= 0 and lr > 0, got {self.warmup}, {self.lr}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got "
                             f"{self.precision!r}")
        for name in ("checkpointing", "compile"):
            if getattr(self, name) not in CHOICES:
                raise ValueError(f"{name} must be 'none' or 'block', got {getattr(self, name)!r}")
        if self.checkpoint is not None:
            self.checkpoint = Path(self.checkpoint)

    @property
    def task(self) -> RecallTask:
        return RecallTask(pairs=self.pairs, queries=self.queries)

    def resume_settings(self) -> dict:
        """The settings a run resuming this one's checkpoints must share."""
        return {name: getattr(self, name) for name in RESUME_MUST_MATCH}


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Warm-up, stable, decay: a linear ramp over ``warmup`` steps, the peak rate, then a
    linear decay to 0 over the last fifth of the run. (A cosine from the start would
    slow the recall task's learning down before its attention heads form.)"""
    decay_from = steps - steps // 5
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if step < decay_from:
        return 1.0
    return max(0.0, (steps - step) / (steps - decay_from))


def compute_dtype(choice: str, device: torch.device) -> torch.dtype:
    """The weights' dtype in forward and backward: ``"auto"`` is float32 on CPUs (no
    gain there on most, and CPU checks compare exactly) and the GPU's 16-bit type."""
    if choice == "auto":
        return torch.float32 if device.type == "cpu" else amp_dtype_for(device)
    return {"float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[choice]


def shard_model(model, mesh, param_dtype: torch.dtype) -> None:
    """FSDP2, per block then the root. The policy casts the gathered weights to
    ``param_dtype`` for the compute and reduces the gradients in float32."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


#: The FSDP2 wrapping step :func:`train_gpt` applies: ``shard(model, mesh, param_dtype)``
#: shards the built model in place.
ShardStep = Callable[[torch.nn.Module, object, torch.dtype], None]


def train_gpt(run: GPTRun, shard: ShardStep = shard_model) -> dict:
    """One rank's run. Returns the settings, every step's loss (the mean over all
    ranks' sequences), the held-out exact-match accuracy, the step the run resumed from,
    the seconds spent in the first step (compilation included) and the digest of this
    rank's final state (:func:`state_digest`).

    Args:
        run: the settings.
        shard: the FSDP2 wrapping step, called once on the built model (on this rank's
            device, blocks compiled if asked) with the ``(dp, fsdp)`` mesh and the
            compute dtype; :func:`shard_model` by default.
    """
    if not callable(shard):
        raise TypeError(f"shard must be a function shard(model, mesh, param_dtype), got "
                        f"{shard!r}: pass the wrapping step itself, not its result")
    device, world = rank_device(), world_size()
    if world % run.replicate:
        raise ValueError(f"replicate={run.replicate} does not divide the {world} ranks")
    per_rank = run.global_batch // (world * run.accumulate)
    if per_rank * world * run.accumulate != run.global_batch:
        raise ValueError(f"a global batch of {run.global_batch} does not split into "
                         f"{world} ranks x {run.accumulate} micro-batches of equal size")
    mesh = ParallelDims(dp=run.replicate, fsdp=world // run.replicate).build_mesh()
    task, dtype = run.task, compute_dtype(run.precision, device)

    model = model_for(task, run.seed, dim=run.dim, layers=run.layers, heads=run.heads)
    model.activation_checkpointing = run.checkpointing == "block"
    if run.compile == "block":
        for block in model.blocks:
            block.compile()
    model.to(device)
    shard(model, mesh, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, run.steps, run.warmup))
    # float16 loses small gradients to underflow: scale the loss, unscale before the step
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None

    start = 0
    resumed = (newest_to_resume(run.checkpoint, run.resume_settings())
               if run.checkpoint is not None else None)
    if resumed is not None:
        start = load(resumed, model, optimizer, scheduler)
        if run.verbose:
            print0(f"resumed from {resumed} at step {start}")
    last = run.steps if run.stop_after is None else min(run.steps, run.stop_after)
    losses, first_step_seconds = [], None
    for step in range(start, last):
        began = time.perf_counter()
        inputs, targets = rank_rows(step_batch(task, step, run.global_batch, run.seed),
                                    rank(), world)
        step_loss = torch.zeros((), device=device)
        for micro in range(run.accumulate):
            rows = slice(micro * per_rank, (micro + 1) * per_rank)
            # reduce-scatter the gradients after the last micro-batch only
            model.set_requires_gradient_sync(micro == run.accumulate - 1)
            loss = lm_loss(model(inputs[rows].to(device)), targets[rows].to(device))
            loss = loss / run.accumulate
            (scaler.scale(loss) if scaler else loss).backward()
            step_loss += loss.detach()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world)
        if first_step_seconds is None:
            first_step_seconds = time.perf_counter() - began
        if run.checkpoint is not None and ((step + 1) % run.save_every == 0
                                           or step + 1 == run.steps):
            folder = save(run.checkpoint, step + 1, model, optimizer, scheduler,
                          run.resume_settings())
            if run.verbose:
                print0(f"saved {folder}")

    digest = state_digest(model, optimizer)  # before a forward unshards the root's weights
    held_out = rank_rows(task.sequences(256 // world * world, HELD_OUT_SEED), rank(), world)
    accuracy = exact_match(model, *(tensor.to(device) for tensor in held_out))
    settings = {key: str(value) if isinstance(value, Path) else value
                for key, value in asdict(run).items()}
    return {"settings": settings, "losses": losses, "resumed_at": start,
            "exact_match": accuracy, "first_step_seconds": first_step_seconds,
            "steps_run": last - start, "world_size": world,
            "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True)),
            "lr_at_end": scheduler.get_last_lr()[0],
            "state_digest": digest}
