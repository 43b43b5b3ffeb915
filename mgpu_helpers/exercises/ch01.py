"""Chapter 01's exercises: normalisation constants computed from a dataset, and an
augmentation whose randomness depends on the sample alone. Both run in this process:
the statistics are checked against a direct computation over every pixel, of images
drawn afresh on every check (statistics copied from an earlier check fail), the
augmentation by asking for each sample twice, in other orders and from other random
states."""

from __future__ import annotations

import random

import torch
from torchvision.transforms import v2

from .core import Case, Exercise, beyond, calls_during

# ---------------------------------------------------------------- 01.1 channel stats


class _Images(torch.utils.data.Dataset):
    """(image, label) samples: float images (C x H x W) in [0, 1], each with its own
    brightness, as photos have, drawn from ``seed``."""

    def __init__(self, sizes: tuple, channels: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        base = torch.linspace(0.3, 0.6, channels).reshape(channels, 1, 1)
        # one brightness in each n-th of [-0.25, 0.25], the larger images the brighter: a
        # mean that weighs every image alike is visibly off whenever the sizes differ
        n = len(sizes)
        by_size = sorted(range(n), key=lambda k: sizes[k][0] * sizes[k][1])
        brightness = torch.empty(n)
        brightness[by_size] = 0.5 * (torch.arange(n) + torch.rand(n, generator=generator)) / n
        brightness -= 0.25
        self.samples = []
        for index, (height, width) in enumerate(sizes):
            noise = 0.15 * torch.randn(channels, height, width, generator=generator)
            self.samples.append(((base + brightness[index] + noise).clamp(0, 1), index % 10))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def _as_vector(values, channels: int) -> torch.Tensor | str:
    try:
        vector = torch.as_tensor(values, dtype=torch.float64).flatten()
    except (TypeError, ValueError, RuntimeError):
        return f"expected {channels} numbers, got {type(values).__name__}"
    if vector.numel() != channels:
        return f"expected {channels} number(s), one per channel, got {vector.numel()}"
    return vector


def _stats_trial(fn, sizes: tuple, channels: int):
    dataset = _Images(sizes, channels, random.SystemRandom().getrandbits(63))
    result = fn(dataset)
    # every pixel of every image, per channel: images of any size weigh by their pixels
    pixels = torch.cat([image.reshape(channels, -1) for image, _ in dataset.samples], dim=1)
    expected = pixels.double().mean(dim=1), pixels.double().std(dim=1)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return f"expected a pair (mean, std), got {type(result).__name__}", expected
    return tuple(_as_vector(values, channels) for values in result), expected


def _judge_stats(got, expected) -> str | None:
    if isinstance(got, str):
        return got
    for name, have in zip(("mean", "std"), got, strict=True):
        if isinstance(have, str):
            return f"{name}: {have}"
    (mean, std), (want_mean, want_std) = got, expected
    for channel in range(len(want_mean)):
        # 1e-3 relative: torch.std's n - 1 and the population's n agree to that here
        if (beyond(abs(mean[channel] - want_mean[channel]), 1e-3 * want_mean[channel])
                or beyond(abs(std[channel] - want_std[channel]), 1e-3 * want_std[channel])):
            finite = bool(torch.isfinite(mean[channel]) and torch.isfinite(std[channel]))
            return (f"channel {channel}: expected mean {want_mean[channel]:.4f} and std "
                    f"{want_std[channel]:.4f}, got mean {mean[channel]:.4f} and std "
                    f"{std[channel]:.4f}"
                    + ("" if finite else " (nan or inf: a division by zero, or a sum that "
                                         "was never filled?)"))
    return None


# ---------------------------------------------------------------- 01.2 keyed augmentation

def _augmentation() -> v2.Transform:
    # chapter 01's label-preserving augmentation for digits
    return v2.Compose([v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1)),
                       v2.ColorJitter(brightness=0.3, contrast=0.3)])


def _key(key: tuple) -> str:
    return "(seed {}, epoch {}, index {})".format(*key)


def _global_seeders() -> dict:
    """torch's functions that seed the global generators, GPUs' included (torch.manual_seed
    is torch.random.manual_seed): recognised by their code, whatever name calls them."""
    import torch.cuda.random as cuda_random

    found = {torch.random.manual_seed: "torch.manual_seed", torch.random.seed: "torch.seed"}
    for name in ("manual_seed", "manual_seed_all", "seed", "seed_all"):
        found[getattr(cuda_random, name)] = f"torch.cuda.{name}"
    return found


def _fresh_global_state(draw: random.Random) -> torch.Tensor:
    """Puts torch's CPU generator in a state no function can know in advance (a seed
    drawn afresh, then some numbers drawn from it); returns that state."""
    torch.default_generator.manual_seed(draw.getrandbits(63))
    torch.rand(draw.randrange(1, 100))
    return torch.get_rng_state()


def _keyed_trial(fn, seeds: tuple, epochs: tuple, indices: tuple):
    keys = [(s, e, i) for s in seeds for e in epochs for i in indices]
    image = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(1))
    transform = _augmentation()
    draw = random.SystemRandom()
    # the notebook's own random state is kept; torch.manual_seed would also reseed (or
    # queue a seed for) every GPU's generator, which fork_rng(devices=[]) does not restore
    with torch.random.fork_rng(devices=[]):
        def both_passes():
            kept = True
            before = _fresh_global_state(draw)
            first = {key: fn(transform, image.clone(), *key) for key in keys}
            kept = kept and torch.equal(torch.get_rng_state(), before)
            before = _fresh_global_state(draw)  # another global state, another order
            order = torch.randperm(len(keys),
                                   generator=torch.Generator().manual_seed(2)).tolist()
            second = {keys[k]: fn(transform, image.clone(), *keys[k]) for k in order}
            kept = kept and torch.equal(torch.get_rng_state(), before)
            return first, second, kept

        (first, second, state_kept), seeders = calls_during(_global_seeders(), both_passes)
    got = {"shape": None, "unrepeatable": None, "collision": None, "state_kept": state_kept,
           "seeders": seeders}
    for key in keys:
        for output in (first[key], second[key]):
            if not isinstance(output, torch.Tensor):
                got["shape"] = ("expected the augmented image, a tensor, got "
                                f"{type(output).__name__}")
                return got, keys
            if output.shape != image.shape:
                got["shape"] = (f"expected the augmented image, of shape {tuple(image.shape)},"
                                f" got shape {tuple(output.shape)}")
                return got, keys
    got["unrepeatable"] = next((key for key in keys if not torch.equal(first[key], second[key])),
                               None)
    seen: dict[bytes, tuple] = {}
    for key in keys:
        fingerprint = first[key].contiguous().numpy().tobytes()
        if fingerprint in seen:
            got["collision"] = (seen[fingerprint], key)
            break
        seen[fingerprint] = key
    return got, keys


def _judge_keyed(got: dict, keys: list) -> str | None:
    if got["shape"]:
        return got["shape"]
    if got["unrepeatable"]:
        return (f"{_key(got['unrepeatable'])} gave another image when asked again (in "
                "another order, from another global random state): its randomness must "
                "come from the key alone")
    if got["collision"]:
        first, second = got["collision"]
        return (f"{_key(first)} and {_key(second)} got the same augmentation: different "
                "keys must draw different random numbers")
    if not got["state_kept"]:
        return ("torch's global random state changed: leave it as it was (the training "
                "loop draws its own random numbers from it)")
    if got["seeders"]:
        return (f"your function calls {got['seeders'][0]}, which seeds every GPU's generator "
                "too, and fork_rng(devices=[]) does not put those back: seed the CPU "
                "generator alone")
    return None


EXERCISES = [
    Exercise(
        key="01.1", difficulty=1, minutes=15,
        title="normalisation constants from a dataset", function="channel_stats",
        cases=[Case("8 RGB images of 16 x 16", (((16, 16),) * 8, 3)),
               Case("10 RGB images of different sizes",
                    (((8, 8), (40, 24), (16, 32), (12, 12), (32, 32), (8, 24), (20, 20),
                      (10, 30), (24, 16), (28, 8)), 3)),
               Case("6 one-channel images of 20 x 20", (((20, 20),) * 6, 1))],
        trial=_stats_trial, judge=_judge_stats,
        hint="the statistics of all pixels of a channel taken together, whatever image they "
             "come from: images of different sizes count by their pixels, and the spread "
             "between images' brightness belongs in the std",
    ),
    Exercise(
        key="01.2", difficulty=2, minutes=25,
        title="an augmentation that depends on the sample alone",
        function="keyed_augment",
        cases=[Case("seed 0, epochs 0 and 1, indices 0 to 3", ((0,), (0, 1), (0, 1, 2, 3))),
               Case("seeds 0 and 1, epoch 0, indices 0 and 1", ((0, 1), (0,), (0, 1))),
               Case("seed 42, epochs 0 to 2, indices 0 to 9, asked in another order",
                    ((42,), (0, 1, 2), tuple(range(10)))),
               Case("seeds 0 and 1, epochs 0, 1 and 10, indices up to 1,442",
                    ((0, 1), (0, 1, 10), (0, 1, 10, 100, 1000, 1442)))],
        trial=_keyed_trial, judge=_judge_keyed,
        hint="every key needs a seed of its own (which keys would seed + epoch + index, or "
             "seed * 100 + epoch * 10 + index, confuse?); seed only the CPU generator "
             "(torch.manual_seed seeds the GPUs' too), inside a block that puts its state "
             "back afterwards",
    ),
]
