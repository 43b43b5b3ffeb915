"""Chapter 04's exercises: DataParallel's last step (the replicas' gradients summed into
the original module) and its first (how a batch is split between devices). Both run in
this process, as DataParallel does: the gradients are checked against autograd's own
sum over the chunks, of a model and a batch drawn afresh on every check, the split
against ``torch.chunk``, which DataParallel's scatter calls, for fixed sizes and for
sizes drawn afresh on every check (so that gradients or sizes copied from an earlier
check fail)."""

from __future__ import annotations

import copy
import operator
import random

import torch
import torch.nn.functional as F
from torch import nn

from .core import Case, Exercise

# ---------------------------------------------------------------- 04.1 summing gradients


class _Routed(nn.Module):
    """Each sample goes through one of two experts, chosen by the sign of its first
    feature: an expert that no sample of a chunk needs is not called on that replica, so
    that replica has no gradient for it. Optionally a frozen layer (requires_grad False)
    and an auxiliary head the forward pass never uses."""

    def __init__(self, extras: bool):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.expert_a = nn.Linear(8, 8)
        self.expert_b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.extras = extras
        if extras:
            self.frozen = nn.Linear(3, 3)
            self.frozen.requires_grad_(False)
            self.aux_head = nn.Linear(8, 3)  # used at evaluation only

    def forward(self, x):
        h = torch.relu(self.embed(x))
        positive = x[:, 0] > 0
        out = torch.zeros_like(h)
        if positive.any():
            out[positive] = self.expert_a(h[positive])
        if (~positive).any():
            out[~positive] = self.expert_b(h[~positive])
        y = self.head(out)
        return y + self.frozen(y) if self.extras else y


def _model(kind: str, seed: int) -> nn.Module:
    # weights drawn from ``seed`` without touching the notebook's random state: fork_rng
    # puts the CPU generator back, and only the CPU generator is seeded (torch.manual_seed
    # would also reseed the GPUs')
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        if kind == "mlp":
            return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
        return _Routed(extras=kind == "routed with extras")


def _inputs(chunks: tuple, generator: torch.Generator) -> torch.Tensor:
    # one chunk per entry: "+" all first features positive, "-" all negative, "±" mixed
    parts = []
    for sign in chunks:
        x = torch.randn(4, 4, generator=generator)
        if sign == "+":
            x[:, 0] = x[:, 0].abs() + 0.1
        elif sign == "-":
            x[:, 0] = -x[:, 0].abs() - 0.1
        else:
            x[:, 0] = torch.tensor([1.0, -1.0, 0.5, -0.5])
        parts.append(x)
    return torch.cat(parts)


def _grads(model: nn.Module) -> dict:
    return {name: None if p.grad is None else p.grad.detach().clone()
            for name, p in model.named_parameters()}


def _sum_trial(fn, kind: str, chunks: tuple, accumulated: bool):
    draw = random.SystemRandom()  # the weights and the batch drawn afresh on every check
    generator = torch.Generator().manual_seed(draw.getrandbits(63))
    model = _model(kind, draw.getrandbits(63))
    inputs = _inputs(chunks, generator)
    targets = torch.randint(0, 3, (len(inputs),), generator=generator)
    if accumulated:  # gradients of an earlier micro-batch, not yet stepped on
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.randn(p.shape, generator=generator)
    expected_model = copy.deepcopy(model)
    for p, q in zip(model.parameters(), expected_model.parameters(), strict=True):
        q.grad = None if p.grad is None else p.grad.clone()
    pieces = inputs.chunk(len(chunks))

    # what DataParallel computes: one copy per device, each on its chunk, one loss
    replicas = [copy.deepcopy(model) for _ in pieces]
    for replica in replicas:
        replica.zero_grad(set_to_none=True)  # a fresh copy has no gradient
    F.cross_entropy(torch.cat([r(x) for r, x in zip(replicas, pieces, strict=True)]),
                    targets).backward()
    # expected: one module run on the same chunks; autograd sums its uses of a parameter
    F.cross_entropy(torch.cat([expected_model(x) for x in pieces]), targets).backward()

    fn(model, replicas)
    held = {name for name, p in expected_model.named_parameters() if p.grad is not None}
    earlier = {name for name, p in model.named_parameters() if accumulated and p.requires_grad}
    return _grads(model), {"grads": _grads(expected_model), "earlier": earlier & held}


def _show(tensor: torch.Tensor, limit: int = 4) -> str:
    values = [f"{v:.4g}" for v in tensor.flatten()[:limit].tolist()]
    return "[" + ", ".join(values) + (", ...]" if tensor.numel() > limit else "]")


def _judge_grads(got: dict, expected: dict) -> str | None:
    for name, want in expected["grads"].items():
        have = got[name]
        if want is None and have is not None:
            return (f"{name}: expected no gradient (.grad None: no replica computed one), "
                    f"got a tensor {_show(have)}")
        if want is None:
            continue
        if have is None:
            held = (" (it held an earlier micro-batch's gradient)"
                    if name in expected["earlier"] else "")
            return f"{name}: expected a gradient, got None{held}"
        if have.shape != want.shape:
            return f"{name}: expected shape {tuple(want.shape)}, got {tuple(have.shape)}"
        have, want = have.double(), want.double()
        if not torch.allclose(have, want, rtol=1e-4, atol=1e-6):
            scale = float((have * want).sum() / (want * want).sum()) if want.any() else 0.0
            ratio = (f" ({scale:.3g} times the expected)"
                     if torch.allclose(have, scale * want, rtol=1e-4, atol=1e-6) else "")
            return f"{name}: values differ: expected {_show(want)}, got {_show(have)}{ratio}"
    return None


# ---------------------------------------------------------------- 04.2 scatter's chunks

def _split_trial(fn, batch: int | None, devices: int | None):
    drawn = None
    if batch is None:  # drawn afresh: no table of copied answers holds it
        draw = random.SystemRandom()
        batch, devices = draw.randint(1, 512), draw.randint(2, 16)
        drawn = f"a batch of {batch} over {devices} devices"
    result = fn(batch, devices)
    if isinstance(result, torch.Tensor):
        result = result.tolist()
    try:  # ints, or integers of another kind (NumPy's); never bools
        if not any(isinstance(v, bool) for v in result):
            result = [operator.index(v) for v in result]
    except TypeError:
        pass
    # DataParallel's scatter calls tensor.chunk(len(device_ids)) on every input tensor
    return result, {"sizes": [len(chunk) for chunk in torch.empty(batch).chunk(devices)],
                    "drawn": drawn}


def _judge_split(got, expected: dict) -> str | None:
    where = f"for {expected['drawn']}: " if expected["drawn"] else ""
    expected = expected["sizes"]
    if not isinstance(got, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in got):
        return f"{where}expected a list of int batch sizes, got {got!r}"
    if got == expected:
        return None
    difference = f"{where}expected {expected}, got {got}"
    if sum(got) != sum(expected):
        return f"{difference}: {sum(got)} samples, not {sum(expected)}"
    if len(got) != len(expected):
        return (f"{difference}: {len(expected)} device{'s get' if len(expected) > 1 else ' gets'}"
                f" work (a device with no chunk gets no replica), not {len(got)}")
    return difference


EXERCISES = [
    Exercise(
        key="04.1", difficulty=1, minutes=20,
        title="the replicas' gradients into the original module",
        function="add_replica_grads",
        cases=[Case("2 replicas of an MLP", ("mlp", ("±", "±"), False)),
                Case("4 replicas, gradients already accumulated in the module",
                     ("mlp", ("±", "±", "±", "±"), True)),
                Case("3 replicas, an expert some of them never called",
                     ("routed", ("+", "±", "-"), True)),
                Case("2 replicas, a frozen layer and a layer no replica used",
                     ("routed with extras", ("±", "±"), False)),
                Case("2 replicas, gradients already accumulated, a layer no replica used",
                     ("routed with extras", ("±", "±"), True)),
                Case("2 replicas, gradients already accumulated, an expert no replica called",
                     ("routed", ("+", "+"), True))],
        trial=_sum_trial, judge=_judge_grads,
        hint="each replica holds the gradient of its chunk's share of the loss, so the "
             "full-batch gradient is their sum; a replica whose .grad is None adds nothing, "
             "and the module's .grad accumulates the way backward would",
    ),
    Exercise(
        key="04.2", difficulty=1, minutes=15,
        title="how scatter splits a batch", function="chunk_sizes",
        cases=[Case(f"a batch of {batch} over {devices} devices", (batch, devices))
               for batch, devices in ((64, 4), (65, 4), (10, 4), (6, 4), (3, 8), (1, 2))]
        + [Case("a batch and a number of devices drawn afresh", (None, None))],
        trial=_split_trial, judge=_judge_split,
        hint="scatter splits with torch.chunk, not into equal shares: read how big "
             "torch.chunk makes each chunk, then count the chunks for a batch of 6 over 4 "
             "devices",
    ),
]
