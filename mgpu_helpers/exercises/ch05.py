"""Chapter 05's exercises: a gradient-compression hook, accumulation with ``no_sync`` over
micro-batches of different sizes, batch-norm statistics over all ranks that float32 does
not ruin, each checked on gloo ranks against PyTorch's own; and a training script that
torchrun starts and that resumes from its checkpoint, run under torchrun on CPU processes.
"""

from __future__ import annotations

import copy
import linecache
import math
import os
import tempfile
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..measure.flight_recorder import collectives_so_far
from .core import Case, Exercise, beyond, calls_during, count, largest_abs, shared_fresh_seed

# ---------------------------------------------------------------- 05.1 float16 hook

def _hook_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))


def _hook_gradients(hook, inputs: torch.Tensor, loss_scale: float,
                    sent: list | None = None) -> list[torch.Tensor]:
    """Two backward passes of a DDP model with ``hook`` (None: DDP's default), several
    buckets (a 10 kB cap); the gradients after each. ``sent`` receives the dtypes of the
    collectives run during the backward passes (where DDP calls the hook)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _hook_model()
    ddp = DDP(model, bucket_cap_mb=0.01)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    seen = []
    for step in range(2):
        ddp.zero_grad()
        loss = ddp(inputs[step]).square().mean() * loss_scale
        before = len(collectives_so_far())
        loss.backward()
        if sent is not None:
            sent += [dtype for entry in collectives_so_far()[before:]
                     for dtype in entry["input_dtypes"]]
        seen.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())
    return seen


def _hook_trial(fn, same_inputs: bool, near_limit: bool):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    seed = shared_fresh_seed() + (0 if same_inputs else dist.get_rank())  # afresh
    inputs = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(seed))
    loss_scale = 1.0
    if near_limit:  # a loss scale, as a GradScaler applies: gradients near 50,000
        plain = _hook_gradients(None, inputs, 1.0)
        loss_scale = 50_000 / max(largest_abs(g) for g in plain)
    default = _hook_gradients(None, inputs, loss_scale)
    torch_hook = _hook_gradients(default_hooks.fp16_compress_hook, inputs, loss_scale)
    sent: list[str] = []
    seen = {"library": [], "results": set(), "returned": []}
    watched = _watched(fn, seen)  # torch's hooks looked up before they are replaced below
    with _recording_torch_hooks() as library:
        mine = _hook_gradients(watched, inputs, loss_scale, sent)
    return ({"gradients": mine, "dtypes": sorted(set(sent)),
             # torch's public hooks named before the private functions they call
             "library": sorted(dict.fromkeys([*seen["library"], *sorted(library)]),
                               key=lambda name: name.startswith("_")),
             "results": sorted(seen["results"]), "returned": seen["returned"][:1]},
            {"default": default, "torch": torch_hook})


def _torch_hooks() -> dict:
    """Every function of torch's default_hooks, the hooks that its wrappers return
    included (nested code), for calls_during: recognised by their code, whatever name
    the reader imported them under."""
    import types

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    found = {}
    for name, function in vars(default_hooks).items():
        if not (isinstance(function, types.FunctionType)
                and function.__module__ == default_hooks.__name__):
            continue
        found[function] = name
        for const in function.__code__.co_consts:  # the hook a wrapper returns
            if isinstance(const, types.CodeType) and "hook" in const.co_name:
                cells = tuple(types.CellType() for _ in const.co_freevars)
                found[types.FunctionType(const, {}, const.co_name, None, cells)] = name
    return found


def _watched(fn, seen: dict):
    """``fn`` as DDP calls it, with what it calls of torch's hooks and the dtype of the
    tensor its future holds written into ``seen``; the result is passed on unchanged, but
    for a result that is no Future: noted in ``seen`` (its type, and the reader's line
    that returned it), and replaced by one that leaves the bucket as it is."""
    hooks = _torch_hooks()

    def hook(state, bucket):
        returned_from: list = []
        result, used = calls_during(hooks, fn, state, bucket, returned_from=returned_from)
        seen["library"].extend(name for name in used if name not in seen["library"])
        if not isinstance(result, torch._C.Future):  # torch.futures.Future is one too
            # DDP would fail with an internal cast error: note what came back, where, and
            # let DDP go on with the bucket as it is (the case fails on the note)
            path, line, name = returned_from[-1] if returned_from else ("", 0, "")
            seen["returned"].append((type(result).__name__, name, path, line,
                                     linecache.getline(path, line).strip() if path else ""))
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        def note(future):
            value = future.value()
            tensor = value[0] if isinstance(value, (list, tuple)) and value else value
            seen["results"].add(str(tensor.dtype).removeprefix("torch.")
                                if isinstance(tensor, torch.Tensor) else type(tensor).__name__)
            return value

        return result.then(note)

    return hook


@contextmanager
def _recording_torch_hooks():
    """A set that receives the names of torch's own DDP hooks called while the block
    runs. Every hook of ``default_hooks`` goes through ``_compress_hook`` (the fp16 and
    bf16 hooks) or ``_allreduce_fut`` (``allreduce_hook``, which the compress wrappers
    call), looked up in that module at each call, whatever name the reader imported."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    called: set[str] = set()
    originals = {name: getattr(default_hooks, name)
                 for name in ("_compress_hook", "_allreduce_fut")}

    def compress(dtype, *args, **kwargs):
        called.add("bf16_compress_hook" if dtype == torch.bfloat16 else "fp16_compress_hook")
        return originals["_compress_hook"](dtype, *args, **kwargs)

    def allreduce(*args, **kwargs):
        called.add("allreduce_hook")
        return originals["_allreduce_fut"](*args, **kwargs)

    default_hooks._compress_hook, default_hooks._allreduce_fut = compress, allreduce
    try:
        yield called
    finally:
        for name, original in originals.items():
            setattr(default_hooks, name, original)


def _not_a_future(kind: str, function: str, path: str, line: int, source: str) -> str:
    what = {"Work": "a Work (what async_op=True gives)", "NoneType": "None"}.get(
        kind, f"a {kind}")
    where = (f" (line {line} of {function}, {path}" + (f": `{source}`" if source else "")
             + ")") if path else ""
    return (f"the hook returned {what}, not a torch.futures.Future{where}: DDP waits on the "
            "future a hook returns and takes the bucket's averaged gradients from its value, "
            "a float32 tensor shaped like bucket.buffer()")


def _hook_judge(got, expected) -> str | None:
    if got["library"]:
        return (f"the hook calls torch's {got['library'][0]} (ddp_comm_hooks.default_hooks): "
                "the exercise is to write the hook yourself, from bucket.buffer() and "
                "dist.all_reduce")
    if got.get("returned"):
        return _not_a_future(*got["returned"][0])
    if got["dtypes"] != ["Half"]:
        sent = ", ".join(got["dtypes"]) or "nothing"
        return (f"the hook's collectives sent {sent} tensors, expected only Half (float16): "
                "compress the bucket before the all-reduce")
    if got["results"] != ["float32"]:
        held = ", ".join(got["results"]) or "nothing"
        return (f"the hook's future holds {held}, expected float32: DDP takes the average "
                "in the buffer's dtype, float32, shaped like bucket.buffer() (the float16 "
                "tensor is only what travels)")
    for step, (mine, default, torch_hook) in enumerate(zip(
            got["gradients"], expected["default"], expected["torch"], strict=True)):
        if not torch.isfinite(mine).all():
            wrong = int((~torch.isfinite(mine)).sum())
            return (f"backward {step + 1}: {wrong} of {mine.numel()} gradients came back inf "
                    f"or nan (DDP's own: largest {largest_abs(default):,.5g}); float16's largest "
                    "value is 65,504")
        scale = largest_abs(default)
        tolerance = 2e-3 * scale  # float16 keeps 11 significant bits
        for name, reference in (("DDP's default all-reduce", default),
                                ("torch's fp16_compress_hook", torch_hook)):
            difference = largest_abs(mine - reference)
            if beyond(difference, tolerance):
                ratio = (mine @ reference / (reference @ reference)).item()
                if abs(ratio - 1) > 0.01:
                    return (f"backward {step + 1}: the gradients are about {ratio:.3g} times "
                            f"those of {name}")
                return (f"backward {step + 1}: the gradients differ from those of {name} by up to "
                        f"{difference / scale:.2g} of the largest gradient, more than "
                        "float16's rounding (0.002)")
    return None


# ---------------------------------------------------------------- 05.2 no_sync, weighted

def _accumulation_data(sizes: tuple[tuple[int, ...], ...], steps: int, seed: int) -> list:
    """Every rank's micro-batches of every step, ``[step][rank][i] = (inputs, labels)``:
    ``sizes[rank]`` are the sizes of rank ``rank``'s micro-batches (every rank draws the
    same data from ``seed``, drawn afresh for each check, and takes its own)."""
    generator = torch.Generator().manual_seed(seed)
    return [[[(torch.randn(size, 8, generator=generator),
               torch.randint(0, 3, (size,), generator=generator))
              for size in rank_sizes] for rank_sizes in sizes] for _ in range(steps)]


def _small_classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _accumulation_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _big_batch_steps(data: list) -> list[torch.Tensor]:
    """One process, one step per step on every sample of every rank at once: the mean
    cross-entropy over all of them."""
    model = _small_classifier()
    optimizer = _accumulation_optimizer(model)
    for step in data:
        optimizer.zero_grad()
        inputs = torch.cat([x for rank in step for x, _ in rank])
        labels = torch.cat([y for rank in step for _, y in rank])
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _weighted_steps(data: list, weight) -> list[torch.Tensor]:
    """One process, the steps of DDP ranks whose loss is the sum over their micro-batches
    of ``weight(rank, i)`` times micro-batch i's mean loss (DDP averages the ranks'
    gradients: the loss of a step is the mean of the ranks' losses)."""
    model = _small_classifier()
    optimizer = _accumulation_optimizer(model)
    for step in data:
        optimizer.zero_grad()
        loss = sum(weight(rank, i) * F.cross_entropy(model(x), y)
                   for rank, micro_batches in enumerate(step)
                   for i, (x, y) in enumerate(micro_batches)) / len(step)
        loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _elements(entry: dict) -> int:
    """How many numbers a flight recorder entry's collective sent (its first input)."""
    sizes = entry["input_sizes"][0] if entry["input_sizes"] else []
    return math.prod(sizes)


def _accumulation_trial(fn, sizes: tuple[tuple[int, ...], ...], steps: int = 3):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    data = _accumulation_data(sizes, steps, shared_fresh_seed())
    model = DDP(_small_classifier())  # one bucket: one all-reduce per synchronised backward
    optimizer = _accumulation_optimizer(model)
    forwards: list[tuple[int, bool]] = []  # (batch size, whether its backward all-reduces)

    def record(module, args, kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        size = tensors[0].shape[0] if tensors and tensors[0].dim() else 1
        # no_sync() clears this flag; DDP reads it in forward to prepare the all-reduce
        forwards.append((size, model.require_backward_grad_sync))

    model.module.register_forward_pre_hook(record, with_kwargs=True)
    before = len(collectives_so_far())
    for step in range(steps):
        fn(model, optimizer, [(x.clone(), y.clone()) for x, y in data[step][rank]])
    # DDP's gradient all-reduce is the bucket's, of every parameter; a count the reader
    # all-reduces is smaller
    parameters = sum(p.numel() for p in model.parameters())
    gradient_all_reduces = sum(entry["profiling_name"].endswith("all_reduce")
                               and _elements(entry) == parameters
                               for entry in collectives_so_far()[before:])
    counts = [sum(rank_sizes) for rank_sizes in sizes]
    world, total = len(sizes), sum(counts)
    candidates = {  # what a plausible wrong weighting computes, to name the mistake
        # first: with one micro-batch per rank, dividing by k is weighting per rank
        "per rank": _weighted_steps(data, lambda r, i: sizes[r][i] / counts[r]),
        "per micro-batch": _weighted_steps(data, lambda r, i: 1 / len(sizes[r])),
        "world size": _weighted_steps(data, lambda r, i: sizes[r][i] / total),
    }
    return ({"weights": [p.detach().clone() for p in model.module.parameters()],
             "all_reduces": gradient_all_reduces, "forwards": forwards},
            {"weights": _big_batch_steps(data), "all_reduces": steps, "world": world,
             "forwards": list(sizes[rank]) * steps, "sizes": sizes, "counts": counts,
             "candidates": candidates})


def _largest_difference(mine: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    # torch's max keeps a nan (Python's max may drop it)
    return float(torch.tensor([largest_abs(a - b) for a, b in zip(
        mine, reference, strict=True)]).max())


def _weighting_mistake(name: str, expected: dict) -> str:
    sizes, counts, world = expected["sizes"], expected["counts"], expected["world"]
    if name == "per micro-batch":
        small, large = min(min(s) for s in sizes), max(max(s) for s in sizes)
        return (f"these are the weights of each micro-batch's mean loss divided by k (section "
                f"5's step, exact only when the micro-batches are equal): a micro-batch of "
                f"{small} samples then weighs as much as one of {large}. Weight every sample "
                "alike")
    if name == "per rank":
        most, fewest = counts.index(max(counts)), counts.index(min(counts))
        return (f"these are the weights of each rank's mean over its own samples, which DDP "
                f"then averages: rank {most}'s {counts[most]} samples weigh as much in all as "
                f"rank {fewest}'s {counts[fewest]}. Divide by the number of samples on all "
                "ranks (one all-reduce of the count)")
    return (f"these are the weights of gradients {world} times too small (1/world size): DDP "
            f"divides the all-reduced sum of the ranks' gradients by the world size, {world}")


def _accumulation_judge(got, expected) -> str | None:
    problems = []
    sizes = [size for size, _ in got["forwards"]]
    if sizes != expected["forwards"]:
        wanted = expected["forwards"]
        problems.append(f"the model ran forward passes on batches of {sorted(set(sizes))} "
                        f"samples ({len(sizes)} in all), expected one per micro-batch "
                        f"({len(wanted)}, of {sorted(set(wanted))})")
    steps, all_reduces = expected["all_reduces"], got["all_reduces"]
    if all_reduces != steps:
        synchronised = sum(sync for _, sync in got["forwards"])
        text = (f"DDP ran {all_reduces} gradient all-reduces in {steps} steps, expected "
                f"{steps} (one per step)")
        if all_reduces > steps and synchronised > steps:
            text += (f": {synchronised} of the {len(sizes)} forward passes ran outside "
                     "no_sync, and DDP decides in the forward pass whether the backward "
                     "after it all-reduces")
        elif synchronised == 0:
            text += ": every forward pass ran inside no_sync, so the ranks never exchanged"
        problems.append(text)
    difference = _largest_difference(got["weights"], expected["weights"])
    if beyond(difference, 1e-6):
        text = (f"after {steps} steps the weights differ from {steps} steps of one process on "
                f"every rank's samples at once by up to {difference:.2g} (expected within 1e-6)")
        for name, weights in expected["candidates"].items():
            if not beyond(_largest_difference(got["weights"], weights), 1e-6):
                text += ": " + _weighting_mistake(name, expected)
                break
        problems.append(text)
    return "; ".join(problems) or None


# ---------------------------------------------------------------- 05.3 batch statistics

_EPS32 = torch.finfo(torch.float32).eps


def _all_batches(sizes: tuple[int, ...], offset: float, seed: int) -> list[torch.Tensor]:
    """Every rank's batch, float32, of shape (b, 4, 3, 3): channel means ``offset`` plus a
    few units apart, spreads of 1 to 2, each rank's mean shifted a little from the others';
    drawn from ``seed`` (afresh for each check: a copied answer fails the next one)."""
    generator = torch.Generator().manual_seed(seed)
    channels = torch.tensor([0.0, 1.0, -2.0, 3.0]).view(1, 4, 1, 1)
    return [torch.randn(size, 4, 3, 3, generator=generator) * (1 + 0.5 * rank)
            + channels + 0.5 * rank + offset for rank, size in enumerate(sizes)]


def _statistics_trial(fn, sizes: tuple[int, ...], offset: float = 0.0):
    batches = _all_batches(sizes, offset, shared_fresh_seed())
    got = fn(batches[dist.get_rank()].clone())
    # the truth, in float64, from the same float32 samples
    var, mean = torch.var_mean(torch.cat(batches).double(), dim=(0, 2, 3), unbiased=False)
    return got, {"mean": mean, "var": var, "empty": 0 in sizes}


def statistics_tolerances(mean: torch.Tensor, var: torch.Tensor) -> tuple:
    """The error allowed per channel in a float32 (mean, var): a few units of float32's
    rounding of the mean, which a sound float32 computation also makes (the ranks' means
    carry it into the variance through their differences), and 1e-4 of the variance."""
    rounding = 8 * _EPS32 * mean.abs()
    return 1e-5 + rounding, 1e-5 + 1e-4 * var + rounding * var.sqrt()


def _statistics_judge(got, expected) -> str | None:
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"expected a pair (mean, var), got {type(got).__name__}"
    tolerances = statistics_tolerances(expected["mean"], expected["var"])
    for name, mine, tolerance in zip(("mean", "var"), got, tolerances, strict=True):
        reference = expected[name]
        if not isinstance(mine, torch.Tensor) or mine.shape != reference.shape:
            shape = tuple(mine.shape) if isinstance(mine, torch.Tensor) else type(mine).__name__
            return f"{name}: expected a tensor of shape {tuple(reference.shape)}, got {shape}"
        if mine.dtype != torch.float32:
            return (f"{name} is {str(mine.dtype).removeprefix('torch.')}, expected float32, "
                    "x's dtype (batch norm normalises x with it): compute in float64 if you "
                    "like, and convert the result back")
        if not torch.isfinite(mine).all():
            text = f"{name} per channel: got {', '.join(f'{v:.4f}' for v in mine.tolist())}"
            if expected["empty"]:
                text += (": one rank's batch is empty (b = 0), and a mean over 0 samples is "
                         "nan (0/0), which spreads through any sum it enters, even times 0")
            return text
        error = (mine.double() - reference).abs()
        if (error > tolerance).any():
            show = ", ".join(f"{v:.4f}" for v in reference.tolist())
            got_show = ", ".join(f"{v:.4f}" for v in mine.tolist())
            allowed = ", ".join(f"{v:.1g}" for v in tolerance.tolist())
            return (f"{name} per channel: expected [{show}], got [{got_show}] (allowed error "
                    f"[{allowed}])")
    return None


# ---------------------------------------------------------------- 05.4 a torchrun script

SAMPLES, FEATURES, CLASSES = 96, 8, 3
SAMPLER_SEED, BATCH_SIZE, LEARNING_RATE, MOMENTUM = 7, 8, 0.1, 0.9
# How long one torchrun run of the reader's script may take once every worker has started
# (scripts.run_under_torchrun): a few seconds on 2 cores; starting torchrun and its workers
# before that (each imports torch), 5 to 10 s more, is not counted.
SCRIPT_TIMEOUT_S = 60.0
# Two trainings of the tiny model on the same batches agree to float32 rounding; a
# different order of the samples, or another start, moves the weights by 1e-3 or more.
_WEIGHTS_TOLERANCE = 1e-5


def tiny_dataset() -> torch.utils.data.TensorDataset:
    """Exercise 05.4's data: 96 samples of 8 features and their labels (3 classes, given by
    a fixed linear rule), the same at every call."""
    generator = torch.Generator().manual_seed(54)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    labels = (inputs @ torch.randn(FEATURES, CLASSES, generator=generator)).argmax(1)
    return torch.utils.data.TensorDataset(inputs, labels)


def tiny_model() -> nn.Module:
    """Exercise 05.4's model, with the same weights at every call (drawn from a seed of
    its own: torch's global random state is neither used nor changed)."""
    generator = torch.Generator().manual_seed(45)
    model = nn.Sequential(nn.utils.skip_init(nn.Linear, FEATURES, 16), nn.Tanh(),
                          nn.utils.skip_init(nn.Linear, 16, CLASSES))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return model


def _shares(world: int, epoch: int, seed: int, shuffle: bool) -> list[list[int]]:
    """The sample indices each rank's DistributedSampler gives in ``epoch``."""
    from torch.utils.data import DistributedSampler

    shares = []
    for rank in range(world):
        sampler = DistributedSampler(range(SAMPLES), num_replicas=world, rank=rank,
                                     shuffle=shuffle, seed=seed)
        sampler.set_epoch(epoch)
        shares.append(list(sampler))
    return shares


def _train(world: int, epochs: int, start: dict | None = None, flaw: str = "") -> dict:
    """In this process, without DDP: the script's training on ``world`` ranks up to
    ``epochs`` epochs, from ``start`` (a checkpoint) or from the beginning. Each step takes
    the union of the ranks' batches and the mean loss over it: DDP's average of the
    ranks' gradients, since every rank's batch holds as many samples. ``flaw`` makes it
    the training of a script with that mistake."""
    inputs, labels = tiny_dataset().tensors
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    first = 0
    if start is not None and flaw != "afresh":
        start = copy.deepcopy(start)  # SGD updates the momentum buffers it loads in place
        model.load_state_dict(start["model"])
        if flaw != "no optimizer state":
            optimizer.load_state_dict(start["optimizer"])
        first = 0 if flaw == "epoch 0" else start["epoch"]
    for epoch in range(first, epochs):
        shares = _shares(world, 0 if flaw == "no set_epoch" else epoch,
                         0 if flaw == "seed 0" else SAMPLER_SEED, flaw != "no shuffle")
        ranks = [0] if flaw == "no DDP" else range(world)
        for step in range(len(shares[0]) // BATCH_SIZE):
            batch = [i for r in ranks for i in shares[r][step * BATCH_SIZE:
                                                         (step + 1) * BATCH_SIZE]]
            optimizer.zero_grad()
            F.cross_entropy(model(inputs[batch]), labels[batch]).backward()
            optimizer.step()
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(), "epoch": epochs}


_FLAWS = {
    "no set_epoch": "these are the weights of a run whose every epoch read its samples in the "
                    "same order: call sampler.set_epoch(epoch) at the start of every epoch",
    "no DDP": "these are the weights of rank 0 trained alone on its share, its gradients "
              "never averaged with the other ranks': wrap the model in DDP",
    "seed 0": f"these are the weights of a sampler that shuffled with seed 0, "
              f"DistributedSampler's default: give it seed={SAMPLER_SEED}",
    "no shuffle": f"these are the weights of a sampler that did not shuffle: "
                  f"DistributedSampler(dataset, shuffle=True, seed={SAMPLER_SEED})",
    "afresh": "the second run started afresh: these are the weights of 3 epochs from the "
              "beginning. When --checkpoint exists, load it: the model's state, the "
              "optimizer's, and the epoch to start at",
    "no optimizer state": "the second run loaded the model but not the optimizer's state: "
                          "SGD's momentum started again from zero. Load "
                          "optimizer.load_state_dict(checkpoint['optimizer']) too",
    "epoch 0": "the second run loaded the checkpoint, then trained 3 more epochs from epoch 0: "
               "start at the checkpoint's epoch, so that it trains (and set_epoch sees) "
               "epochs 1 and 2 only",
}


def _checkpoint_facts(run, path: Path) -> dict:
    """What one torchrun run left: its exit, its writes, the folder and the checkpoint."""
    from .scripts import output_tail

    state, unreadable = None, None
    if path.exists():
        try:
            state = torch.load(path, weights_only=True)
        except Exception as error:  # a pickled object, a file cut off: say what torch said
            unreadable = "".join(traceback.format_exception_only(type(error), error))
            unreadable = unreadable.strip().splitlines()[0]
    return {"command": " ".join(run.command), "returncode": run.returncode,
            "errors": run.errors, "tail": output_tail(run.output), "writes": run.writes,
            "files": sorted(p.name for p in path.parent.iterdir()), "state": state,
            "unreadable": unreadable}


def _failed_run(facts: dict, expected: dict) -> str | None:
    command = f"`{facts['command']}`"
    tail = f", after printing:\n{facts['tail']}" if facts["tail"].strip() else ""
    if facts["returncode"] is None:
        return (f"{command} gave no result in {expected['timeout']:g} s: a rank waits for a "
                f"collective that never comes, or the script never ends (every process was "
                f"stopped){tail}")
    if facts["returncode"] != 0:
        text = f"{command} exited with status {facts['returncode']}"
        if facts["errors"]:
            rank, error = next(iter(facts["errors"].items()))
            return (f"{text}; rank {rank} raised (line numbers count from `def main():`):\n"
                    f"{error}")
        return text + tail
    return None


def _save_problem(facts: dict, expected: dict) -> str | None:
    """How the run saved: rank 0 only, after every epoch, atomically, nothing left over."""
    path, name = expected["path"], Path(expected["path"]).name
    folder = str(Path(path).parent) + os.sep
    writes = facts["writes"]
    writers = sorted({rank for rank, *_ in writes})
    if len(writers) > 1:
        ranks = ", ".join(map(str, writers[:-1])) + f" and {writers[-1]}"
        return (f"ranks {ranks} all wrote into the checkpoint's folder: save from rank 0 only "
                "(`if dist.get_rank() == 0:`), or several writers race on one file")
    if any(what in ("save", "open") and where == path for _, what, where, _ in writes) or any(
            what == "copy" and to == path for _, what, _, to in writes):
        return (f"the checkpoint was written straight into {name}: a crash during a save would "
                "leave a broken file, and the last good checkpoint would be lost. Save to a "
                "temporary file in the checkpoint's folder, then os.replace(temporary, "
                "checkpoint)")
    moved = [where for _, what, where, to in writes if what == "rename" and to == path]
    outside = [where for where in moved if not where.startswith(folder)]
    if outside:
        return (f"the checkpoint was renamed from {outside[0]}, outside its folder: write the "
                "temporary file in the checkpoint's own folder (os.replace is atomic only "
                "within one file system, and fails across two)")
    left = [file for file in facts["files"] if file != name]
    if left:
        return (f"the run left {', '.join(left)} in the checkpoint's folder, beside {name}: "
                "os.replace the temporary file onto the checkpoint, which leaves nothing "
                "behind")
    if facts["unreadable"]:
        return (f"torch.load({name}, weights_only=True) could not read the checkpoint "
                f"({facts['unreadable']}): save state dicts, tensors and numbers only")
    if facts["state"] is None:
        return f"no checkpoint at {name} after the run: save one after every epoch"
    return None


def _content_problem(facts: dict, expected: dict) -> str | None:
    """What the checkpoint holds, against the training of one process."""
    state, reference = facts["state"], expected["reference"]
    if not isinstance(state, dict) or not {"model", "optimizer", "epoch"} <= state.keys():
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        return (f"the checkpoint holds {keys}, expected a dict with 'model', 'optimizer' and "
                "'epoch'")
    model = state["model"]
    keys = list(model) if isinstance(model, dict) else []
    if keys and all(str(key).startswith("module.") for key in keys):
        return (f"the checkpoint's model keys start with `module.` ({keys[0]}): that is the "
                "DDP wrapper's state_dict. Save model.module.state_dict(), which loads into "
                "the plain model")
    if sorted(keys) != sorted(reference["model"]):
        return (f"the checkpoint's model holds {sorted(keys)}, expected tiny_model()'s "
                f"state_dict: {sorted(reference['model'])}")
    difference = max(largest_abs(model[k].float() - v) for k, v in reference["model"].items())
    if beyond(difference, _WEIGHTS_TOLERANCE):
        text = (f"after {expected['epochs']} epochs the weights differ from one process's "
                f"training on every rank's batches by up to {difference:.2g} (expected within "
                f"{_WEIGHTS_TOLERANCE:g})")
        for flaw, other in expected["candidates"].items():
            if not beyond(max(largest_abs(model[k].float() - v)
                              for k, v in other["model"].items()), _WEIGHTS_TOLERANCE):
                return f"{text}: {_FLAWS[flaw]}"
        return (f"{text}: check the batch size ({BATCH_SIZE} per rank), SGD(lr="
                f"{LEARNING_RATE}, momentum={MOMENTUM}), the mean cross-entropy, and the "
                f"sampler (shuffle=True, seed={SAMPLER_SEED}, set_epoch)")
    if state["epoch"] != expected["epochs"]:
        return (f"the checkpoint says epoch {state['epoch']!r} after {expected['epochs']} "
                "epochs: save the number of epochs done (epoch + 1), where a resumed run "
                "starts")
    saves = sum(what == "rename" and to == expected["path"] for _, what, _, to in facts["writes"])
    if saves != expected["epochs"] - expected["start"]:
        run = expected["epochs"] - expected["start"]
        return (f"the checkpoint was saved {count(saves, 'time')} in {count(run, 'epoch')}: "
                "save after every epoch, so that a crash loses one epoch at most")
    return _optimizer_problem(state["optimizer"], reference["optimizer"])


def _optimizer_problem(mine, reference: dict) -> str | None:
    wanted = reference["state"]
    try:
        buffers = [mine["state"][k]["momentum_buffer"] for k in sorted(wanted)]
        difference = max(largest_abs(b.float() - wanted[k]["momentum_buffer"])
                         for b, k in zip(buffers, sorted(wanted), strict=True))
    except (KeyError, TypeError, AttributeError, RuntimeError):
        difference = float("nan")
    if beyond(difference, _WEIGHTS_TOLERANCE):
        return ("the checkpoint's optimizer state is not SGD's after these steps (its momentum "
                "buffers): save optimizer.state_dict()")
    return None


def _expected_run(world: int, last: int, start: dict | None, path: Path) -> dict:
    """What a run up to epoch ``last`` from ``start`` must leave at ``path``, and what
    the scripts with each mistake of _FLAWS would leave (those that resume only where a
    run resumes)."""
    flaws = [flaw for flaw in _FLAWS if start is not None
             or flaw not in ("afresh", "no optimizer state", "epoch 0")]
    return {"epochs": last, "start": start["epoch"] if start else 0,
            "path": os.path.realpath(path), "timeout": SCRIPT_TIMEOUT_S,
            "reference": _train(world, last, start),
            "candidates": {flaw: _train(world, last, start, flaw) for flaw in flaws}}


def _script_trial(fn, world: int, epochs: tuple[int, ...]):
    from .scripts import run_under_torchrun, script_source

    source = script_source(fn)
    runs, wanted = [], []
    start = None
    with tempfile.TemporaryDirectory(prefix="exercise-05.4-") as root:
        here = Path(root, "run")  # the working directory: main.py and checkpoints/
        (here / "checkpoints").mkdir(parents=True)
        (here / "main.py").write_text(source)
        path = here / "checkpoints" / "checkpoint.pt"
        for index, last in enumerate(epochs):
            notes = Path(root, f"notes{index}")
            notes.mkdir()
            run = run_under_torchrun(Path("main.py"), world,
                                     ["--epochs", str(last), "--checkpoint",
                                      "checkpoints/checkpoint.pt"],
                                     watched=here / "checkpoints", notes=notes,
                                     timeout=SCRIPT_TIMEOUT_S, cwd=here)
            facts = _checkpoint_facts(run, path)
            expected = _expected_run(world, last, start, path)
            runs.append(facts)
            wanted.append(expected)
            if (_failed_run(facts, expected) or _save_problem(facts, expected)
                    or _content_problem(facts, expected)):
                break  # the next run would start from a wrong checkpoint
            if index + 1 < len(epochs):
                start = _another_runs_checkpoint(path)
    return {"runs": runs}, {"runs": wanted, "epochs": epochs}


def _another_runs_checkpoint(path: Path) -> dict:
    """Moves the checkpoint's weights by a random amount, drawn afresh (written atomically),
    and returns what it then holds: a second run that starts afresh instead of resuming
    cannot end on the reference's weights by chance."""
    state = torch.load(path, weights_only=True)
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    state["model"] = {key: value + 0.1 * torch.randn(value.shape, generator=generator)
                      for key, value in state["model"].items()}
    temporary = path.with_name(path.name + ".checker")
    torch.save(state, temporary)
    os.replace(temporary, path)
    return state


def _script_judge(got, expected) -> str | None:
    several = len(expected["epochs"]) > 1
    for index, (facts, wanted) in enumerate(zip(got["runs"], expected["runs"], strict=False)):
        problem = (_failed_run(facts, wanted) or _save_problem(facts, wanted)
                   or _content_problem(facts, wanted))
        if problem:
            where = (f"run {index + 1} of {len(expected['epochs'])} (--epochs "
                     f"{wanted['epochs']}): ") if several else ""
            return where + problem
    return None


EXERCISES = [
    Exercise(
        key="05.1", difficulty=2, minutes=30,
        title="a communication hook that averages in float16",
        function="fp16_average_hook",
        cases=[Case("2 ranks, different batches", (False, False), 2),
               Case("3 ranks, different batches", (False, False), 3),
               Case("2 ranks, gradients near float16's limit (a loss scale)", (True, True), 2)],
        trial=_hook_trial, judge=_hook_judge,
        hint="the bucket's buffer holds this rank's gradients, summed by nobody yet: the "
             "hook must average them; and a sum of N float16 values can overflow where each "
             "value, and the average, do not",
    ),
    Exercise(
        key="05.2", difficulty=3, minutes=40,
        title="gradient accumulation weighted by samples",
        function="accumulation_step",
        cases=[Case("2 ranks, micro-batches of 4 and 4 on each", (((4, 4), (4, 4)),), 2),
               Case("2 ranks, micro-batches of 8, 8, 3 and of 8, 5, 3 (19 and 16 samples)",
                    (((8, 8, 3), (8, 5, 3)),), 2),
               Case("3 ranks, one micro-batch each, of 8, 5 and 3", (((8,), (5,), (3,)),),
                    3)],
        trial=_accumulation_trial, judge=_accumulation_judge,
        hint=("one forward and one backward per micro-batch, all but the last inside "
              "model.no_sync(), where a backward only adds to .grad; DDP decides in the "
              "forward pass whether the backward after it all-reduces",
              "the big batch's loss is the sum of every sample's loss divided by N, the "
              "samples of all ranks: this rank's share of it is its micro-batches' summed "
              "losses over N. N takes one all-reduce of this rank's count; and DDP divides "
              "the all-reduced gradients by the world size, so multiply by it"),
    ),
    Exercise(
        key="05.3", difficulty=2, minutes=35,
        title="batch statistics that survive float32",
        function="global_batch_stats",
        cases=[Case("2 ranks, 4 images each", ((4, 4),), 2),
               Case("3 ranks, 1, 4 and 7 images", ((1, 4, 7),), 3),
               Case("2 ranks, 6 and 2 images, channel means near 10,000, spreads near 1",
                    ((6, 2), 1e4), 2),
               Case("3 ranks, 5, 0 and 3 images (an empty batch)", ((5, 0, 3),), 3)],
        trial=_statistics_trial, judge=_statistics_judge,
        hint=("the ranks' means and variances cannot simply be averaged; and E[x²] − E[x]² in "
              "float32 loses every digit of a variance near 1 when the mean is near 10,000 "
              "(x² near 1e8 keeps about 7 digits)",
              "send per rank (count, mean, M2 = the sum of squared deviations from its own "
              "mean), all-gathered; then mean = Σ nᵢ·meanᵢ / N and M2 = Σ M2ᵢ + Σ nᵢ·(meanᵢ − "
              "mean)² (Chan et al.). A rank with no samples has count 0 and must add nothing, "
              "not nan. Or sum in float64 and convert the result back"),
    ),
    Exercise(
        key="05.4", difficulty=3, minutes=60,
        title="a torchrun training script that resumes",
        function="main",
        cases=[Case("torchrun, 3 ranks, 2 epochs", (3, (2,))),
               Case("torchrun, 2 ranks, 1 epoch, then again with --epochs 3 (resumed)",
                    (2, (1, 3)))],
        trial=_script_trial, judge=_script_judge,
        hint=("start from section 1's bare_ddp_script: init_process_group, "
              "DistributedSampler and set_epoch, DDP; then, on rank 0 after every epoch, "
              "torch.save to a temporary file in the checkpoint's folder and os.replace it "
              "onto the checkpoint",
              "a checkpoint that resumes exactly holds model.module.state_dict(), "
              "optimizer.state_dict() and the number of epochs done; on start, when the file "
              "exists, load all three (torch.load(..., weights_only=True)) and loop over "
              "range(checkpoint['epoch'], args.epochs)"),
    ),
]
