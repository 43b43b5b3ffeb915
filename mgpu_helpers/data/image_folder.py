"""The original tutorial's ``CustomDataset``, written properly: an image-folder dataset.

The original tutorial lists every file in one folder (``os.listdir``: unsorted, non-images
included), never imports ``PIL`` and returns file names instead of labels. This
version reads ``root/<class>/<image>``, keeps image files only, sorts classes and files
(so sample ``i`` is the same on every machine and every rank), takes labels from the
folder names, and deals with unreadable files by a stated policy.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

# The file types torchvision's ImageFolder reads (torchvision.datasets.folder.IMG_EXTENSIONS).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
BAD_FILE_POLICIES = ("raise", "skip")


class BadImageError(OSError):
    """An image file that cannot be decoded; the message names the file."""


def load_rgb(path: Path) -> Image.Image:
    """Decode ``path`` fully as RGB, or raise :class:`BadImageError` naming it."""
    try:
        with Image.open(path) as image:
            image.load()  # decode now: a truncated file fails here, not later in a worker
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        size = path.stat().st_size if path.exists() else 0
        why = "the file is empty" if size == 0 else f"{type(exc).__name__}: {exc}"
        raise BadImageError(
            f"cannot read image {path}: {why}. Replace or delete the file, or build the "
            "dataset with bad_files='skip' to leave such files out."
        ) from exc


class ImageDataset(Dataset):
    """Images in ``root/<class_name>/<file>``, returned as ``(image, label)``.

    Args:
        root: folder with one sub-folder per class.
        transform: callable applied to each PIL image (e.g. a torchvision transform).
        bad_files: "raise" (default) raises :class:`BadImageError` naming the file when
            a sample is loaded; "skip" checks every file once, up front, leaves the
            unreadable ones out and warns with their count.
        return_names: return ``(image, label, file_name)`` instead.
    """

    def __init__(self, root: str | Path, transform: Callable | None = None,
                 bad_files: str = "raise", return_names: bool = False):
        if bad_files not in BAD_FILE_POLICIES:
            raise ValueError(f"bad_files must be one of {BAD_FILE_POLICIES}, got {bad_files!r}")
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"dataset folder {self.root} does not exist")
        self.classes = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        if not self.classes:
            raise FileNotFoundError(
                f"{self.root} has no class folders: expected {self.root}/<class>/<image>")
        self.class_to_idx = {name: index for index, name in enumerate(self.classes)}
        self.samples = [
            (path, self.class_to_idx[name])
            for name in self.classes
            for path in sorted((self.root / name).iterdir())
            if path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS
        ]
        self.transform = transform
        self.return_names = return_names
        self.skipped: list[tuple[Path, str]] = []
        if bad_files == "skip":
            self._leave_out_bad_files()

    def _leave_out_bad_files(self) -> None:
        readable = []
        for path, label in self.samples:
            try:
                load_rgb(path)
            except BadImageError as exc:
                self.skipped.append((path, str(exc)))
            else:
                readable.append((path, label))
        self.samples = readable
        if self.skipped:
            warnings.warn(
                f"skipped {len(self.skipped)} unreadable image(s) in {self.root} (first: "
                f"{self.skipped[0][0].relative_to(self.root)}); see dataset.skipped",
                stacklevel=3,
            )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        image = load_rgb(path)
        if self.transform is not None:
            image = self.transform(image)
        if self.return_names:
            return image, label, path.name
        return image, label
