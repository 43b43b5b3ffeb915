"""Chapter 05's scaling-rule demonstration: one SGD recipe on 1, 2 and 4 simulated ranks.

N DDP ranks with batch b each compute exactly what one process computes with batch N*b
(chapter 05 checks it with real ranks), so here N ranks are simulated by one process
with batch N*b: the curves need no processes and take seconds. Each run sees the same
number of epochs, so N ranks take N times fewer optimizer steps. Without scaling the
learning rate, they learn less per epoch; the linear rule (Goyal et al., 2017) gives them
N times the rate, reached by a linear warm-up from the one-rank rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..training.recipe import DigitsRun, digits_datasets


@dataclass(frozen=True)
class Rule:
    """How a run with ``ranks`` ranks sets its learning rate."""

    ranks: int
    scale_lr: bool = False       # linear rule: peak rate = ranks x the one-rank rate
    warmup_epochs: float = 0.0   # linear ramp from the one-rank rate to the peak

    @property
    def label(self) -> str:
        if self.ranks == 1:
            return "1 rank"
        if not self.scale_lr:
            return f"{self.ranks} ranks, same learning rate"
        warm = f", {self.warmup_epochs:g}-epoch warm-up" if self.warmup_epochs else ", no warm-up"
        return f"{self.ranks} ranks, {self.ranks}x learning rate{warm}"


def digits_tensors() -> tuple[torch.Tensor, ...]:
    """The digits' train and test images and labels as four tensors (no augmentation)."""
    train, test = digits_datasets(DigitsRun(augment=False))

    def stacked(dataset):
        images, labels = zip(*(dataset[i] for i in range(len(dataset))), strict=True)
        return torch.stack(images), torch.tensor(labels)

    return (*stacked(train), *stacked(test))


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def train_curve(data: tuple, rule: Rule, per_rank_batch: int = 16, base_lr: float = 0.005,
                epochs: int = 3, evaluations_per_epoch: int = 4, seed: int = 0) -> dict:
    """Train :func:`small_model` with SGD (momentum 0.9) for ``epochs`` epochs at global
    batch ``rule.ranks * per_rank_batch``, and measure test accuracy
    ``evaluations_per_epoch`` times per epoch. Every run shuffles the same way.

    Returns ``{"label", "batch", "epochs", "steps", "accuracy", "lr"}``: the last four
    are lists, one entry per evaluation (``lr`` is the rate of the step before it).
    """
    if rule.ranks < 1 or per_rank_batch < 1 or epochs < 1 or evaluations_per_epoch < 1:
        raise ValueError("ranks, per_rank_batch, epochs and evaluations_per_epoch must be "
                         f"at least 1, got {rule}, {per_rank_batch}, {epochs}, "
                         f"{evaluations_per_epoch}")
    images, labels, test_images, test_labels = data
    batch = rule.ranks * per_rank_batch
    steps_per_epoch = len(images) // batch  # drop the last, short batch
    if steps_per_epoch < evaluations_per_epoch:
        raise ValueError(f"a global batch of {batch} gives {steps_per_epoch} steps per "
                         f"epoch, fewer than {evaluations_per_epoch} evaluations")
    model = small_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9)
    peak = base_lr * (rule.ranks if rule.scale_lr else 1)
    warmup_steps = round(rule.warmup_epochs * steps_per_epoch)
    every = steps_per_epoch // evaluations_per_epoch
    shuffle = torch.Generator().manual_seed(seed)
    curve = {"label": rule.label, "batch": batch, "epochs": [], "steps": [], "accuracy": [],
             "lr": []}
    step = 0
    for _ in range(epochs):
        order = torch.randperm(len(images), generator=shuffle)
        for k in range(steps_per_epoch):
            ramp = min(1.0, step / warmup_steps) if warmup_steps else 1.0
            lr = base_lr + (peak - base_lr) * ramp
            for group in optimizer.param_groups:
                group["lr"] = lr
            chosen = order[k * batch:(k + 1) * batch]
            optimizer.zero_grad()
            F.cross_entropy(model(images[chosen]), labels[chosen]).backward()
            optimizer.step()
            step += 1
            if (k + 1) % every == 0 and (k + 1) // every <= evaluations_per_epoch:
                with torch.no_grad():
                    correct = (model(test_images).argmax(1) == test_labels).sum().item()
                curve["epochs"].append(step * batch / len(images))
                curve["steps"].append(step)
                curve["accuracy"].append(correct / len(test_labels))
                curve["lr"].append(lr)
    return curve


def mean_curve(data: tuple, rule: Rule, seeds=range(5), **settings) -> dict:
    """:func:`train_curve` run once per seed (initial weights and shuffling), with the
    accuracies averaged: one run on 355 test images is noisy."""
    runs = [train_curve(data, rule, seed=seed, **settings) for seed in seeds]
    if not runs:
        raise ValueError("mean_curve needs at least one seed")
    accuracy = [sum(values) / len(values)
                for values in zip(*(run["accuracy"] for run in runs), strict=True)]
    return {**runs[0], "accuracy": accuracy, "seeds": len(runs)}


def steps_to_reach(curve: dict, accuracy: float) -> int | None:
    """The first evaluated step at which ``curve`` reached ``accuracy`` (None: never)."""
    return next((step for step, value in zip(curve["steps"], curve["accuracy"], strict=True)
                 if value >= accuracy), None)


def plot(curves: list[dict]):
    """Test accuracy against epochs (left) and against optimizer steps (right)."""
    import matplotlib.pyplot as plt

    fig, (by_epoch, by_step) = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for k, curve in enumerate(curves):
        style = {"color": f"C{k}", "marker": "o", "markersize": 3}
        by_epoch.plot(curve["epochs"], curve["accuracy"], label=curve["label"], **style)
        by_step.plot(curve["steps"], curve["accuracy"], **style)
    by_epoch.set(xlabel="epochs (samples seen / training set)", ylabel="test accuracy",
                 title="Same data seen")
    by_step.set(xlabel="optimizer steps", xscale="log", title="Against optimizer steps")
    by_epoch.legend(fontsize=8)
    for ax in (by_epoch, by_step):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
