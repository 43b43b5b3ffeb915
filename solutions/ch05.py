"""Chapter 05: reference solutions and plausible mistakes."""

import inspect
import linecache
import textwrap
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
    # the samples of every rank in this step: the big batch's mean divides by them
    device = micro_batches[0][1].device
    total = torch.tensor(float(sum(len(labels) for _, labels in micro_batches)), device=device)
    dist.all_reduce(total)
    world = dist.get_world_size()  # DDP divides the all-reduced gradients by it
    k = len(micro_batches)
    for i, (inputs, labels) in enumerate(micro_batches):
        with model.no_sync() if i < k - 1 else nullcontext():
            loss = F.cross_entropy(model(inputs), labels)
            (loss * (len(labels) * world / total)).backward()
    optimizer.step()


def global_batch_stats(x):
    """Chan et al.'s parallel variance: each rank's (count, mean, M2), gathered, combined;
    float32 throughout, as torch's SyncBatchNorm gathers means, inverse spreads and counts."""
    channels = x.shape[1]
    dims = [0, *range(2, x.dim())]
    count = x.numel() // channels
    if count:
        var, mean = torch.var_mean(x, dim=dims, unbiased=False)
    else:  # an empty batch: count 0, and nothing (not nan) to add
        var = mean = x.new_zeros(channels)
    mine = torch.cat([x.new_tensor([count]), mean, var * count])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    stats = torch.stack(gathered)
    counts, means, m2 = stats[:, :1], stats[:, 1:channels + 1], stats[:, channels + 1:]
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    m2 = m2.sum(0) + (counts * (means - mean) ** 2).sum(0)
    return mean, m2 / total


def main():
    """Exercise 05.4: a training script for torchrun that saves after every epoch and
    resumes from its checkpoint."""
    import argparse
    import os

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from mgpu_helpers.exercises.ch05 import tiny_dataset, tiny_model

    parser = argparse.ArgumentParser(description="Train the tiny model with DDP.")
    parser.add_argument("--epochs", type=int, required=True, help="train up to this epoch")
    parser.add_argument("--checkpoint", required=True, help="saved, and resumed from")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")

    dataset = tiny_dataset()
    sampler = DistributedSampler(dataset, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    model = DDP(tiny_model().to(device),
                device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    start = 0
    if os.path.exists(args.checkpoint):
        checkpoint = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start = checkpoint["epoch"]

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
        if dist.get_rank() == 0:
            state = {"model": model.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "epoch": epoch + 1}
            temporary = args.checkpoint + ".tmp"
            torch.save(state, temporary)
            os.replace(temporary, args.checkpoint)

    dist.destroy_process_group()


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


def fp16_hook_from_torch(state, bucket):
    """Hands the bucket to torch's own hook: right numbers, no hook written."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.fp16_compress_hook(state, bucket)


def accumulation_dividing_by_k(model, optimizer, micro_batches):
    """Section 5's step: each micro-batch's mean loss over k, exact for equal sizes only."""
    optimizer.zero_grad()
    k = len(micro_batches)
    for i, (inputs, labels) in enumerate(micro_batches):
        with model.no_sync() if i < k - 1 else nullcontext():
            (F.cross_entropy(model(inputs), labels) / k).backward()
    optimizer.step()


def accumulation_weighted_by_local_count(model, optimizer, micro_batches):
    """Weights by samples, but counts this rank's only: DDP's average of the ranks then
    weighs a rank of 16 samples as much as one of 19."""
    optimizer.zero_grad()
    k = len(micro_batches)
    local = sum(len(labels) for _, labels in micro_batches)
    for i, (inputs, labels) in enumerate(micro_batches):
        with model.no_sync() if i < k - 1 else nullcontext():
            (F.cross_entropy(model(inputs), labels) * len(labels) / local).backward()
    optimizer.step()


def accumulation_without_the_world_size(model, optimizer, micro_batches):
    """Divides by the global count, forgetting that DDP then divides by the world size."""
    optimizer.zero_grad()
    total = torch.tensor(float(sum(len(labels) for _, labels in micro_batches)))
    dist.all_reduce(total)
    k = len(micro_batches)
    for i, (inputs, labels) in enumerate(micro_batches):
        with model.no_sync() if i < k - 1 else nullcontext():
            F.cross_entropy(model(inputs), labels, reduction="sum").div(total).backward()
    optimizer.step()


def accumulation_synchronising_every_micro_batch(model, optimizer, micro_batches):
    """The right step, with k gradient all-reduces where one would do."""
    optimizer.zero_grad()
    total = torch.tensor(float(sum(len(labels) for _, labels in micro_batches)))
    dist.all_reduce(total)
    world = dist.get_world_size()
    for inputs, labels in micro_batches:
        loss = F.cross_entropy(model(inputs), labels, reduction="sum")
        (loss * world / total).backward()
    optimizer.step()


def accumulation_backward_inside_no_sync(model, optimizer, micro_batches):
    """The forward outside no_sync, the backward inside: DDP decided in the forward pass,
    and every backward all-reduces."""
    optimizer.zero_grad()
    total = torch.tensor(float(sum(len(labels) for _, labels in micro_batches)))
    dist.all_reduce(total)
    world = dist.get_world_size()
    k = len(micro_batches)
    for i, (inputs, labels) in enumerate(micro_batches):
        loss = F.cross_entropy(model(inputs), labels, reduction="sum") * world / total
        with model.no_sync() if i < k - 1 else nullcontext():
            loss.backward()
    optimizer.step()


def accumulation_never_synchronised(model, optimizer, micro_batches):
    """no_sync around every micro-batch, the last one too: the ranks never exchange."""
    optimizer.zero_grad()
    total = torch.tensor(float(sum(len(labels) for _, labels in micro_batches)))
    dist.all_reduce(total)
    world = dist.get_world_size()
    for inputs, labels in micro_batches:
        with model.no_sync():
            loss = F.cross_entropy(model(inputs), labels, reduction="sum")
            (loss * world / total).backward()
    optimizer.step()


def accumulation_in_one_batch(model, optimizer, micro_batches):
    """The micro-batches concatenated into one forward and one backward, weighted right:
    the same step, with none of the memory accumulation saves."""
    optimizer.zero_grad()
    inputs = torch.cat([inputs for inputs, _ in micro_batches])
    labels = torch.cat([labels for _, labels in micro_batches])
    total = torch.tensor(float(len(labels)))
    dist.all_reduce(total)
    loss = F.cross_entropy(model(inputs), labels, reduction="sum")
    (loss * dist.get_world_size() / total).backward()
    optimizer.step()


def batch_stats_in_float32_sums(x):
    """Section 7's CpuSyncBatchNorm: sums and sums of squares in float32. E[x²] − E[x]²
    cancels catastrophically when the mean is far larger than the spread."""
    channels = x.shape[1]
    dims = [0, *range(2, x.dim())]
    count = torch.tensor([x.numel() / channels], dtype=x.dtype)
    stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
    dist.all_reduce(stats)
    mean = stats[:channels] / stats[-1]
    return mean, stats[channels:2 * channels] / stats[-1] - mean * mean


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


def batch_stats_nan_on_an_empty_rank(x):
    """Chan's combination, with the empty rank's mean taken too: nan, and 0 x nan = nan."""
    channels = x.shape[1]
    var, mean = torch.var_mean(x, dim=(0, 2, 3), unbiased=False)
    count = x.numel() // channels
    mine = torch.cat([x.new_tensor([count]), mean, var * count])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    stats = torch.stack(gathered)
    counts, means, m2 = stats[:, :1], stats[:, 1:channels + 1], stats[:, channels + 1:]
    mean = (counts * means).sum(0) / counts.sum()
    return mean, (m2.sum(0) + (counts * (means - mean) ** 2).sum(0)) / counts.sum()


def batch_stats_returned_in_float64(x):
    """Sums in float64, right, and returns float64: batch norm's statistics are x's dtype."""
    channels = x.shape[1]
    x = x.double()
    stats = torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)),
                       torch.tensor([x.numel() / channels], dtype=torch.float64)])
    dist.all_reduce(stats)
    mean = stats[:channels] / stats[-1]
    return mean, stats[channels:2 * channels] / stats[-1] - mean * mean


def _main_with(name: str, *changes: tuple[str, str]):
    """``main`` with each ``(old, new)`` of ``changes`` made once: a script with one
    mistake. Its source is kept in linecache, as a notebook cell's is, so that the checker
    can read it with inspect.getsource."""
    source = textwrap.dedent(inspect.getsource(main))
    for old, new in changes:
        if source.count(old) != 1:
            raise ValueError(f"{name}: {old!r} is not in main exactly once")
        source = source.replace(old, new)
    filename = f"<solutions/ch05.py: {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict = {}
    exec(compile(source, filename, "exec"), namespace)  # our own source, changed
    function = namespace["main"]
    function.__qualname__ = name
    return function


main_without_set_epoch = _main_with(
    "main_without_set_epoch", ("        sampler.set_epoch(epoch)\n", ""))
main_that_never_resumes = _main_with(
    "main_that_never_resumes", ("    if os.path.exists(args.checkpoint):\n", "    if False:\n"))
main_resuming_without_the_optimizer = _main_with(
    "main_resuming_without_the_optimizer",
    ('        optimizer.load_state_dict(checkpoint["optimizer"])\n', ""))
main_resuming_at_epoch_0 = _main_with(
    "main_resuming_at_epoch_0", ('        start = checkpoint["epoch"]\n', ""))
main_saving_the_ddp_wrapper = _main_with(
    "main_saving_the_ddp_wrapper",
    ('state = {"model": model.module.state_dict(),', 'state = {"model": model.state_dict(),'),
    ('model.module.load_state_dict(checkpoint["model"])',
     'model.load_state_dict(checkpoint["model"])'))
main_saving_on_every_rank = _main_with(  # atomically, each rank with its own temporary file
    "main_saving_on_every_rank",
    ("        if dist.get_rank() == 0:\n", "        if True:\n"),
    ('temporary = args.checkpoint + ".tmp"',
     'temporary = f"{args.checkpoint}.{dist.get_rank()}.tmp"'))
main_saving_in_place = _main_with(
    "main_saving_in_place",
    ("            torch.save(state, temporary)\n"
     "            os.replace(temporary, args.checkpoint)\n",
     "            torch.save(state, args.checkpoint)\n"))
main_saving_once_at_the_end = _main_with(
    "main_saving_once_at_the_end",
    ("        if dist.get_rank() == 0:\n",
     "        if dist.get_rank() == 0 and epoch + 1 == args.epochs:\n"))
main_without_a_process_group = _main_with(
    "main_without_a_process_group",
    ('        dist.init_process_group("gloo")\n', ""))


def main_that_waits_forever():
    """Never ends: stopped at the checker's timeout, with every process."""
    import time

    while True:
        time.sleep(1)


# Other correct solutions --------------------------------------------------------------

def accumulation_step_summing(model, optimizer, micro_batches):
    """reduction="sum" over each micro-batch, divided by the global count over the world
    size (what DDP's average then multiplies back)."""
    optimizer.zero_grad()
    total = torch.tensor(sum(len(labels) for _, labels in micro_batches))  # int64 travels too
    dist.all_reduce(total)
    divisor = total.item() / dist.get_world_size()
    *early, last = micro_batches
    with model.no_sync():
        for inputs, labels in early:
            (F.cross_entropy(model(inputs), labels, reduction="sum") / divisor).backward()
    inputs, labels = last
    (F.cross_entropy(model(inputs), labels, reduction="sum") / divisor).backward()
    optimizer.step()


def batch_stats_in_float64(x):
    """Sums in float64 (as exercise 01.1 advises), the result converted back to float32."""
    channels = x.shape[1]
    wide = x.double()
    stats = torch.cat([wide.sum((0, 2, 3)), (wide * wide).sum((0, 2, 3)),
                       torch.tensor([wide.numel() / channels], dtype=torch.float64)])
    dist.all_reduce(stats)
    mean = stats[:channels] / stats[-1]
    var = stats[channels:2 * channels] / stats[-1] - mean * mean
    return mean.to(x.dtype), var.to(x.dtype)


def batch_stats_in_two_passes(x):
    """The global mean first (float32 sums and the count, one all-reduce), then the sum of
    squared deviations from it (a second): float32, no cancellation."""
    channels = x.shape[1]
    dims = [0, *range(2, x.dim())]
    first = torch.cat([x.sum(dims), x.new_tensor([x.numel() / channels])])
    dist.all_reduce(first)
    mean = first[:channels] / first[-1]
    squares = ((x - mean.view(1, -1, *[1] * (x.dim() - 2))) ** 2).sum(dims)
    dist.all_reduce(squares)
    return mean, squares / first[-1]


def main_loading_before_wrapping():
    """Loads the checkpoint into the plain model before DDP wraps it, saves through
    tempfile.NamedTemporaryFile in the checkpoint's folder, and takes options with
    defaults besides."""
    import argparse
    import os
    import tempfile

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from mgpu_helpers.exercises.ch05 import tiny_dataset, tiny_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--checkpoint", default="checkpoint.pt")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank = dist.get_rank()

    model = tiny_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    first_epoch = 0
    if os.path.isfile(args.checkpoint):
        saved = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        first_epoch = saved["epoch"]
    ddp = DDP(model, device_ids=[local_rank] if backend == "nccl" else None)

    dataset = tiny_dataset()
    sampler = DistributedSampler(dataset, seed=7)  # shuffle=True is the default
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    folder = os.path.dirname(os.path.abspath(args.checkpoint))
    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(ddp(x.to(device)), y.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if rank == 0:
            with tempfile.NamedTemporaryFile(dir=folder, suffix=".part", delete=False) as file:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch + 1}, file)
            os.replace(file.name, args.checkpoint)
    dist.destroy_process_group()


REFERENCE = {"05.1": fp16_average_hook, "05.2": accumulation_step,
             "05.3": global_batch_stats, "05.4": main}
# exercise -> other correct solutions, which must pass too
ALTERNATIVES = {"05.2": [accumulation_step_summing],
                "05.3": [batch_stats_in_float64, batch_stats_in_two_passes],
                "05.4": [main_loading_before_wrapping]}
# exercise -> (wrong solution, the status it must get, a phrase its report must contain)
MISTAKES = {
    "05.1": [(fp16_hook_without_division, "fail", "about 2 times those of DDP's default"),
             (fp16_hook_dividing_after_the_sum, "fail", "came back inf or nan"),
             (fp16_hook_that_never_compresses, "fail", "sent Float tensors"),
             (fp16_hook_from_torch, "fail", "calls torch's fp16_compress_hook")],
    "05.2": [(accumulation_dividing_by_k, "fail", "a micro-batch of 3 samples then weighs as "
              "much as one of 8"),
             (accumulation_weighted_by_local_count, "fail", "rank 0's 19 samples weigh as much in "
              "all as rank 1's 16"),
             (accumulation_without_the_world_size, "fail", "gradients 2 times too small"),
             (accumulation_synchronising_every_micro_batch, "fail",
              "DDP ran 9 gradient all-reduces in 3 steps, expected 3 (one per step): 9 of "
              "the 9 forward passes ran outside no_sync"),
             (accumulation_backward_inside_no_sync, "fail", "DDP ran 9 gradient all-reduces "
              "in 3 steps, expected 3 (one per step): 9 of the 9 forward passes ran outside"),
             (accumulation_never_synchronised, "fail", "every forward pass ran inside no_sync"),
             (accumulation_in_one_batch, "fail", "the model ran forward passes on batches of "
              "[19] samples (3 in all), expected one per micro-batch (9, of [3, 8])")],
    "05.3": [(batch_stats_in_float32_sums, "fail", "var per channel: expected ["),
             (batch_stats_averaging_the_ranks, "fail", "var per channel"),
             (batch_stats_of_this_rank, "fail", "mean per channel"),
             (batch_stats_nan_on_an_empty_rank, "fail", "one rank's batch is empty (b = 0)"),
             (batch_stats_returned_in_float64, "fail", "mean is float64, expected float32")],
    # one torchrun run takes about 7 s: the other mistakes of 05.4 are checked in
    # tests/exercises/test_scripts.py against the one case that shows each (SCRIPT_MISTAKES)
    "05.4": [(main_without_a_process_group, "fail", "Default process group has not been "
              "initialized")],
}
# 05.4's mistakes: (wrong script, the index of the case that shows it, a phrase its report
# must contain). tests/exercises/test_scripts.py runs case 0 (3 ranks, 2 epochs) on 2 ranks,
# and case 1's first run (2 ranks, 1 epoch: no checkpoint yet, so no resume, the code these
# mistakes change) as the reference's
SCRIPT_MISTAKES = [
    (main_without_set_epoch, 0, "same order: call sampler.set_epoch(epoch)"),
    (main_saving_on_every_rank, 0, "ranks 0 and 1 all wrote into the checkpoint's folder"),
    (main_saving_in_place, 0, "written straight into checkpoint.pt"),
    (main_that_never_resumes, 1, "run 2 of 2 (--epochs 3): "),
    (main_resuming_without_the_optimizer, 1, "loaded the model but not the optimizer's state"),
]
# run end to end only on request (seconds each under torchrun): their verdicts are tested
# on crafted results in tests/exercises/test_scripts.py, which the suite runs
MORE_SCRIPT_MISTAKES = [
    (main_saving_the_ddp_wrapper, 0, "model keys start with `module.` (module.0.weight)"),
    (main_saving_once_at_the_end, 0, "saved 1 time in 2 epochs"),
    (main_resuming_at_epoch_0, 1, "trained 3 more epochs from epoch 0"),
]
