"""Part III's language task: associative recall, generated, the same on every machine.

A sequence lists ``pairs`` key-value pairs, then asks ``queries`` of its keys again; after
each asked key the model must say the value it was paired with earlier in the same
sequence::

    k3 v12  k9 v4  k1 v7  k14 v0  |  k9 -> v4   k14 -> v0
    \\_____________ context ____________/  \\______ queries ______/

Keys and values are drawn afresh for every sequence, so nothing about a key's value can
be learnt from the training set: the answer is only in the context. A bigram model (the
next token from the current one alone) is right once in ``values`` guesses; a model that
knows answers come from the context but not which one, once in ``pairs``; a transformer
learns to find the key in its context and copy the token after it (an *induction head*,
two attention layers), and its accuracy then jumps to 100%. Raising ``pairs`` lengthens
the sequence and puts the answer further back: the knob for long contexts.

Only the answers are scored: every other target is ``IGNORE`` (-100, ``cross_entropy``'s
``ignore_index``), because a random key or value cannot be predicted. Sequences come from
a seeded ``torch.Generator`` on the CPU, which draws the same numbers on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

#: The target of a position that is not scored (``F.cross_entropy``'s default ignore_index).
IGNORE = -100


@dataclass(frozen=True)
class RecallTask:
    """The shape of the task. Tokens ``0 .. keys-1`` are keys, the next ``values`` ones
    values.

    Args:
        pairs: key-value pairs in each sequence's context.
        queries: keys asked again at the end (distinct, from the context).
        keys: distinct keys (at least ``pairs``: a context never repeats a key).
        values: distinct values.
    """

    pairs: int = 4
    queries: int = 2
    keys: int = 16
    values: int = 16

    def __post_init__(self):
        for name in ("pairs", "queries", "keys", "values"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RecallTask.{name} must be a whole number >= 1, got {value!r}")
        if self.pairs > self.keys:
            raise ValueError(f"RecallTask: {self.pairs} pairs need {self.pairs} distinct keys, "
                             f"but there are {self.keys}: raise keys or lower pairs")
        if self.queries > self.pairs:
            raise ValueError(f"RecallTask: {self.queries} distinct queries cannot come from "
                             f"{self.pairs} pairs: lower queries or raise pairs")

    @property
    def vocab_size(self) -> int:
        return self.keys + self.values

    @property
    def length(self) -> int:
        """Tokens a model reads per sequence: every token but the last, whose successor
        does not exist."""
        return 2 * (self.pairs + self.queries) - 1

    def sequences(self, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` sequences as ``(inputs, targets)``, each ``count x length``: the
        targets are the inputs shifted by one, :data:`IGNORE` except at the answers."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a whole number >= 1, got {count!r}")
        generator = torch.Generator().manual_seed(seed)
        keys = torch.rand(count, self.keys, generator=generator).argsort(1)[:, :self.pairs]
        values = self.keys + torch.randint(self.values, (count, self.pairs), generator=generator)
        asked = torch.rand(count, self.pairs, generator=generator).argsort(1)[:, :self.queries]
        context = torch.stack([keys, values], 2).flatten(1)
        questions = torch.stack([keys.gather(1, asked), values.gather(1, asked)], 2).flatten(1)
        tokens = torch.cat([context, questions], 1)
        targets = torch.full((count, self.length), IGNORE)
        answers = torch.arange(2 * self.pairs, self.length, 2)  # after each asked key
        targets[:, answers] = tokens[:, answers + 1]
        return tokens[:, :-1].contiguous(), targets


class RecallDataset(Dataset):
    """``size`` sequences of ``task``, drawn from ``seed``: ``dataset[i]`` is
    ``(inputs, targets)``. Train and held-out sets take different seeds; the chance that
    they share a sequence is negligible (of the order of size² over the count of
    possible sequences, 3.4e10 for the default task)."""

    def __init__(self, task: RecallTask, size: int, seed: int):
        self.task = task
        self.inputs, self.targets = task.sequences(size, seed)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]
