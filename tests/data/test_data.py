"""Embedded data preparation, the image-folder dataset, collate functions, loader seeding."""

import json
import multiprocessing
import os
import pickle
import random
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.datasets import ImageFolder
from torchvision.transforms.functional import pil_to_tensor

from mgpu_helpers import launch
from mgpu_helpers.data import (
    BadImageError,
    ImageDataset,
    load_cifar10,
    loader_generator,
    names_collate,
    pad_collate,
    prepare_digits,
    prepare_photos,
    rank_seed,
    seed_worker,
)
from mgpu_helpers.data.image_folder import IMAGE_EXTENSIONS
from mgpu_helpers.labs.augmentation_seeds import RandomAngles


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return prepare_digits(tmp_path_factory.mktemp("data") / "digits", progress=False)


# ------------------------------------------------------------------ preparation


def test_digits_tree_is_a_stratified_split_of_all_1797(digits):
    counts = {split: Counter(p.parent.name for p in (digits / split).rglob("*.png"))
              for split in ("train", "test")}
    assert sum(counts["train"].values()) + sum(counts["test"].values()) == 1797
    assert sorted(counts["train"]) == sorted(counts["test"]) == [str(d) for d in range(10)]
    for label in counts["train"]:
        total = counts["train"][label] + counts["test"][label]
        assert counts["test"][label] == total // 5


def test_digit_images_are_32x32_rgb(digits):
    with Image.open(next((digits / "train" / "3").glob("*.png"))) as image:
        assert (image.size, image.mode) == ((32, 32), "RGB")


def test_preparation_is_deterministic_and_a_second_call_does_nothing(digits, tmp_path):
    again = prepare_digits(tmp_path / "digits", progress=False)
    assert (again / "manifest.json").read_text() == (digits / "manifest.json").read_text()
    stamp = (again / "manifest.json").stat().st_mtime_ns
    assert prepare_digits(again, progress=False) == again
    assert (again / "manifest.json").stat().st_mtime_ns == stamp


@pytest.mark.parametrize("damage", ["delete_file", "corrupt_file", "delete_manifest"])
def test_partial_or_damaged_tree_is_rebuilt(digits, tmp_path, damage):
    root = Path(shutil.copytree(digits, tmp_path / "digits"))  # an intact tree, copied
    victim = root / "train" / "0" / "0000.png"
    original = victim.read_bytes()
    if damage == "delete_file":
        victim.unlink()
    elif damage == "corrupt_file":
        victim.write_bytes(original[:40])
    else:
        (root / "manifest.json").unlink()
    prepare_digits(root, progress=False)
    assert victim.read_bytes() == original
    assert not list(tmp_path.glob("digits.partial-*")), "staging folder left behind"


def _prepare_and_count(root, start, results):
    start.wait()
    try:
        tree = prepare_digits(root, progress=False)
        results.put(len(list(tree.rglob("*.png"))))
    except Exception as error:  # reported to the test, which fails naming it
        results.put(repr(error))


def test_processes_preparing_at_once_take_turns(tmp_path):
    # Every rank of a first run prepares the digits: none may fail, or see a tree that
    # another process is deleting to replace.
    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(4), context.Queue()
    workers = [context.Process(target=_prepare_and_count,
                               args=(tmp_path / "digits", start, results)) for _ in range(4)]
    for worker in workers:
        worker.start()
    try:
        counts = [results.get(timeout=120) for _ in workers]
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():  # never leave a process behind, even on failure
                worker.kill()
    assert counts == [1797] * 4
    assert not list(tmp_path.glob("digits.partial-*")), "staging folder left behind"


def test_photos_are_copied_once(tmp_path):
    root = prepare_photos(tmp_path / "photos")
    assert sorted(p.name for p in root.iterdir()) == ["china.jpg", "flower.jpg", "manifest.json"]
    files = json.loads((root / "manifest.json").read_text())["files"]
    assert sorted(files) == ["china.jpg", "flower.jpg"]


# ---------------------------------------------------------------------- dataset


def test_dataset_matches_torchvision_imagefolder(digits):
    ours = ImageDataset(digits / "train")
    oracle = ImageFolder(digits / "train")
    assert ours.classes == oracle.classes
    assert [(str(p), label) for p, label in ours.samples] == oracle.samples
    for index in (0, 700, len(ours) - 1):
        image, label = ours[index]
        expected_image, expected_label = oracle[index]
        assert label == expected_label
        assert torch.equal(pil_to_tensor(image), pil_to_tensor(expected_image))


def test_image_extensions_are_imagefolders():
    from torchvision.datasets.folder import IMG_EXTENSIONS

    assert set(IMAGE_EXTENSIONS) == set(IMG_EXTENSIONS)


def test_dataset_ignores_non_images_and_returns_names(digits, tmp_path):
    root = tmp_path / "two"
    shutil.copytree(digits / "test" / "1", root / "1")
    (root / "1" / "notes.txt").write_text("not an image")
    dataset = ImageDataset(root, transform=pil_to_tensor, return_names=True)
    image, label, name = dataset[0]
    assert image.shape == (3, 32, 32) and label == 0 and name.endswith(".png")
    assert all(path.suffix == ".png" for path, _ in dataset.samples)


@pytest.fixture
def damaged(digits, tmp_path):
    root = tmp_path / "damaged"
    shutil.copytree(digits / "test" / "7", root / "7")
    good = sorted((root / "7").iterdir())[0].read_bytes()
    (root / "7" / "a_truncated.png").write_bytes(good[: len(good) // 2])
    (root / "7" / "b_empty.png").write_bytes(b"")
    (root / "7" / "c_not_an_image.png").write_text("hello, I am text")
    return root


@pytest.mark.parametrize(("name", "why"), [("a_truncated.png", "truncated"),
                                           ("b_empty.png", "the file is empty"),
                                           ("c_not_an_image.png", "cannot identify")])
def test_bad_file_raises_naming_it(damaged, name, why):
    dataset = ImageDataset(damaged)
    index = [path.name for path, _ in dataset.samples].index(name)
    with pytest.raises(BadImageError, match=f"cannot read image .*{name}: .*{why}"):
        dataset[index]


def test_skip_policy_leaves_bad_files_out_with_a_count(damaged):
    total = len(list((damaged / "7").iterdir()))
    with pytest.warns(UserWarning, match=r"skipped 3 unreadable image\(s\)"):
        dataset = ImageDataset(damaged, bad_files="skip")
    assert len(dataset) == total - 3
    assert sorted(path.name for path, _ in dataset.skipped) == [
        "a_truncated.png", "b_empty.png", "c_not_an_image.png"]
    assert all(dataset[i][0].size == (32, 32) for i in range(len(dataset)))


def test_dataset_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="bad_files must be one of"):
        ImageDataset(tmp_path, bad_files="ignore")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ImageDataset(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no class folders"):
        ImageDataset(tmp_path)


# ---------------------------------------------------------------------- collate


def test_names_collate_stacks_images_and_keeps_names():
    batch = [(torch.full((3, 4, 4), float(i)), i, f"{i}.png") for i in range(3)]
    images, labels, names = names_collate(batch)
    assert images.shape == (3, 3, 4, 4)
    assert labels.tolist() == [0, 1, 2]
    assert names == ("0.png", "1.png", "2.png")


def test_pad_collate_pads_and_masks():
    batch = [(torch.ones(3, 2, 5), 0), (torch.ones(3, 4, 3), 1)]
    images, mask, labels = pad_collate(batch)
    assert images.shape == (2, 3, 4, 5) and mask.shape == (2, 4, 5)
    assert mask.sum().item() == 2 * 5 + 4 * 3
    assert images.sum().item() == 3 * mask.sum().item()  # padding is zero
    assert labels.tolist() == [0, 1]
    assert not mask[0, 2:].any() and not mask[1, :, 3:].any()


def test_pad_collate_rejects_mixed_channels():
    with pytest.raises(ValueError, match="one channel count per batch"):
        pad_collate([(torch.ones(3, 2, 2), 0), (torch.ones(1, 2, 2), 1)])


# ---------------------------------------------------------------------- seeding


class NumpyDraws(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return np.random.randint(0, 2**31 - 1), random.randint(0, 2**31 - 1)


def draws(worker_init_fn, generator):
    loader = DataLoader(NumpyDraws(), batch_size=1, num_workers=2,
                        worker_init_fn=worker_init_fn, generator=generator,
                        multiprocessing_context="fork")
    return [tuple(int(x) for x in batch) for batch in loader]


def test_workers_draw_distinct_numpy_streams():
    # PyTorch >= 1.9 seeds NumPy and `random` in each worker (the classic bug of identical
    # worker streams is gone); seed_worker keeps that explicit and reproducible.
    for init in (None, seed_worker):
        values = draws(init, loader_generator(0))
        assert len(set(values)) == 4
        assert draws(init, loader_generator(0)) == values, "same seed, same draws"


def test_ranks_with_the_same_seed_repeat_each_others_augmentations():
    rank0, rank1 = (draws(seed_worker, torch.Generator().manual_seed(0)) for _ in range(2))
    assert rank0 == rank1, "the bug: every rank draws the same random stream"
    fixed0, fixed1 = (draws(seed_worker, loader_generator(0, rank=r)) for r in (0, 1))
    assert not set(fixed0) & set(fixed1), "the fix: a per-rank generator seed"


def test_loader_generator_is_reproducible_and_distinct_per_rank():
    def order(generator):
        return torch.randperm(20, generator=generator).tolist()

    assert order(loader_generator(5, rank=1)) == order(loader_generator(5, rank=1))
    assert order(loader_generator(5, rank=0)) != order(loader_generator(5, rank=1))
    with pytest.raises(ValueError, match="rank must be >= 0"):
        loader_generator(0, rank=-1)


def test_rank_seed_is_the_seed_on_rank_0_and_distinct_on_the_others():
    assert rank_seed(7, 0) == 7
    assert len({rank_seed(7, rank) for rank in range(64)}) == 64
    assert all(0 <= rank_seed(2**32 - 1, rank) < 2**32 for rank in range(4))  # seedable
    assert loader_generator(7, 3).initial_seed() == rank_seed(7, 3)
    with pytest.raises(ValueError, match="rank must be >= 0"):
        rank_seed(0, -1)


def angles_without_workers(rank: int, global_seed: int) -> list[float]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(global_seed)
        loader = DataLoader(RandomAngles(), batch_size=3, generator=loader_generator(0, rank))
        return [float(angle) for batch in loader for angle in batch]


def test_without_workers_ranks_need_their_own_global_seed():
    # num_workers=0: the loader's generator never reaches the augmentation
    assert angles_without_workers(0, global_seed=0) == angles_without_workers(1, global_seed=0)
    fixed0, fixed1 = (angles_without_workers(r, rank_seed(0, r)) for r in (0, 1))
    assert not set(fixed0) & set(fixed1) and len(set(fixed0)) == 6


@pytest.mark.slow  # spawns a DataLoader worker (a fresh interpreter)
def test_random_angles_are_global_draws_that_spawned_workers_can_unpickle():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        first = [RandomAngles()[i] for i in range(6)]
        torch.manual_seed(0)
        assert [RandomAngles()[i] for i in range(6)] == first
    assert all(-10 <= angle <= 10 for angle in first) and len(set(first)) == 6
    assert pickle.loads(pickle.dumps(RandomAngles(4))).length == 4
    # a spawned worker imports the class by name
    loader = DataLoader(RandomAngles(4), batch_size=2, num_workers=1,
                        multiprocessing_context="spawn")
    assert sum(len(batch) for batch in loader) == 4


def test_preparation_does_not_touch_the_clone_when_told_where(tmp_path, monkeypatch):
    monkeypatch.setenv("MGPU_DATA_DIR", str(tmp_path))
    from mgpu_helpers.data import data_dir

    assert data_dir() == tmp_path
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------- CIFAR-10


def test_cifar10_absent_without_download_points_to_embedded_data(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"Pass download=True .*prepare_digits\(\)"):
        load_cifar10(root=tmp_path)


def test_cifar10_offline_download_says_so(tmp_path, monkeypatch):
    import urllib.error

    import torchvision.datasets

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    # Never touch the network in tests: the download itself is what fails.
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "download", offline)
    with pytest.raises(ConnectionError, match=r"looks offline.*prepare_digits\(\)"):
        load_cifar10(root=tmp_path, download=True)


# ------------------------------------------------------------ DistributedSampler


def sampler_epochs(dataset_size, epochs):
    sampler = DistributedSampler(range(dataset_size), shuffle=True, seed=0)
    orders = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


@pytest.mark.usefixtures("no_leftover_processes")
@pytest.mark.parametrize("dataset_size", [10, 11])
def test_sampler_covers_every_index_once_per_epoch_and_reshuffles(dataset_size):
    per_rank = launch(sampler_epochs, dataset_size, 3, nprocs=2, return_all=True)
    epochs = [per_rank[0][e] + per_rank[1][e] for e in range(3)]
    padding = (-dataset_size) % 2
    for order in epochs:
        assert sorted(set(order)) == list(range(dataset_size))
        assert len(order) == dataset_size + padding
    assert epochs[0] != epochs[1] != epochs[2]
