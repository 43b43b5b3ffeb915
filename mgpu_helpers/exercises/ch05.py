"""Chapter 05's exercises: a gradient-compression hook, accumulation with ``no_sync``, and
batch-norm statistics over all ranks, each checked on gloo ranks against PyTorch's own."""

from __future__ import annotations

import linecache
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..flight_recorder import collectives_so_far
from .core import Case, Exercise, beyond, calls_during, largest_abs

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

    seed = 100 if same_inputs else 100 + dist.get_rank()
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


# ---------------------------------------------------------------- 05.2 no_sync

def _accumulation_data(world: int, accumulation: int, micro_batch: int, steps: int):
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn(steps, world, accumulation, micro_batch, 8, generator=generator)
    labels = torch.randint(0, 3, (steps, world, accumulation, micro_batch), generator=generator)
    return inputs, labels


def _small_classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _accumulation_trial(fn, accumulation: int, micro_batch: int, steps: int = 3):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, labels = _accumulation_data(world, accumulation, micro_batch, steps)
    model = DDP(_small_classifier())  # one bucket: one all-reduce per synchronised backward
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sizes: list[int] = []  # the batch size of every forward pass of the wrapped module

    def record(module, args, kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        sizes.append(tensors[0].shape[0] if tensors and tensors[0].dim() else 1)

    model.module.register_forward_pre_hook(record, with_kwargs=True)
    before = len(collectives_so_far())
    for step in range(steps):
        fn(model, optimizer, [(inputs[step, rank, i], labels[step, rank, i])
                              for i in range(accumulation)])
    all_reduces = sum(entry["profiling_name"].endswith("all_reduce")
                      for entry in collectives_so_far()[before:])
    # one process, every rank's micro-batches in one batch
    big = _small_classifier()
    big_optimizer = torch.optim.SGD(big.parameters(), lr=0.5, momentum=0.9)
    for step in range(steps):
        big_optimizer.zero_grad()
        F.cross_entropy(big(inputs[step].reshape(-1, 8)), labels[step].reshape(-1)).backward()
        big_optimizer.step()
    return ({"weights": [p.detach().clone() for p in model.module.parameters()],
             "all_reduces": all_reduces, "forwards": sizes},
            {"weights": [p.detach() for p in big.parameters()], "all_reduces": steps,
             "forwards": [micro_batch] * (accumulation * steps)})


def _accumulation_judge(got, expected) -> str | None:
    problems = []
    if got["forwards"] != expected["forwards"]:
        forwards, wanted = got["forwards"], expected["forwards"]
        problems.append(f"the model ran forward passes on batches of {sorted(set(forwards))} "
                        f"samples ({len(forwards)} in all), expected one per micro-batch "
                        f"({len(wanted)} of {wanted[0]})")
    if got["all_reduces"] != expected["all_reduces"]:
        problems.append(f"DDP ran {got['all_reduces']} gradient all-reduces in "
                        f"{expected['all_reduces']} steps, expected {expected['all_reduces']} "
                        "(one per step)")
    # torch's max keeps a nan (Python's max may drop it)
    difference = float(torch.tensor([largest_abs(a - b) for a, b in zip(
        got["weights"], expected["weights"], strict=True)]).max())
    if beyond(difference, 1e-6):
        problems.append(f"after {expected['all_reduces']} steps the weights differ from "
                        f"{expected['all_reduces']} big-batch steps' by up to {difference:.2g} "
                        "(expected within 1e-6)")
    return "; ".join(problems) or None


# ---------------------------------------------------------------- 05.3 batch statistics

def _all_batches(sizes: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(9)
    offsets = torch.tensor([0.0, 1.0, -2.0, 3.0]).view(1, 4, 1, 1)
    return [torch.randn(size, 4, 3, 3, generator=generator) * (1 + rank) + offsets
            for rank, size in enumerate(sizes)]


def _statistics_trial(fn, sizes: tuple[int, ...]):
    batches = _all_batches(sizes)
    got = fn(batches[dist.get_rank()].clone())
    var, mean = torch.var_mean(torch.cat(batches), dim=(0, 2, 3), unbiased=False)
    return got, (mean, var)


def _statistics_judge(got, expected) -> str | None:
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"expected a pair (mean, var), got {type(got).__name__}"
    for name, mine, reference in zip(("mean", "var"), got, expected, strict=True):
        if not isinstance(mine, torch.Tensor) or mine.shape != reference.shape:
            shape = tuple(mine.shape) if isinstance(mine, torch.Tensor) else type(mine).__name__
            return f"{name}: expected a tensor of shape {tuple(reference.shape)}, got {shape}"
        mine, reference = mine.double(), reference.double()  # float64 results compare too
        if not torch.allclose(mine, reference, rtol=1e-4, atol=1e-5):
            show = ", ".join(f"{v:.3f}" for v in reference.tolist())
            got_show = ", ".join(f"{v:.3f}" for v in mine.tolist())
            return f"{name} per channel: expected [{show}], got [{got_show}]"
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
        key="05.2", difficulty=2, minutes=30,
        title="gradient accumulation with no_sync",
        function="accumulation_step",
        cases=[Case(f"{world} ranks, {k} micro-batch{'es' if k > 1 else ''} of {b}",
                    (k, b), world)
               for world, k, b in ((2, 2, 4), (3, 3, 4), (2, 1, 8))],
        trial=_accumulation_trial, judge=_accumulation_judge,
        hint="one forward and one backward per micro-batch; inside model.no_sync() a "
             "backward only adds to .grad; the backward outside it all-reduces what .grad "
             "holds: which micro-batch must that be? And the step must see the mean loss "
             "over the k micro-batches",
    ),
    Exercise(
        key="05.3", difficulty=2, minutes=30,
        title="batch statistics over all ranks",
        function="global_batch_stats",
        cases=[Case("2 ranks, 4 images each", ((4, 4),), 2),
               Case("3 ranks, 1, 4 and 7 images", ((1, 4, 7),), 3),
               Case("2 ranks, 6 and 2 images", ((6, 2),), 2)],
        trial=_statistics_trial, judge=_statistics_judge,
        hint="the ranks' means and variances cannot simply be averaged: sum what adds up "
             "(per-channel sums, sums of squares, counts) over the ranks, then divide",
    ),
]
