"""Chapter 02: reference solutions and plausible mistakes."""

import math

import torch
import torch.distributed as dist


def padded_order(n, world_size, epoch, seed, shuffle, drop_last):
    """The order every rank computes, made to divide evenly by world_size."""
    if shuffle:
        generator = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(n, generator=generator).tolist()
    else:
        order = list(range(n))
    if drop_last:
        return order[:n // world_size * world_size]
    total = math.ceil(n / world_size) * world_size
    while len(order) < total:  # the padding may be longer than the dataset
        order += order[:total - len(order)]
    return order


def sampler_indices(n, world_size, rank, epoch, seed, shuffle, drop_last):
    return padded_order(n, world_size, epoch, seed, shuffle, drop_last)[rank::world_size]


def collate_sequences(samples):
    sequences, labels = zip(*samples, strict=True)
    lengths = torch.tensor([len(s) for s in sequences])
    padded = sequences[0].new_zeros(len(sequences), int(lengths.max()), *sequences[0].shape[1:])
    for row, sequence in enumerate(sequences):
        padded[row, :len(sequence)] = sequence
    return padded, lengths, torch.tensor(labels)


def exact_accuracy(correct_shard, dataset_size):
    rank, world = dist.get_rank(), dist.get_world_size()
    positions = rank + world * torch.arange(len(correct_shard))
    real = positions < dataset_size  # past the dataset's length: padded duplicates
    totals = torch.stack([correct_shard[real].sum(), real.sum().to(correct_shard.dtype)])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


# Plausible mistakes -------------------------------------------------------------------

def sampler_indices_contiguous(n, world_size, rank, epoch, seed, shuffle, drop_last):
    """Gives each rank a contiguous block of the order instead of every world_size-th."""
    order = padded_order(n, world_size, epoch, seed, shuffle, drop_last)
    per_rank = len(order) // world_size
    return order[rank * per_rank:(rank + 1) * per_rank]


def sampler_indices_without_padding(n, world_size, rank, epoch, seed, shuffle, drop_last):
    """Strides over the order without padding it: the last ranks get fewer samples."""
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        order = order.tolist()
    else:
        order = list(range(n))
    return order[rank::world_size]


def sampler_indices_same_every_epoch(n, world_size, rank, epoch, seed, shuffle, drop_last):
    """Shuffles from the seed alone: set_epoch changes nothing."""
    return sampler_indices(n, world_size, rank, 0, seed, shuffle, drop_last)


def sampler_indices_padding_once(n, world_size, rank, epoch, seed, shuffle, drop_last):
    """Pads with one slice of the order: too short when there are more ranks than samples."""
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        order = order.tolist()
    else:
        order = list(range(n))
    if drop_last:
        order = order[:n // world_size * world_size]
    else:
        order += order[:math.ceil(n / world_size) * world_size - n]
    return order[rank::world_size]


def collate_sequences_time_major(samples):
    """pad_sequence's default layout, (length, batch): not what a batch-first model takes."""
    sequences, labels = zip(*samples, strict=True)
    return (torch.nn.utils.rnn.pad_sequence(list(sequences)),
            torch.tensor([len(s) for s in sequences]), torch.tensor(labels))


def collate_sequences_lengths_after_padding(samples):
    """Measures the lengths after padding: every sequence seems as long as the longest."""
    sequences, labels = zip(*samples, strict=True)
    padded = torch.nn.utils.rnn.pad_sequence(list(sequences), batch_first=True)
    return padded, torch.tensor([len(row) for row in padded]), torch.tensor(labels)


def collate_sequences_float_zeros(samples):
    """Pads into torch.zeros' default dtype: token ids turn into floats."""
    sequences, labels = zip(*samples, strict=True)
    longest = max(len(s) for s in sequences)
    padded = torch.zeros(len(sequences), longest, *sequences[0].shape[1:])
    for row, sequence in enumerate(sequences):
        padded[row, :len(sequence)] = sequence
    return padded, torch.tensor([len(s) for s in sequences]), torch.tensor(labels)


def exact_accuracy_counting_padding(correct_shard, dataset_size):
    """Sums every entry of the shards: the padded duplicates count twice."""
    totals = torch.stack([correct_shard.sum(), torch.tensor(float(len(correct_shard)))])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def exact_accuracy_mean_of_means(correct_shard, dataset_size):
    """Drops the duplicates, then averages the ranks' accuracies: uneven shards weigh wrong."""
    rank, world = dist.get_rank(), dist.get_world_size()
    positions = rank + world * torch.arange(len(correct_shard))
    mean = correct_shard[positions < dataset_size].mean().reshape(1)
    dist.all_reduce(mean)
    return (mean / world).item()


def exact_accuracy_nan(correct_shard, dataset_size):
    """All-reduces counts it never filled in, then divides: 0 / 0 is nan."""
    totals = torch.zeros(2)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def exact_accuracy_numpy(correct_shard, dataset_size):
    """Right, returned as a NumPy float32: a number like any other (an alternative that
    must pass)."""
    import numpy as np

    return np.float32(exact_accuracy(correct_shard, dataset_size))


REFERENCE = {"02.1": sampler_indices, "02.2": collate_sequences, "02.3": exact_accuracy}
# exercise -> other correct solutions, which must pass too
ALTERNATIVES = {"02.3": [exact_accuracy_numpy]}
# exercise -> (wrong solution, the status it must get, a phrase its report must contain)
MISTAKES = {
    "02.1": [(sampler_indices_contiguous, "fail", "rank 0: expected [0, 4, 8], got [0, 1, 2]"),
             (sampler_indices_without_padding, "fail", "rank 2: expected 3 indices, got 2"),
             (sampler_indices_same_every_epoch, "fail", "epoch 1, rank 0"),
             (sampler_indices_padding_once, "fail", "got []")],
    "02.2": [(collate_sequences_time_major, "fail", "expected shape (4, 9), dtype int64, got "
                                                    "shape (9, 4)"),
             (collate_sequences_lengths_after_padding, "fail", "lengths: expected [5, 9, 7, 6]"),
             (collate_sequences_float_zeros, "fail", "got shape (4, 9), dtype float32")],
    "02.3": [(exact_accuracy_counting_padding, "fail", "of 11 samples correct), got"),
             (exact_accuracy_mean_of_means, "fail", "of 10 samples correct), got"),
             (exact_accuracy_nan, "fail", "got nan (not a finite number)")],
}
