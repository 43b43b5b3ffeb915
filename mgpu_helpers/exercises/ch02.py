"""Chapter 02's exercises: ``DistributedSampler`` from scratch, a collate function for
sequences of different lengths, and an exact metric over padded shards; each checked
against PyTorch's own (the sampler's indices, ``pad_sequence``, the true accuracy).
The shuffled sampler's seed and the samples' correctness are drawn afresh on every
check, so that indices or an accuracy copied from an earlier check fail."""

from __future__ import annotations

import math
import operator
import random

import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DistributedSampler

from .core import Case, Exercise, as_number, beyond, calls_during, shared_fresh_seed


def _show(values: list, limit: int = 12) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return "[" + shown + (", ...]" if len(values) > limit else "]")


# ---------------------------------------------------------------- 02.1 the sampler

def _count(n: int) -> str:
    return f"{n} index" if n == 1 else f"{n} indices"


def _as_indices(result) -> list[int] | str:
    """The reader's indices as a list of ints, or what is wrong with them."""
    if isinstance(result, torch.Tensor):
        result = result.tolist()
    try:
        values = list(result)
    except TypeError:
        return f"expected a list of indices, got {type(result).__name__}"
    try:  # ints, or integers of another kind (NumPy's); never bools
        if any(isinstance(v, bool) for v in values):
            raise TypeError
        return [operator.index(v) for v in values]
    except TypeError:
        kinds = sorted({type(v).__name__ for v in values})
        return f"expected a list of int indices, got elements of type {', '.join(kinds)}"



# DistributedSampler's own code: recognised by calls_during through an alias, a subclass
# (which runs these through super()) or a call from another helper
_SAMPLER_CODE = {getattr(DistributedSampler, name): f"DistributedSampler.{name}"
                 for name in ("__init__", "__iter__", "__len__", "set_epoch")}


def _sampler_trial(fn, n: int, world: int, epochs: tuple, seed: int | None, shuffle: bool,
                   drop_last: bool):
    if seed is None:  # drawn afresh: a shuffle copied from an earlier check fails
        seed = random.SystemRandom().randrange(2**31)
    expected = {}
    for epoch in epochs:
        for rank in range(world):
            sampler = DistributedSampler(range(n), num_replicas=world, rank=rank,
                                         shuffle=shuffle, seed=seed, drop_last=drop_last)
            sampler.set_epoch(epoch)
            expected[epoch, rank] = list(sampler)

    def readers() -> dict:
        return {(epoch, rank): _as_indices(fn(n, world, rank, epoch, seed, shuffle,
                                              drop_last))
                for epoch in epochs for rank in range(world)}

    got, used = calls_during(_SAMPLER_CODE, readers)
    return {"indices": got, "used": used, "seed": seed if shuffle else None}, expected


def _judge_sampler(result: dict, expected: dict) -> str | None:
    if result["used"]:
        return (f"your function ran torch's DistributedSampler ({result['used'][0]}): the "
                "exercise is to compute its indices yourself, without it (directly, through "
                "another name or a subclass)")
    got, seed = result["indices"], result["seed"]
    for (epoch, rank), want in expected.items():
        have = got[epoch, rank]
        where = f"epoch {epoch}, rank {rank}" + ("" if seed is None else f" (seed {seed})")
        if isinstance(have, str):
            return f"{where}: {have}"
        if len(have) != len(want):
            return (f"{where}: expected {_count(len(want))}, got {len(have)}: expected "
                    f"{_show(want)}, got {_show(have)}")
        if have != want:
            first = next(k for k, (a, b) in enumerate(zip(have, want, strict=True)) if a != b)
            start = max(0, first - 2) if first >= 12 else 0
            shown = f" from position {start}" if start else ""
            return (f"{where}: expected {_show(want[start:])}, got {_show(have[start:])}"
                    f"{shown}")
    return None


def _sampler_cases() -> list[Case]:
    # (label, n, world, epochs, seed, shuffle, drop_last); seed None: drawn afresh on
    # each check (unshuffled, the seed changes nothing)
    table = [
        ("12 samples, 4 ranks, not shuffled", 12, 4, (0,), 0, False, False),
        ("10 samples, 4 ranks, not shuffled: padded to 12", 10, 4, (0,), 0, False, False),
        ("11 samples, 2 ranks, shuffled, epochs 0 to 2", 11, 2, (0, 1, 2), None, True, False),
        ("10 samples, 4 ranks, shuffled, drop_last", 10, 4, (0, 1), None, True, True),
        ("3 samples, 8 ranks: more ranks than samples", 3, 8, (0,), None, True, False),
        ("100 samples, 3 ranks, epochs 4 and 5", 100, 3, (4, 5), None, True, False),
    ]
    return [Case(label, args) for label, *args in table]


# ---------------------------------------------------------------- 02.2 the collate

class _Sequences(torch.utils.data.Dataset):
    """(sequence, label) samples: token ids of shape (length,), or float features of
    shape (length, features)."""

    def __init__(self, lengths: tuple, features: int):
        generator = torch.Generator().manual_seed(sum(lengths) + features)
        self.samples = []
        for index, length in enumerate(lengths):
            if features:
                sequence = torch.rand(length, features, generator=generator)
            else:
                sequence = torch.randint(1, 100, (length,), generator=generator)
            self.samples.append((sequence, index % 3))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def _collate_trial(fn, lengths: tuple, features: int, batch_size: int):
    dataset = _Sequences(lengths, features)
    got, expected = [], []
    for start in range(0, len(dataset), batch_size):
        samples = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        got.append(fn(samples))  # what DataLoader(..., collate_fn=fn) does with each batch
        sequences, labels = zip(*samples, strict=True)
        expected.append((pad_sequence(list(sequences), batch_first=True, padding_value=0),
                         torch.tensor([len(s) for s in sequences]), torch.tensor(labels)))
    return got, expected


def _describe(tensor: torch.Tensor) -> str:
    return f"shape {tuple(tensor.shape)}, dtype {str(tensor.dtype).removeprefix('torch.')}"


def _judge_collate(got: list, expected: list) -> str | None:
    names = ("padded", "lengths", "labels")
    for number, (have, want) in enumerate(zip(got, expected, strict=True)):
        where = f"batch {number}"
        if not isinstance(have, (tuple, list)) or len(have) != 3:
            return f"{where}: expected a tuple (padded, lengths, labels), got {type(have).__name__}"
        for name, value, reference in zip(names, have, want, strict=True):
            if not isinstance(value, torch.Tensor):
                return f"{where}: {name} should be a tensor, got {type(value).__name__}"
            if value.shape != reference.shape:
                return f"{where}: {name}: expected {_describe(reference)}, got {_describe(value)}"
            if name == "lengths" and (value.is_floating_point() or value.dtype == torch.bool):
                return f"{where}: lengths must be whole numbers, got dtype {value.dtype}"
            if name != "lengths" and value.dtype != reference.dtype:
                return f"{where}: {name}: expected {_describe(reference)}, got {_describe(value)}"
            if not torch.equal(value.to(reference.dtype), reference):
                if name == "padded":
                    rows = [k for k in range(len(value)) if not torch.equal(value[k], reference[k])]
                    return (f"{where}: padded: sequence {rows[0]} (length "
                            f"{int(want[1][rows[0]])}) differs: expected its values first, then "
                            f"zeros up to the batch's longest ({reference.shape[1]})")
                return f"{where}: {name}: expected {reference.tolist()}, got {value.tolist()}"
    return None


# ---------------------------------------------------------------- 02.3 exact metric

def _correct_for(n: int, shards: list[list[int]], generator: torch.Generator) -> list[int]:
    """0 or 1 for each of the ``n`` samples, drawn from ``generator`` until every shortcut
    is visibly wrong: the duplicates (or, without padding, the last entry of each shard)
    are right at another rate than the whole, and where the shards' real shares differ,
    the mean of the ranks' accuracies is not the accuracy."""
    world = len(shards)
    order = [shards[k % world][k // world] for k in range(world * len(shards[0]))]
    tail = order[n:] or order[-world:]  # what a share miscounted by one gets wrong
    shares = [[i for k, i in enumerate(order[:n]) if k % world == rank]
              for rank in range(world)]
    for _ in range(1000):
        correct = torch.randint(0, 2, (n,), generator=generator).tolist()
        right, tail_right = sum(correct), sum(correct[i] for i in tail)
        if tail_right * n == right * len(tail):
            continue
        if len({len(share) for share in shares}) > 1:
            means = sum(sum(correct[i] for i in share) / len(share) for share in shares)
            if abs(means / world - right / n) < 1e-9:
                continue
        return correct
    raise RuntimeError(f"no draw of {n} samples made every shortcut visible")


def _accuracy_trial(fn, n: int, shuffle: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    # drawn afresh, the same on every rank: which samples are right, the sampler's
    # seed and epoch
    generator = torch.Generator().manual_seed(shared_fresh_seed())
    seed, epoch = torch.randint(0, 2**31, (2,), generator=generator).tolist()
    shards = []
    for r in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=shuffle,
                                     seed=seed)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    correct = _correct_for(n, shards, generator)
    shard = torch.tensor([float(correct[i]) for i in shards[rank]])  # this rank's shard
    result = fn(shard, n)
    number = as_number(result)  # a float, NumPy's scalar or a one-element tensor
    return result if number is None else number, (sum(correct), n)


def _judge_accuracy(result, expected) -> str | None:
    right, n = expected
    value = as_number(result)
    if value is None:
        return f"expected a number (the accuracy), got {type(result).__name__}"
    if beyond(abs(value - right / n), 1e-6):
        finite = "" if math.isfinite(value) else " (not a finite number)"
        return (f"expected {right / n:.4f} ({right} of {n} samples correct), "
                f"got {value:.4f}{finite}")
    return None


def _accuracy_cases() -> list[Case]:
    # which samples are right is drawn afresh (see _correct_for); the padded duplicates
    # and the ranks' uneven shares make each shortcut visibly wrong
    table = [
        ("11 samples on 2 ranks, not shuffled", 11, False, 2),
        ("10 samples on 4 ranks, shuffled", 10, True, 4),
        ("7 samples on 3 ranks, shuffled", 7, True, 3),
        # world_size divides the samples: no padding, and every rank's share is full
        ("12 samples on 4 ranks, shuffled: no padding", 12, True, 4),
        ("9 samples on 3 ranks, not shuffled: no padding", 9, False, 3),
    ]
    return [Case(label, (n, shuffle), world) for label, n, shuffle, world in table]


EXERCISES = [
    Exercise(
        key="02.1", difficulty=2, minutes=30,
        title="DistributedSampler from scratch", function="my_sampler_indices",
        cases=_sampler_cases(), trial=_sampler_trial, judge=_judge_sampler,
        hint="one order for every rank (shuffled from seed + epoch), padded by repeating "
             "it from its start until it divides evenly (or cut, with drop_last), then "
             "every world_size-th index starting at the rank; the padding can be longer "
             "than the dataset",
    ),
    Exercise(
        key="02.2", difficulty=1, minutes=20,
        title="a collate_fn for sequences of different lengths",
        function="collate_sequences",
        cases=[Case("token ids, lengths 5 to 9, batches of 4", ((5, 9, 7, 6, 8, 5, 9, 6), 0, 4)),
               Case("float features (length x 3), a length-1 sequence, last batch of 2",
                    ((4, 1, 6, 3, 2, 5), 3, 4)),
               Case("all sequences of length 4", ((4, 4, 4, 4), 0, 2))],
        trial=_collate_trial, judge=_judge_collate,
        hint="batch first: (batch, longest length in this batch, ...), zeros after each "
             "sequence's own values, in the sequences' dtype; the lengths are those before "
             "padding",
    ),
    Exercise(
        key="02.3", difficulty=2, minutes=30,
        title="an exact accuracy from padded shards", function="exact_accuracy",
        cases=_accuracy_cases(), trial=_accuracy_trial, judge=_judge_accuracy,
        hint="position i of rank r's shard is position r + i * world_size of the padded "
             "order, and only the positions past the dataset's length are duplicates; "
             "all-reduce the counts, not the ranks' means",
    ),
]
