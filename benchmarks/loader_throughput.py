"""Data loading: a naive DataLoader against chapter 02's tuned one, alone and while training.

Two loaders over the digits training set with chapter 02's augmentation:

* naive: ``num_workers=0`` (decode and augment every image, every epoch, in the training
  process);
* tuned: worker processes (one per core, at most 2 here), ``persistent_workers``,
  ``prefetch_factor=4``, and pinned memory when a GPU exists.

For each: images/s when only loading, and the data-wait fraction while training the
tutorial CNN (time the loop spends waiting for the next batch / total step time).
Writes loader_throughput.{json,png}.
Run: `make bench` or `python benchmarks/loader_throughput.py --steps 20`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

from mgpu_helpers.data import ImageDataset, loader_generator, prepare_digits, seed_worker  # noqa: E402
from mgpu_helpers.models import SeedCNN  # noqa: E402
from mgpu_helpers.runtime.devices import count_gpus  # noqa: E402

from results_dir import results_dir  # noqa: E402

RESULTS = results_dir()  # runs/bench/ unless MGPU_BENCH_DIR says otherwise
BATCH = 64


def make_loader(dataset, tuned: bool) -> DataLoader:
    if not tuned:
        return DataLoader(dataset, batch_size=BATCH, shuffle=True,
                          generator=loader_generator(0))
    workers = max(1, min(2, os.cpu_count() or 1))
    return DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers,
                      persistent_workers=True, prefetch_factor=4, pin_memory=count_gpus() > 0,
                      worker_init_fn=seed_worker, generator=loader_generator(0))


def loading_rate(loader: DataLoader, epochs: int) -> float:
    for _ in loader:  # warm-up epoch (starts persistent workers)
        pass
    rates = []
    for _ in range(epochs):
        start = time.perf_counter()
        count = sum(len(labels) for _, labels in loader)
        rates.append(count / (time.perf_counter() - start))
    return statistics.median(rates)


def data_wait_fraction(loader: DataLoader, steps: int) -> tuple[float, float]:
    """Train the tutorial CNN for ``steps`` steps; return (wait fraction, mean step seconds)."""
    torch.manual_seed(0)
    model = SeedCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = iter(loader)
    next(batches)  # the first batch includes start-up; it is not a steady-state step
    waited = total = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        try:
            images, labels = next(batches)
        except StopIteration:
            batches = iter(loader)
            images, labels = next(batches)
        got_batch = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        end = time.perf_counter()
        waited += got_batch - start
        total += end - start
    return waited / total, total / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="timed loading epochs")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps")
    args = parser.parse_args()
    if args.epochs < 1 or args.steps < 1:
        parser.error("--epochs and --steps must be at least 1")

    torch.set_num_threads(1)
    augment = v2.Compose([
        v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1)),
        v2.ColorJitter(brightness=0.3, contrast=0.3),
        v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
    ])
    dataset = ImageDataset(prepare_digits(progress=False) / "train", transform=augment)
    result = {"batch_size": BATCH, "images": len(dataset), "cpus": os.cpu_count(),
              "torch": torch.__version__, "loaders": {}}
    for name, tuned in (("naive", False), ("tuned", True)):
        loader = make_loader(dataset, tuned)
        rate = loading_rate(loader, args.epochs)
        wait, step = data_wait_fraction(make_loader(dataset, tuned), args.steps)
        result["loaders"][name] = {"images_per_s": rate, "data_wait_fraction": wait,
                                   "step_s": step, "num_workers": loader.num_workers}
        print(f"{name:>5}: {rate:7.0f} images/s loading only; while training: "
              f"{wait:6.1%} of each {step * 1e3:.0f} ms step spent waiting for data")
        del loader
    tuned = result["loaders"]["tuned"]
    result["target_tuned_wait_at_most_5pct"] = tuned["data_wait_fraction"] <= 0.05
    (RESULTS / "loader_throughput.json").write_text(json.dumps(result, indent=2) + "\n")

    fig, (ax_rate, ax_wait) = plt.subplots(1, 2, figsize=(9, 3))
    names = list(result["loaders"])
    ax_rate.bar(names, [result["loaders"][n]["images_per_s"] for n in names], color=["C7", "C0"])
    ax_rate.set(ylabel="images / s", title="Loading only")
    ax_wait.bar(names, [100 * result["loaders"][n]["data_wait_fraction"] for n in names],
                color=["C7", "C0"])
    ax_wait.axhline(5, color="C3", linestyle="--", label="5% target")
    ax_wait.set(ylabel="% of step waiting for data", title="While training the tutorial CNN")
    ax_wait.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "loader_throughput.png", dpi=120)
    print(f"target met (tuned data wait <= 5%): {result['target_tuned_wait_at_most_5pct']}")


if __name__ == "__main__":
    main()
