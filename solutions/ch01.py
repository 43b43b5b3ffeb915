"""Chapter 01: reference solutions and plausible mistakes."""

import torch


def channel_stats(dataset):
    total = total_squares = count = 0
    for index in range(len(dataset)):
        image, _ = dataset[index]
        pixels = image.double().flatten(1)  # channels x pixels
        total = total + pixels.sum(1)
        total_squares = total_squares + (pixels * pixels).sum(1)
        count += pixels.shape[1]
    mean = total / count
    std = ((total_squares - count * mean * mean) / (count - 1)).sqrt()
    return mean, std


def keyed_augment(transform, image, seed, epoch, index):
    # fork_rng(devices=[]) restores the CPU generator only: seed that one alone
    # (torch.manual_seed would also reseed every GPU's generator, and leave it so)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(hash((seed, epoch, index)) % 2**63)  # one per key
        return transform(image)


# Plausible mistakes -------------------------------------------------------------------

def channel_stats_per_image(dataset):
    """Averages each image's mean and std: loses the spread between images, and weighs
    a small image as much as a large one."""
    means, stds = [], []
    for index in range(len(dataset)):
        image, _ = dataset[index]
        means.append(image.mean(dim=(1, 2)))
        stds.append(image.std(dim=(1, 2)))
    return torch.stack(means).mean(0), torch.stack(stds).mean(0)


def channel_stats_stacked(dataset):
    """Stacks the images first, as chapter 01 did with same-sized digits."""
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    return images.mean(dim=(0, 2, 3)), images.std(dim=(0, 2, 3))


def channel_stats_mean_of_image_means(dataset):
    """Exact std, but the mean averages the images' means: fine for equal sizes only."""
    mean, std = channel_stats(dataset)
    image_means = torch.stack([dataset[i][0].double().mean(dim=(1, 2))
                               for i in range(len(dataset))])
    return image_means.mean(0), std


def keyed_augment_summed_key(transform, image, seed, epoch, index):
    """seed + epoch + index: sample 1 of epoch 0 is augmented like sample 0 of epoch 1."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + epoch + index)
        return transform(image)


def keyed_augment_decimal_key(transform, image, seed, epoch, index):
    """seed * 100 + epoch * 10 + index: index 10 of epoch 0 meets index 0 of epoch 1."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed * 100 + epoch * 10 + index)
        return transform(image)


def keyed_augment_reseeding_global(transform, image, seed, epoch, index):
    """Right key, but it reseeds the global generator and leaves it that way."""
    torch.manual_seed(hash((seed, epoch, index)) % 2**63)
    return transform(image)


def keyed_augment_unseeded(transform, image, seed, epoch, index):
    """Draws from the global generator: depends on what was drawn before."""
    return transform(image)


def channel_stats_nan(dataset):
    """Divides by a count that stayed zero: nan for every channel."""
    channels = dataset[0][0].shape[0]
    return [float("nan")] * channels, [float("nan")] * channels


REFERENCE = {"01.1": channel_stats, "01.2": keyed_augment}
# exercise -> (wrong solution, the status it must get, a phrase its report must contain)
MISTAKES = {
    "01.1": [(channel_stats_per_image, "fail", "channel 0: expected mean"),
             (channel_stats_stacked, "error", "stack expects each tensor to be equal size"),
             (channel_stats_mean_of_image_means, "fail", "channel 0: expected mean"),
             (channel_stats_nan, "fail", "got mean nan and std nan (nan or inf")],
    "01.2": [(keyed_augment_summed_key, "fail", "(seed 0, epoch 0, index 1) and "
                                                "(seed 0, epoch 1, index 0) got the same"),
             (keyed_augment_decimal_key, "fail", "(seed 0, epoch 0, index 10) and "
                                                 "(seed 0, epoch 1, index 0) got the same"),
             (keyed_augment_reseeding_global, "fail", "global random state changed"),
             (keyed_augment_unseeded, "fail", "gave another image when asked again")],
}
