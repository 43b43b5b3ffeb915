"""Draw the README's figures with the workbook's own code (`make figures`).

    python scripts/readme_figures.py [OUT_DIR]      # default: docs/images

* ``augmentation_grid.png`` and ``augmentation_photo.png``: chapter 01's label-preserving
  digit augmentation (the one chapter 05 trains with, ``mgpu_helpers.training.recipe.AUGMENT``) and
  the original tutorial's photo pipeline, drawn by
  ``mgpu_helpers.viz.plots.augmentation_grid``;
* ``sampler_{without,with}_set_epoch.png``: chapter 02's picture of ``DistributedSampler``
  on 2 ranks, with and without ``set_epoch``, drawn by
  ``mgpu_helpers.viz.plots.sampler_partitions`` from orders that 2 real ranks drew
  (``mgpu_helpers.launch``).

The scaling chart and the pipeline's Gantt chart come from ``make bench-store``
(``benchmarks/results/ddp_scaling.png``, ``pipeline_bubble.png``); the JupyterLab
screenshots from the browser test (``make screenshots``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

import mgpu_helpers as mh  # noqa: E402
from mgpu_helpers.data import ImageDataset, load_rgb, prepare_digits, prepare_photos  # noqa: E402
from mgpu_helpers.training.recipe import AUGMENT  # noqa: E402
from mgpu_helpers.viz import plots  # noqa: E402

SEED = 0
DATASET_SIZE, EPOCHS, RANKS = 11, 3, 2


def augmentation_figures(out_dir: Path) -> list[Path]:
    digits = ImageDataset(prepare_digits(progress=False) / "test")
    two = next(digits[i][0] for i, (_, label) in enumerate(digits.samples) if label == 2)
    photo = load_rgb(prepare_photos() / "flower.jpg")
    photo_pipeline = v2.Compose([v2.Resize((224, 224)), v2.RandomHorizontalFlip(),
                                 v2.RandomRotation(10),
                                 v2.ColorJitter(brightness=0.5, contrast=0.5, saturation=0.5)])
    digit_grid = plots.augmentation_grid(two, AUGMENT, draws=7, seed=SEED,
                                       title="chapter 05's training augmentation on a digit")
    photo_grid = plots.augmentation_grid(photo, photo_pipeline, draws=7, seed=SEED,
                                       title="the original tutorial's pipeline on a photo")
    paths = [out_dir / "augmentation_grid.png", out_dir / "augmentation_photo.png"]
    for figure, path in zip((digit_grid, photo_grid), paths, strict=True):
        figure.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(figure)
    return paths


def sampler_orders(dataset_size: int, epochs: int, call_set_epoch: bool) -> list[list[int]]:
    """The indices this rank draws each epoch (run on every rank)."""
    sampler = DistributedSampler(range(dataset_size), shuffle=True, seed=SEED)
    orders = []
    for epoch in range(epochs):
        if call_set_epoch:
            sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def sampler_figures(out_dir: Path) -> list[Path]:
    paths = []
    for call_set_epoch, name, title in (
            (False, "sampler_without_set_epoch", "without set_epoch: the same order every epoch"),
            (True, "sampler_with_set_epoch", "with set_epoch(epoch): reshuffled every epoch")):
        # CPU ranks on every machine: the figure shows indices, the same everywhere
        per_rank = mh.launch(sampler_orders, DATASET_SIZE, EPOCHS, call_set_epoch,
                             nprocs=RANKS, backend="gloo", return_all=True)
        orders = {epoch: [ranks[epoch] for ranks in per_rank] for epoch in range(EPOCHS)}
        figure = plots.sampler_partitions(orders, DATASET_SIZE, title)
        paths.append(out_dir / f"{name}.png")
        figure.savefig(paths[-1], dpi=100, bbox_inches="tight")
        plt.close(figure)
    return paths


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=Path("docs/images"),
                        help="where the PNG files go (default: docs/images)")
    out_dir = parser.parse_args(argv).out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in [*augmentation_figures(out_dir), *sampler_figures(out_dir)]:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
