"""Chapter 07's exercises: a ZeRO-1 optimizer, the largest model each ZeRO stage fits,
and a tensor-parallel feed-forward block written by hand. The models' weights and data,
and one case's sizes, are drawn afresh on every check (the same on every rank), so that
weights or numbers copied from an earlier check fail."""

from __future__ import annotations

import math
import random
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..measure.flight_recorder import collectives_so_far
from .core import Case, Exercise, as_number, beyond, calls_during, largest_abs, shared_fresh_seed

# ---------------------------------------------------------------- 07.1 ZeRO-1

def _zero1_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # in a rank: its own process's generators
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _state_bytes(optimizers) -> int:
    # Adam's moments, each tensor once (a wrapper may show its inner optimizer's state);
    # the step counters (0-dimensional) are not counted
    tensors = {(t.data_ptr(), t.numel()): t.numel() * t.element_size()
               for optimizer in optimizers for state in optimizer.state.values()
               for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0}
    return sum(tensors.values())


def _zero1_trial(fn, steps: int = 3, lr: float = 1e-2):
    rank, world = dist.get_rank(), dist.get_world_size()
    seed = shared_fresh_seed()  # the weights and the data, drawn afresh on every check
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(steps, world, 8, 8, generator=generator)
    targets = torch.randn(steps, world, 8, 4, generator=generator)

    def train(make_optimizer):
        model = _zero1_model(seed)  # the same initial weights on every rank
        params = list(model.parameters())
        optimizer = make_optimizer(list(params), lr)
        for step in range(steps):
            model.zero_grad(set_to_none=True)
            F.mse_loss(model(inputs[step, rank]), targets[step, rank]).backward()
            for p in params:  # what DDP does: the average over the ranks
                dist.all_reduce(p.grad)
                p.grad /= world
            optimizer.step()
        return [p.detach().clone() for p in params], params, optimizer

    from torch.optim.optimizer import register_optimizer_step_post_hook

    stepped = {}  # every torch.optim optimizer that stepped in this rank
    handle = register_optimizer_step_post_hook(
        lambda optimizer, args, kwargs: stepped.setdefault(id(optimizer), optimizer))
    try:  # the classes of torch.distributed.optim constructed, however they were named
        (weights, params, returned), constructed = calls_during(_LIBRARY.constructors(),
                                                                train, fn)
    finally:
        handle.remove()
    library = sorted(set(constructed) | {
        _LIBRARY.found_in(o) for o in (returned, *_held(returned), *stepped.values())
        if _LIBRARY.found_in(o)})
    mine = _state_bytes(stepped.values())
    everyone = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(everyone, torch.tensor([mine]))
    expected, plain_params, plain = train(lambda params, lr: torch.optim.Adam(params, lr=lr))
    # Adam's first moment of each parameter this rank's optimizers stepped, beside plain
    # Adam's for the same parameter (a parameter the reader copied is not found: skipped)
    index = {id(p): k for k, p in enumerate(params)}
    moments = [(state["exp_avg"], plain.state[plain_params[index[id(p)]]]["exp_avg"])
               for optimizer in stepped.values() for p, state in optimizer.state.items()
               if id(p) in index and isinstance(state.get("exp_avg"), torch.Tensor)]
    total = 2 * sum(p.numel() * p.element_size() for p in _zero1_model().parameters())
    return ({"weights": weights, "state": mine, "states": [int(b) for b in everyone],
             "optimizers": len(stepped), "library": library, "moments": moments},
            {"weights": expected, "total": total, "world": world, "steps": steps})


class _Library:
    """torch.distributed.optim's classes (ZeroRedundancyOptimizer among them), looked up
    on first use: their constructors for calls_during (a subclass runs them through
    super()), and which of them an object is an instance of."""

    def __init__(self):
        self._classes: list[type] | None = None

    def classes(self) -> list[type]:
        if self._classes is None:
            import inspect
            import types

            import torch.distributed.optim  # noqa: F401 (loads its modules)

            modules = [m for name, m in list(sys.modules.items())
                       if name.startswith("torch.distributed.optim") and m is not None]
            self._classes = sorted(
                {c for m in modules for c in vars(m).values() if inspect.isclass(c)
                 and c.__module__.startswith("torch.distributed.optim")
                 and isinstance(vars(c).get("__init__"), types.FunctionType)},
                key=lambda c: c.__qualname__)
        return self._classes

    def constructors(self) -> dict:
        return {vars(c)["__init__"]: c.__name__ for c in self.classes()}

    def found_in(self, obj) -> str | None:
        """The name of the torch.distributed.optim class ``obj`` is an instance of."""
        return next((c.__name__ for c in self.classes() if isinstance(obj, c)), None)


_LIBRARY = _Library()


def _held(obj) -> list:
    """The objects ``obj`` keeps in its attributes, one level down (lists, tuples and
    dicts of them too): an optimizer a wrapper holds."""
    try:
        values = list(vars(obj).values())
    except TypeError:  # no __dict__
        return []
    held = []
    for value in values:
        if isinstance(value, dict):
            held += list(value.values())
        elif isinstance(value, (list, tuple)):
            held += list(value)
        else:
            held.append(value)
    return held


def _moment_factor(moments: list) -> str | None:
    """None when the stepped optimizers' exp_avg match plain Adam's, else how they
    differ: a factor when they are one multiple of plain Adam's."""
    pairs = [(mine.double().flatten(), plain.double().flatten()) for mine, plain in moments]
    if all(torch.allclose(mine, plain, rtol=1e-4, atol=1e-8) for mine, plain in pairs):
        return None
    mine = torch.cat([m for m, _ in pairs])
    plain = torch.cat([p for _, p in pairs])
    factor = float(mine @ plain / (plain @ plain))
    # one multiple of plain Adam's, up to what the parameters' drift since the first step
    # moves the later gradients (a relative residual, not an elementwise test: any draw)
    residual = float((mine - factor * plain).norm() / (factor * plain).norm())
    if abs(factor - 1) > 0.01 and residual < 0.02:
        return (f"Adam's first moment (exp_avg) on this rank is {factor:.3g} times plain "
                "Adam's: the gradients Adam stepped on were not the ones step() received "
                "(already averaged over the ranks, as under DDP)")
    return "Adam's first moment (exp_avg) on this rank differs from plain Adam's"


def _zero1_judge(got, expected) -> str | None:
    if got["library"]:
        return (f"zero1_adam uses torch's {', '.join(got['library'])} "
                "(torch.distributed.optim), directly, through a subclass or inside another "
                "object: the exercise is to write ZeRO-1 yourself, around a torch.optim.Adam "
                "for this rank's share")
    differences = [largest_abs(a - b) for a, b in zip(got["weights"], expected["weights"],
                                                   strict=True)]
    wrong = sum(beyond(d, 1e-6) for d in differences)
    moments = _moment_factor(got["moments"])
    if wrong:
        return (f"after {expected['steps']} steps, {wrong} of {len(differences)} parameters "
                f"{'differs' if wrong == 1 else 'differ'} from plain Adam's by up to "
                f"{float(torch.tensor(differences).max()):.2g} (expected within 1e-6)"
                + (f"; {moments}" if moments else ""))
    if moments:
        return moments
    if not got["optimizers"]:
        return ("no torch.optim optimizer stepped on this rank: keep this rank's share of "
                "Adam in a torch.optim.Adam")
    total, world = expected["total"], expected["world"]
    if got["state"] == total:
        return (f"this rank keeps Adam's moments for every parameter ({total:,} bytes), as "
                f"plain Adam does: no memory saved; expected about 1/{world} of them")
    if sum(got["states"]) != total:
        held = ", ".join(f"{b:,}" for b in got["states"])
        return (f"the ranks keep {held} bytes of Adam's moments, {sum(got['states']):,} in "
                f"all; expected {total:,} in all (each parameter's moments on one rank)")
    return None


# ---------------------------------------------------------------- 07.2 largest models

STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")


def _largest_trial(fn, bytes_per_rank: int | None, ranks: int | None):
    drawn = None
    if bytes_per_rank is None:  # drawn afresh: no table of copied answers holds it
        draw = random.SystemRandom()
        bytes_per_rank, ranks = draw.randint(2**30, 200 * 10**9), draw.randint(2, 1024)
        drawn = f"{bytes_per_rank:,} bytes per rank and {ranks} ranks"
    # float32 Adam: 4 bytes of weights, 4 of gradients, 8 of moments per parameter;
    # ZeRO-1 shards the moments, ZeRO-2 the gradients too, ZeRO-3 the weights too
    sharded = {"DDP": 0, "ZeRO-1": 8, "ZeRO-2": 12, "ZeRO-3": 16}
    expected = {stage: bytes_per_rank * ranks // ((16 - part) * ranks + part)
                for stage, part in sharded.items()}
    return fn(bytes_per_rank, ranks), {"models": expected, "drawn": drawn}


def _largest_judge(got, expected) -> str | None:
    where = f"for {expected['drawn']}: " if expected["drawn"] else ""
    if not isinstance(got, dict) or set(got) != set(STAGES):
        keys = sorted(got) if isinstance(got, dict) else type(got).__name__
        return f"{where}expected a dict with the keys {list(STAGES)}, got {keys}"
    for stage in STAGES:
        right = expected["models"][stage]
        value = as_number(got[stage])  # an int, a float, NumPy's scalar, a 1-element tensor
        if value is None:
            return (f"{where}{stage}: expected a number of parameters, got "
                    f"{type(got[stage]).__name__}")
        if beyond(abs(value - right), max(1.0, 1e-6 * right)):
            finite = "" if math.isfinite(value) else " (not a finite number)"
            return (f"{where}{stage}: expected {right:,} parameters, got {value:,.0f}"
                    f"{finite}")
    return None


# ---------------------------------------------------------------- 07.3 tensor parallel

WIDTH, BATCH = 6, 5


def _block(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)  # in a rank: its own process's generators
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.ReLU(), nn.Linear(4 * WIDTH, WIDTH))


def _collectives_between(before: int, after: int | None = None) -> list[tuple]:
    return [(entry["profiling_name"].split(":")[-1], [list(s) for s in entry["input_sizes"]])
            for entry in collectives_so_far()[before:after]]


def _tp_trial(fn, input_needs_grad: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    seed = shared_fresh_seed()  # the weights and x, drawn afresh on every check
    block = _block(seed)
    rows = 4 * WIDTH // world
    mine = slice(rank * rows, (rank + 1) * rows)
    first, second = block[0], block[2]
    shards = [first.weight[mine], first.bias[mine], second.weight[:, mine], second.bias]
    shards = [shard.detach().clone().requires_grad_() for shard in shards]
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(seed + 1))
    x_mine = x.clone().requires_grad_(input_needs_grad)
    start = len(collectives_so_far())
    out = fn(x_mine, *shards)
    middle = len(collectives_so_far())
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.pow(2).mean().backward()
    differentiable = isinstance(out, torch.Tensor) and out.requires_grad
    got = {"out": out.detach() if isinstance(out, torch.Tensor) else out,
           "differentiable": differentiable, "forward": _collectives_between(start, middle),
           "backward": _collectives_between(middle),
           "gradients": [shard.grad for shard in shards], "x": x_mine.grad}
    x_full = x.clone().requires_grad_(input_needs_grad)
    expected_out = block(x_full)
    expected_out.pow(2).mean().backward()
    message = ("all_reduce", [[BATCH, WIDTH]])
    expected = {"out": expected_out.detach(), "forward": [message],
                "backward": [message] if input_needs_grad else [],
                "gradients": [first.weight.grad[mine], first.bias.grad[mine],
                              second.weight.grad[:, mine], second.bias.grad],
                "x": x_full.grad}
    return got, expected


def _close(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and a.shape == b.shape  # any float dtype compares
            and torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6))


def _tp_judge(got, expected) -> str | None:
    out = got["out"]
    if not isinstance(out, torch.Tensor) or out.shape != expected["out"].shape:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return f"expected an output of shape {tuple(expected['out'].shape)}, got {shape}"
    if not _close(out, expected["out"]):
        return (f"the output differs from the unsplit block's by up to "
                f"{largest_abs(out - expected['out']):.3g}")
    if got["forward"] != expected["forward"]:
        return (f"forward: expected one all_reduce of the [{BATCH}, {WIDTH}] output, got "
                f"{got['forward'] or 'no collective'}")
    if not got["differentiable"]:
        return "the output does not require a gradient: backward cannot reach the shards"
    names = ("w1", "b1", "w2", "b2")
    for name, mine, right in zip(names, got["gradients"], expected["gradients"], strict=True):
        if mine is None:
            return f"{name} got no gradient"
        if not _close(mine, right):
            mine, right = mine.double().flatten(), right.double().flatten()
            ratio = mine @ right / (right @ right)
            return (f"the gradient of {name} differs from the unsplit block's (about "
                    f"{ratio.item():.3g} times it)")
    if expected["x"] is not None:
        if got["x"] is None:
            return "x got no gradient"
        if not _close(got["x"], expected["x"]):
            return ("the gradient of x differs from the unsplit block's by up to "
                    f"{largest_abs(got['x'] - expected['x']):.3g}")
    if got["backward"] != expected["backward"]:
        return (f"backward: expected {expected['backward'] or 'no collective'}, got "
                f"{got['backward'] or 'no collective'}")
    return None


EXERCISES = [
    Exercise(
        key="07.1", difficulty=3, minutes=60,
        title="a ZeRO-1 optimizer", function="zero1_adam",
        cases=[Case(f"{world} ranks, 3 Adam steps", (), world) for world in (2, 3)],
        trial=_zero1_trial, judge=_zero1_judge,
        hint="assign each parameter to one rank; that rank alone gives it to a "
             "torch.optim.Adam and updates it; after the step, every parameter is sent from "
             "its owner to the others",
    ),
    Exercise(
        key="07.2", difficulty=1, minutes=20,
        title="the largest model each ZeRO stage fits", function="largest_models",
        cases=[Case(label, (size, ranks)) for label, size, ranks in (
            ("80 GB per rank, 8 ranks", 80 * 10**9, 8),
            ("16 GiB per rank, 3 ranks", 16 * 2**30, 3),
            ("24 GB per rank, 64 ranks", 24 * 10**9, 64),
            ("1 GiB, 1 rank", 2**30, 1),
            ("a memory and a number of ranks drawn afresh", None, None))],
        trial=_largest_trial, judge=_largest_judge,
        hint="write the bytes per parameter of each stage: 4 (weights) + 4 (gradients) + 8 "
             "(Adam's moments), each part divided by N where the stage shards it; then the "
             "model size is the memory divided by that (the shares need not be whole bytes)",
    ),
    Exercise(
        key="07.3", difficulty=3, minutes=45,
        title="a tensor-parallel block by hand", function="tp_feed_forward",
        cases=[Case("2 ranks, input without a gradient", (False,), 2),
               Case("2 ranks, input with a gradient", (True,), 2),
               Case("3 ranks, input with a gradient", (True,), 3)],
        trial=_tp_trial, judge=_tp_judge,
        hint=("two autograd functions (torch.autograd.Function), each the other's mirror: "
              "one is the identity forward and all-reduces the gradient in backward (put "
              "it on x, whose gradient is a partial sum on each rank); the other "
              "all-reduces forward and passes the gradient through unchanged in backward "
              "(put it on the partial output, each rank's sum over its share of the "
              "hidden features)",
              "add b2 after the forward all-reduce, never before it: added on every rank "
              "first, it would be summed N times (and since the identity function sits on "
              "x, autograd skips its backward, and its all-reduce, when x needs no "
              "gradient)"),
    ),
]
