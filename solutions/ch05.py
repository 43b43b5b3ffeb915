"""Chapter 05: reference solutions and plausible mistakes."""

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F


def fp16_average_hook(state, bucket):
    world = dist.get_world_size()
    buffer = bucket.buffer()
    compressed = buffer.to(torch.float16).div_(world)  # divide first: the sum cannot overflow
    work = dist.all_reduce(compressed, async_op=True)
    return work.get_future().then(lambda future: buffer.copy_(future.value()[0]))


def accumulation_step(model, optimizer, micro_batches):
    optimizer.zero_grad()
    k = len(micro_batches)
    for i, (inputs, labels) in enumerate(micro_batches):
        with model.no_sync() if i < k - 1 else nullcontext():
            (F.cross_entropy(model(inputs), labels) / k).backward()
    optimizer.step()


def global_batch_stats(x):
    channels = x.shape[1]
    dims = [0, *range(2, x.dim())]
    count = torch.tensor([x.numel() / channels], dtype=x.dtype)
    stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
    dist.all_reduce(stats)
    mean = stats[:channels] / stats[-1]
    return mean, stats[channels:2 * channels] / stats[-1] - mean * mean


# Plausible mistakes -------------------------------------------------------------------

def fp16_hook_without_division(state, bucket):
    """Sums the gradients instead of averaging them."""
    compressed = bucket.buffer().to(torch.float16)
    work = dist.all_reduce(compressed, async_op=True)
    return work.get_future().then(lambda future: future.value()[0].to(torch.float32))


def fp16_hook_dividing_after_the_sum(state, bucket):
    """Right on small gradients; the float16 sum overflows before the division."""
    world = dist.get_world_size()
    compressed = bucket.buffer().to(torch.float16)
    work = dist.all_reduce(compressed, async_op=True)
    return work.get_future().then(lambda future: future.value()[0].div_(world).float())


def fp16_hook_that_never_compresses(state, bucket):
    """Averages correctly, in float32: no bytes saved."""
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(
        lambda future: future.value()[0])


def accumulation_never_synchronised(model, optimizer, micro_batches):
    """no_sync around every micro-batch, the last one too: the ranks never exchange."""
    optimizer.zero_grad()
    for inputs, labels in micro_batches:
        with model.no_sync():
            (F.cross_entropy(model(inputs), labels) / len(micro_batches)).backward()
    optimizer.step()


def accumulation_without_dividing(model, optimizer, micro_batches):
    """Steps on the sum of the micro-batches' losses: k times the big batch's gradient."""
    optimizer.zero_grad()
    k = len(micro_batches)
    for i, (inputs, labels) in enumerate(micro_batches):
        with model.no_sync() if i < k - 1 else nullcontext():
            F.cross_entropy(model(inputs), labels).backward()
    optimizer.step()


def accumulation_synchronising_every_micro_batch(model, optimizer, micro_batches):
    """The right step, with k all-reduces where one would do."""
    optimizer.zero_grad()
    for inputs, labels in micro_batches:
        (F.cross_entropy(model(inputs), labels) / len(micro_batches)).backward()
    optimizer.step()


def batch_stats_averaging_the_ranks(x):
    """Averages each rank's mean and variance: wrong for the variance (the spread between
    the ranks' means is lost), and for the mean when the batches differ in size."""
    var, mean = torch.var_mean(x, dim=(0, 2, 3), unbiased=False)
    stats = torch.cat([mean, var])
    dist.all_reduce(stats)
    stats /= dist.get_world_size()
    return stats[:len(mean)], stats[len(mean):]


def batch_stats_of_this_rank(x):
    """No communication: each rank's own statistics, as plain BatchNorm uses."""
    var, mean = torch.var_mean(x, dim=(0, 2, 3), unbiased=False)
    return mean, var


def fp16_hook_from_torch(state, bucket):
    """Hands the bucket to torch's own hook: right numbers, no hook written."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.fp16_compress_hook(state, bucket)


def accumulation_in_one_batch(model, optimizer, micro_batches):
    """The micro-batches concatenated into one forward and one backward: the same step,
    with none of the memory accumulation saves."""
    optimizer.zero_grad()
    inputs = torch.cat([inputs for inputs, _ in micro_batches])
    labels = torch.cat([labels for _, labels in micro_batches])
    F.cross_entropy(model(inputs), labels).backward()
    optimizer.step()


# Other correct solutions --------------------------------------------------------------

def batch_stats_in_float64(x):
    """Sums in float64 (as exercise 01.1 advises) and returns float64 statistics."""
    channels = x.shape[1]
    x = x.double()
    stats = torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)),
                       torch.tensor([x.numel() / channels], dtype=torch.float64)])
    dist.all_reduce(stats)
    mean = stats[:channels] / stats[-1]
    return mean, stats[channels:2 * channels] / stats[-1] - mean * mean


REFERENCE = {"05.1": fp16_average_hook, "05.2": accumulation_step,
             "05.3": global_batch_stats}
# exercise -> other correct solutions, which must pass too
ALTERNATIVES = {"05.3": [batch_stats_in_float64]}
# exercise -> (wrong solution, the status it must get, a phrase its report must contain)
MISTAKES = {
    "05.1": [(fp16_hook_without_division, "fail", "about 2 times those of DDP's default"),
             (fp16_hook_dividing_after_the_sum, "fail", "came back inf or nan"),
             (fp16_hook_that_never_compresses, "fail", "sent Float tensors"),
             (fp16_hook_from_torch, "fail", "calls torch's fp16_compress_hook")],
    "05.2": [(accumulation_never_synchronised, "fail", "ran 0 gradient all-reduces"),
             (accumulation_without_dividing, "fail", "the weights differ from 3 big-batch steps"),
             (accumulation_synchronising_every_micro_batch, "fail",
              "ran 6 gradient all-reduces in 3 steps"),
             (accumulation_in_one_batch, "fail", "the model ran forward passes on batches of "
              "[8] samples (3 in all), expected one per micro-batch (6 of 4)")],
    "05.3": [(batch_stats_averaging_the_ranks, "fail", "var per channel"),
             (batch_stats_of_this_rank, "fail", "mean per channel")],
}
