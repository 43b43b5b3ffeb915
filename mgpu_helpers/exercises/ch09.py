"""Chapter 09's exercises: find the bug. Each task shows a function that hangs or silently
computes the wrong thing on several ranks; the reader writes the fixed one, which runs on
gloo ranks under a short timeout (a hang is a failed case). The losses, metrics, data and
weights are drawn afresh on every check, the same on every rank (a seed rank 0 draws and
broadcasts), so that a result copied from an earlier check fails."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .core import Case, Exercise, as_number, beyond, shared_fresh_seed


def _close(got, expected: float) -> bool:
    # any real number: an int, a float, NumPy's scalar, a one-element tensor; never nan
    value = as_number(got)
    return value is not None and not beyond(abs(value - expected),
                                            1e-6 * max(1.0, abs(expected)))


# ---------------------------------------------------------------- 09.1 rank 0 only

def _losses(counts: tuple[int, ...], seed: int) -> list[list[float]]:
    # rank r's losses lie in [3r, 3r + 1): for counts 2, 5, 1 the mean of the ranks'
    # means is off by 0.08 at least, whatever the draw
    generator = torch.Generator().manual_seed(seed)
    return [(torch.rand(count, generator=generator) + 3 * rank).tolist()
            for rank, count in enumerate(counts)]


def _mean_loss_trial(fn, counts: tuple[int, ...]):
    losses = _losses(counts, shared_fresh_seed())
    everything = [loss for rank_losses in losses for loss in rank_losses]
    got = fn(list(losses[dist.get_rank()]))
    return got, sum(everything) / len(everything)


def _shown(value) -> str:
    number = as_number(value)
    return repr(value) if number is None else f"{number:.6g}"


def _mean_loss_judge(got, expected) -> str | None:
    if not _close(got, expected):
        return (f"expected the mean loss over every rank's samples, {expected:.6g}, got "
                f"{_shown(got)}")
    return None


# ---------------------------------------------------------------- 09.2 dict order

_METRICS = ("loss", "accuracy", "grad_norm", "samples_per_s")


def _all_metrics(world: int, seed: int) -> list[dict[str, float]]:
    """Each rank's metrics, drawn from ``seed``: four levels, each in a range of its own
    (so always in this order), and a factor per rank. The ranks' values sort in different
    orders (rank r's ascending order is the names turned by r places), so no order read
    off the values is the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    low = torch.tensor([0.1, 0.5, 2.0, 100.0], dtype=torch.float64)
    high = torch.tensor([0.5, 2.0, 10.0, 1000.0], dtype=torch.float64)
    levels = (low + (high - low) * torch.rand(4, generator=generator,
                                              dtype=torch.float64)).tolist()
    factors = (0.5 + torch.rand(world, generator=generator, dtype=torch.float64)).tolist()
    return [{name: levels[(index + rank) % len(levels)] * factors[rank]
             for index, name in enumerate(_METRICS)} for rank in range(world)]


def _metrics_trial(fn, orders_differ: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = _all_metrics(world, shared_fresh_seed())
    values = everyone[rank]
    shift = rank if orders_differ else 0  # the order the metrics were recorded in
    names = _METRICS[shift:] + _METRICS[:shift]
    got = fn({name: values[name] for name in names})
    expected = {name: sum(metrics[name] for metrics in everyone) / world
                for name in _METRICS}
    return got, expected


def _metrics_judge(got, expected) -> str | None:
    if not isinstance(got, dict) or set(got) != set(expected):
        keys = sorted(got) if isinstance(got, dict) else type(got).__name__
        return f"expected a dict with the keys {sorted(expected)}, got {keys}"
    wrong = [f"{name!r} expected {expected[name]:.6g}, got {_shown(got[name])}"
             for name in _METRICS if not _close(got[name], expected[name])]
    if wrong:
        return "averages over the ranks: " + "; ".join(wrong)
    return None


# ---------------------------------------------------------------- 09.3 uneven batches

def _uneven_batches(counts: tuple[int, ...], seed: int):
    generator = torch.Generator().manual_seed(seed)
    steps = max(counts)
    inputs = torch.randn(len(counts), steps, 4, 4, generator=generator)
    targets = torch.randn(len(counts), steps, 4, 2, generator=generator)
    return inputs, targets


def _linear(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # in a rank: its own process's generators
    return nn.Linear(4, 2)


def _uneven_trial(fn, counts: tuple[int, ...], lr: float = 0.1):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    seed = shared_fresh_seed()  # the data and the weights, drawn afresh on every check
    inputs, targets = _uneven_batches(counts, seed)
    model = DDP(_linear(seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    fn(model, optimizer, [(inputs[rank, i], targets[rank, i]) for i in range(counts[rank])])
    # one process: the first min(counts) batches of every rank, together
    single = _linear(seed)
    single_optimizer = torch.optim.SGD(single.parameters(), lr=lr)
    for i in range(min(counts)):
        single_optimizer.zero_grad()
        F.mse_loss(single(inputs[:, i].reshape(-1, 4)), targets[:, i].reshape(-1, 2)).backward()
        single_optimizer.step()
    return ([p.detach().clone() for p in model.module.parameters()],
            {"weights": [p.detach() for p in single.parameters()], "steps": min(counts)})


def _uneven_judge(got, expected) -> str | None:
    # torch's max keeps a nan (Python's max may drop it)
    difference = float(torch.tensor([(a.double() - b.double()).abs().max().item()
                                     for a, b in zip(got, expected["weights"],
                                                     strict=True)]).max())
    if beyond(difference, 1e-6):
        steps = expected["steps"]
        trained = "1 step on the first batch" if steps == 1 else (
            f"{steps} steps on the first {steps} batches")
        return (f"the weights differ by up to {difference:.2g} from {trained} of every rank "
                "(expected within 1e-6)")
    return None


EXERCISES = [
    Exercise(
        key="09.1", difficulty=1, minutes=15,
        title="a metric only rank 0 reduces", function="epoch_mean_loss",
        cases=[Case(f"{len(counts)} ranks with {', '.join(map(str, counts))} losses",
                    (counts,), len(counts))
               for counts in ((3, 3), (2, 5, 1))],
        trial=_mean_loss_trial, judge=_mean_loss_judge, timeout=8.0,
        hint="every rank must enter the same collectives: compute the global sum and count "
             "on every rank, and let only the printing depend on the rank; a mean of the "
             "ranks' means weighs a rank with few samples as much as one with many",
    ),
    Exercise(
        key="09.2", difficulty=2, minutes=25,
        title="metrics averaged under the wrong names",
        function="average_metrics",
        cases=[Case("2 ranks, the same order on both", (False,), 2),
               Case("2 ranks, the metrics recorded in different orders", (True,), 2),
               Case("3 ranks, the metrics recorded in different orders", (True,), 3)],
        trial=_metrics_trial, judge=_metrics_judge, timeout=8.0,
        hint="the i-th all-reduce of one rank meets the i-th all-reduce of every other "
             "rank, whatever name each rank had in mind: make the order the same everywhere "
             "(it must not depend on how each rank filled its dict)",
    ),
    Exercise(
        key="09.3", difficulty=2, minutes=30,
        title="ranks with different numbers of batches",
        function="train_on_uneven_batches",
        cases=[Case(f"{len(counts)} ranks with {', '.join(map(str, counts))} batches",
                    (counts,), len(counts))
               for counts in ((3, 2), (2, 4), (3, 1, 2))],
        trial=_uneven_trial, judge=_uneven_judge, timeout=12.0,
        hint="a rank cannot know the other ranks' counts without asking them: one small "
             "collective before the loop gives every rank the smallest count",
    ),
]
