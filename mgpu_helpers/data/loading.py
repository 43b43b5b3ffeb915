"""DataLoader helpers: collate functions and reproducible, distinct worker randomness."""

from __future__ import annotations

import random

import numpy as np
import torch


def names_collate(batch):
    """The original tutorial's collate, for ``(image, label, name)`` samples: stack images
    and labels, keep names as a tuple of strings (the default collate would too, but this
    shows how)."""
    images, labels, names = zip(*batch, strict=True)
    return torch.stack(images), torch.tensor(labels), names


def pad_collate(batch):
    """Batch ``(image, label)`` samples of different sizes by zero-padding to the largest.

    Returns:
        ``(images, mask, labels)``: images ``N x C x H x W``; mask ``N x H x W``, True
        where a pixel is real and False where it is padding; labels ``N``.
    """
    images, labels = zip(*batch, strict=True)
    channels = {image.shape[0] for image in images}
    if len(channels) != 1:
        raise ValueError(f"pad_collate needs one channel count per batch, got {sorted(channels)}")
    height = max(image.shape[1] for image in images)
    width = max(image.shape[2] for image in images)
    padded = images[0].new_zeros(len(images), channels.pop(), height, width)
    mask = torch.zeros(len(images), height, width, dtype=torch.bool)
    for slot, image in enumerate(images):
        padded[slot, :, : image.shape[1], : image.shape[2]] = image
        mask[slot, : image.shape[1], : image.shape[2]] = True
    return padded, mask, torch.tensor(labels)


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn``: seed NumPy and ``random`` from the worker's own torch seed.

    Each worker's torch seed is the loader's base seed (drawn from its ``generator``) plus
    the worker id. Before PyTorch 1.9, NumPy's state was simply copied from the parent, so
    every worker drew the same "random" augmentations; PyTorch now seeds NumPy itself, from
    a hash of the base seed and the worker id. This function re-seeds NumPy and ``random``
    with the worker's torch seed (modulo 2**32): one rule for all three, on any version.
    It does nothing for *ranks*: two ranks whose loaders share a seed still draw identical
    streams, which is what :func:`loader_generator` fixes.
    """
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """A seed for ``rank`` derived from the run's ``seed``: ``seed`` itself for rank 0, and a
    different one for every other rank.

    Pass it to :func:`mgpu_helpers.training.seeding.seed_everything` inside each rank: with
    ``num_workers=0``, augmentation draws from the rank's own global generators, and ranks
    seeded alike would apply identical augmentations. :func:`loader_generator` uses the same
    derivation for the loader's generator (the workers' seeds).
    """
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return (seed + 1_000_003 * rank) % 2**32


def loader_generator(seed: int, rank: int = 0) -> torch.Generator:
    """A generator for ``DataLoader(generator=...)``: reproducible, and distinct per rank,
    so that ranks do not apply identical augmentations to their different samples."""
    return torch.Generator().manual_seed(rank_seed(seed, rank))
