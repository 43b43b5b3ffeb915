"""Datasets, collate functions and loader seeding for the data chapters (01, 02)."""

from .embedded import data_dir, digit_image, load_cifar10, prepare_digits, prepare_photos
from .image_folder import BadImageError, ImageDataset, load_rgb
from .loading import loader_generator, names_collate, pad_collate, rank_seed, seed_worker

__all__ = [
    "BadImageError", "ImageDataset", "data_dir", "digit_image", "load_cifar10", "load_rgb",
    "loader_generator", "names_collate", "pad_collate", "prepare_digits", "prepare_photos",
    "rank_seed", "seed_worker",
]
