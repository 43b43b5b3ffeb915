"""Real data that ships with the workbook's dependencies, written to disk on first use.

* ``prepare_digits()``: the 1,797 handwritten digits that ship with scikit-learn (UCI
  "Optical Recognition of Handwritten Digits", CC BY 4.0), as an ImageFolder tree of
  32x32 RGB PNGs, ``digits/{train,test}/<class>/<index>.png``, split 80/20 per class.
* ``prepare_photos()``: the two photographs that ship with scikit-learn (CC BY 2.0),
  for augmentation demos.

Preparation is deterministic and idempotent: a tree whose manifest matches is left
alone; a missing, partial or damaged one is rebuilt in a temporary folder and moved
into place, so an interrupted build never leaves a half-written tree behind. Processes
that prepare the same tree at once (every rank of a first run calls ``prepare_digits``)
take turns through a lock file next to it: one builds, the others find the tree intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from PIL import Image

from ..runtime.paths import CLONE
from ..runtime.progress import progress_bar

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; ranks there are spawned, rarely at once
    fcntl = None

DATA_DIR_VAR = "MGPU_DATA_DIR"
MANIFEST = "manifest.json"
DIGITS_VERSION = 1
DIGITS_SIZE = 32
TEST_EVERY = 5  # every 5th image of each class goes to the test split


def data_dir() -> Path:
    """Where datasets live: ``$MGPU_DATA_DIR``, else the clone's ``data/`` folder."""
    configured = os.environ.get(DATA_DIR_VAR)
    if configured:
        return Path(configured)
    clone = CLONE / "data"
    if (clone / "README.md").exists():
        return clone
    return Path.home() / ".cache" / "mgpu_workbook"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree_is_intact(root: Path, version: int) -> bool:
    manifest = root / MANIFEST
    try:
        recorded = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return False
    if recorded.get("version") != version:
        return False
    files = recorded.get("files", {})
    return bool(files) and all(
        (root / name).is_file() and _sha256(root / name) == digest
        for name, digest in files.items()
    )


@contextmanager
def _exclusive(root: Path) -> Iterator[None]:
    """Hold ``.<name>.lock`` beside ``root`` (released on exit, also when the process dies)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "a") as handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _build(root: Path, version: int, fill: Callable[[Path], None]) -> Path:
    """Make ``root`` an intact tree of ``version``: if it is not one, ``fill`` an empty
    staging folder, record a manifest and move it into place, holding the lock so that
    concurrent callers build it once."""
    if _tree_is_intact(root, version):
        return root
    with _exclusive(root):
        if _tree_is_intact(root, version):  # another process built it while we waited
            return root
        staging = root.with_name(f"{root.name}.partial-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        fill(staging)
        files = {str(p.relative_to(staging)): _sha256(p)
                 for p in sorted(staging.rglob("*")) if p.is_file()}
        manifest = {"version": version, "files": files}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if root.exists():
            shutil.rmtree(root)
        os.replace(staging, root)
    return root


def digit_image(pixels: np.ndarray) -> Image.Image:
    """One 8x8 digit (values 0..16) as a 32x32 RGB image, white ink on black."""
    gray = Image.fromarray(np.round(pixels * (255 / 16)).astype(np.uint8), mode="L")
    return gray.resize((DIGITS_SIZE, DIGITS_SIZE), Image.Resampling.BILINEAR).convert("RGB")


def prepare_digits(root: Path | None = None, progress: bool = True) -> Path:
    """Write the digits ImageFolder tree if it is missing or damaged; return its path.

    Args:
        root: folder for the tree; default ``data_dir() / "digits"``.
        progress: show a progress bar while writing.
    """
    root = Path(root) if root is not None else data_dir() / "digits"

    def write_digits(staging: Path) -> None:
        # imported only to build the tree: scikit-learn takes about a second to import,
        # in every process (rank, script, kernel) that merely checks the tree
        from sklearn.datasets import load_digits

        digits = load_digits()
        seen_per_class: dict[int, int] = {}
        for index in progress_bar(range(len(digits.target)), desc="Writing digits",
                                  unit="img", disable=not progress):
            label = int(digits.target[index])
            position = seen_per_class.get(label, 0)
            seen_per_class[label] = position + 1
            split = "test" if position % TEST_EVERY == TEST_EVERY - 1 else "train"
            folder = staging / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            digit_image(digits.images[index]).save(folder / f"{index:04d}.png")

    return _build(root, DIGITS_VERSION, write_digits)


def prepare_photos(root: Path | None = None) -> Path:
    """Copy scikit-learn's two sample photographs (china.jpg, flower.jpg); return the folder."""
    def copy_photos(staging: Path) -> None:
        from sklearn.datasets import load_sample_images  # only to build the folder

        for source in load_sample_images().filenames:
            shutil.copyfile(source, staging / Path(source).name)

    return _build(Path(root) if root is not None else data_dir() / "photos", 1, copy_photos)


def load_cifar10(train: bool = True, download: bool = False, root: Path | None = None,
                 transform=None):
    """CIFAR-10 through torchvision, for readers who are online; never downloads silently.

    Args:
        train: the 50,000-image training split, else the 10,000-image test split.
        download: fetch the archive (about 170 MB) if it is not under ``root`` yet.
        root: folder for the archive; default ``data_dir() / "cifar10"``.
        transform: applied to each PIL image.

    Raises:
        FileNotFoundError: the data is not there and ``download`` is False.
        ConnectionError: the download failed (offline); the message points to the
            embedded digits, which every chapter can use instead.
    """
    from torchvision.datasets import CIFAR10

    root = Path(root) if root is not None else data_dir() / "cifar10"
    offline_hint = ("The workbook's embedded data needs no network: use "
                    "mgpu_helpers.data.prepare_digits() (32x32 RGB, 10 classes) instead.")
    try:
        return CIFAR10(str(root), train=train, download=download, transform=transform)
    except RuntimeError as exc:
        if download or "not found or corrupted" not in str(exc):
            raise
        raise FileNotFoundError(
            f"CIFAR-10 is not in {root}. Pass download=True to fetch it (about 170 MB, "
            f"needs internet access). {offline_hint}") from None
    except OSError as exc:  # URLError and socket errors are OSErrors
        raise ConnectionError(
            f"could not download CIFAR-10 into {root} ({type(exc).__name__}: {exc}); this "
            f"machine looks offline. {offline_hint}") from None
