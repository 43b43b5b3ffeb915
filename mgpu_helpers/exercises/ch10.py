"""Chapter 10's exercises: the activation bytes of a GPT block, and FSDP2 per block with a
mixed-precision policy."""

from __future__ import annotations

import math
import random

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Replicate, Shard

from ..data.recall import RecallTask
from ..measure.flight_recorder import collectives_so_far
from ..measure.memory import ActivationMeter
from ..models.gpt import Block, GPTConfig
from ..planning import costs
from ..runtime.topology import ParallelDims
from ..training import gpt_recipe
from ..training.lm import lm_loss, model_for, rank_rows, step_batch
from .core import Case, Exercise, as_number, calls_during


def _refusal(called: list[str], task: str) -> str:
    return (f"your function called {', '.join(called)}, which does the work for you: "
            f"{task}")

# ------------------------------------------------------- 10.1 activation bytes


def _sizes(kind: str) -> dict:
    """Sizes drawn afresh on every run, so that no number copied from an earlier run
    (or worked out for the chapter's model) passes."""
    draw = random.SystemRandom()
    heads = draw.choice([1, 2, 3, 4, 6])
    return {"batch": draw.randint(1, 5), "length": draw.randint(3, 40),
            "dim": heads * draw.choice([4, 8, 12, 16]), "heads": heads,
            "mlp_ratio": 4 if kind != "mlp" else draw.choice([1, 2, 3, 8]),
            "element_bytes": 2 if kind == "bf16" else 4}


def _measured_block_bytes(batch, length, dim, heads, mlp_ratio, element_bytes) -> int:
    """What autograd keeps for one block's backward pass, measured (saved-tensor hooks)."""
    dtype = torch.bfloat16 if element_bytes == 2 else torch.float32
    config = GPTConfig(vocab_size=8, context=length, dim=dim, heads=heads,
                       mlp_ratio=mlp_ratio)
    with torch.random.fork_rng(devices=[]):  # the reader's random state stays as it was
        block = Block(config).to(dtype)
        x = torch.randn(batch, length, dim, dtype=dtype, requires_grad=True)
    with ActivationMeter(exclude=block.parameters()) as meter:
        block(x)
    return meter.peak


#: What would give the answer without working it out: measuring (the checker's own
#: measurement, the chapter's meter, autograd's hooks) or the chapter's formula.
_MEASURES = {_measured_block_bytes: "the checker's own measurement",
             ActivationMeter.__init__: "ActivationMeter",
             torch.autograd.graph.saved_tensors_hooks.__init__: "saved_tensors_hooks",
             costs.activation_bytes_per_block: "costs.activation_bytes_per_block",
             costs.activation_bytes: "costs.activation_bytes"}


def _activation_trial(fn, kind: str):
    sizes = _sizes(kind)
    value, called = calls_during(_MEASURES, fn, **sizes)
    return ({"bytes": value, "called": called},
            {"bytes": _measured_block_bytes(**sizes), "sizes": sizes})


def _activation_judge(got, expected) -> str | None:
    sizes, right = expected["sizes"], expected["bytes"]
    shown = ", ".join(f"{name}={value}" for name, value in sizes.items())
    if got["called"]:
        return _refusal(got["called"], "count the tensors the block keeps, from its sizes")
    got = got["bytes"]
    value = as_number(got)
    if value is None:
        return f"for {shown}: expected a number of bytes, got {type(got).__name__}"
    if value == right:
        return None
    if not math.isfinite(value) or value != int(value):
        return f"for {shown}: expected a whole number of bytes, {right:,}; got {value}"
    value = int(value)
    tokens = sizes["batch"] * sizes["length"]
    stream = tokens * sizes["dim"] * sizes["element_bytes"]
    missing = right - value
    why = ""
    if missing and missing % stream == 0:
        why = (f" ({abs(missing) // stream} residual-stream-sized "
               f"tensor{'s' if abs(missing) // stream > 1 else ''} "
               f"{'missing' if missing > 0 else 'too many'})")
    elif missing and missing % tokens == 0:
        verdict = "missing" if missing > 0 else "too many"
        why = f" ({abs(missing) // tokens} bytes per token {verdict}: the small per-token tensors?)"
    return f"for {shown}: expected {right:,} bytes, got {value:,}{why}"


# ------------------------------------------------- 10.2 FSDP2 per block, mixed precision


def _shard_trial(fn, replicate: int):
    world = dist.get_world_size()
    task = RecallTask()
    model = model_for(task, dim=32, layers=3, heads=2)
    mesh = ParallelDims(dp=replicate, fsdp=world // replicate).build_mesh("cpu")
    _, called = calls_during(
        {gpt_recipe.shard_model: "mgpu_helpers.training.gpt_recipe.shard_model"},
        fn, model, mesh)
    placements = sorted({tuple(p.placements) for p in model.parameters()
                         if hasattr(p, "placements")}, key=str)
    units = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    compute = []
    hook = model.blocks[0].attention.q.register_forward_pre_hook(
        lambda module, args: compute.append(module.weight.dtype))
    before = len(collectives_so_far())
    inputs, targets = rank_rows(step_batch(task, 0, 8), dist.get_rank(), world)
    loss = lm_loss(model(inputs), targets)
    forward = [(e["profiling_name"], tuple(e["input_dtypes"])) for e in
               collectives_so_far()[before:]]
    middle = len(collectives_so_far())
    loss.backward()
    backward = [(e["profiling_name"], tuple(e["input_dtypes"])) for e in
                collectives_so_far()[middle:]]
    hook.remove()
    sharded = all(hasattr(p, "placements") for p in model.parameters())
    # HSDP on a 2-D mesh: replicated along "dp", sharded by rows along "fsdp"
    expected = (Shard(0),) if replicate == 1 else (Replicate(), Shard(0))
    return ({"units": units, "compute": [str(d) for d in compute], "forward": forward,
             "backward": backward, "sharded": sharded, "called": called,
             "placements": [_shown(p) for p in placements]},
            {"units": ["", "blocks.0", "blocks.1", "blocks.2"], "replicate": replicate,
             "placements": [_shown(expected)]})


def _shown(placements: tuple) -> str:
    return "(" + ", ".join(map(repr, placements)) + ")"


def _reductions(collectives) -> list:
    # gloo runs FSDP2's reduce-scatter as an all-reduce; NCCL as a reduce-scatter
    return [(name, dtypes) for name, dtypes in collectives
            if name.endswith(("reduce_scatter", "all_reduce"))]


def _shard_judge(got, expected) -> str | None:
    if got["called"]:
        return _refusal(got["called"], "call fully_shard yourself")
    units = got["units"]
    if not units:
        return "no module was sharded: call fully_shard on each block, then on the model"
    if sorted(units) != expected["units"]:
        shown = ", ".join(repr(u) if u else "the model" for u in sorted(units))
        return (f"the FSDP units are {shown}; expected one per block and the model "
                "(the root): blocks.0, blocks.1, blocks.2 and the model itself")
    if not got["sharded"]:
        return "some parameters are not sharded (not DTensors) after your function"
    if got["placements"] != expected["placements"]:
        mesh = ("the 2-D mesh, replicated along dp and sharded along fsdp"
                if expected["replicate"] > 1 else "the mesh")
        return (f"the parameters' placements are {', '.join(got['placements'])}; expected "
                f"{expected['placements'][0]} on {mesh}: pass the whole mesh to fully_shard, "
                "not one of its dimensions")
    if got["compute"] != ["torch.bfloat16"]:
        return (f"inside block 0 the weights were {', '.join(got['compute'])} during the "
                "forward pass; expected torch.bfloat16 (MixedPrecisionPolicy's param_dtype)")
    gathers = [dtypes for name, dtypes in got["forward"] if name.endswith("all_gather")]
    if len(gathers) != 4:
        return (f"the forward pass ran {len(gathers)} all-gathers; expected 4, one per "
                "FSDP unit")
    if any(dtypes != ("BFloat16",) for dtypes in gathers):
        return (f"the forward pass gathered weights in {gathers[0][0]}; expected BFloat16: "
                "with param_dtype=torch.bfloat16 FSDP2 casts each shard before gathering it")
    reductions = _reductions(got["backward"])
    if not reductions:
        return "the backward pass reduced no gradients"
    low = [dtypes for _, dtypes in reductions if dtypes != ("Float",)]
    if low:
        return (f"gradients were reduced in {low[0][0]}; expected float32 "
                "(MixedPrecisionPolicy's reduce_dtype): a 16-bit sum over many ranks loses "
                "the small gradients")
    return None


EXERCISES = [
    Exercise(
        key="10.1", difficulty=2, minutes=30,
        title="the activation bytes of a block", function="block_activation_bytes",
        cases=[Case("float32, sizes drawn afresh", ("fp32",)),
               Case("float32, another MLP ratio", ("mlp",)),
               Case("bfloat16", ("bf16",))],
        trial=_activation_trial, judge=_activation_judge,
        hint="list what the block's backward pass needs, layer by layer: a linear layer its "
             "input, GELU its input, layer norm its input and two statistics per token, "
             "attention q, k, v, its output and one log-sum-exp per head and token "
             "(float32); a tensor two layers read is kept once",
    ),
    Exercise(
        key="10.2", difficulty=2, minutes=30,
        title="FSDP2 per block with a mixed-precision policy", function="shard",
        cases=[Case("2 ranks, FSDP2", (1,), 2), Case("4 ranks, HSDP (2 x 2)", (2,), 4)],
        trial=_shard_trial, judge=_shard_judge, timeout=30.0,
        hint="one MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
             "reduce_dtype=torch.float32); fully_shard(block, mesh=mesh, mp_policy=policy) "
             "for each block in model.blocks, then fully_shard(model, ...) with the same",
    ),
]
