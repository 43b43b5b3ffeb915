"""Chapter 05's look inside DDP (its appendix): the backward timeline, uneven inputs, clipping.

* :func:`backward_timeline`: inside a rank, when each gradient became ready and when each
  bucket's all-reduce started and finished, step by step (a communication hook times
  them); :func:`plot_timeline` draws one step.
* :func:`uneven_steps`: ranks that run different numbers of steps, with or without
  ``torch.distributed.algorithms.Join``; :func:`uneven_reference` is what one process
  computes for the same batches; :func:`counted_all_reduces` counts the small
  all-reduces Join adds to each forward pass.
* :func:`amp_clipped_step` and :func:`accumulate_and_clip`: gradient clipping under DDP,
  with a float16 ``GradScaler`` and with ``no_sync`` accumulation, right and wrong, on
  :func:`small_cnn` and :func:`clipping_data` (which chapter 05's own step also uses).
* :func:`changed_after_wrapping`: what ``DDP(model)`` does not cover: a parameter added
  after wrapping, and one re-initialised in place after wrapping.

Every function that runs inside ranks also runs in one plain process (world size 1,
no DDP), which is how the chapter computes its references.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..models import SeedCNN
from ..runtime.ranks import device, rank, world_size
from .native_stderr import native_stderr_silenced


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def _wrap(module: nn.Module, **ddp_options) -> nn.Module:
    """DDP inside a process group (with the device id on a GPU), the module itself
    outside one."""
    if not _in_group():
        return module
    here = next(module.parameters()).device
    ids = [here.index] if here.type == "cuda" else None
    return DDP(module, device_ids=ids, **ddp_options)


# ------------------------------------------------------------------ backward timeline


def backward_timeline(steps: int = 4, batch_size: int = 32,
                      bucket_cap_mb: float | None = None, exchange: bool = True,
                      find_unused_parameters: bool = False) -> list[dict]:
    """Inside a rank: ``steps`` training steps of the tutorial CNN under DDP, each timed from
    the call of ``loss.backward()`` (time 0) to its return.

    Returns one record per step: ``backward_s`` (when ``backward()`` returned: DDP waits
    there for the last all-reduce), ``ready`` (parameter name -> seconds when its
    gradient was accumulated) and ``buckets`` (in the order the hook was called: index,
    parameter names, bytes, ``start`` and ``end`` of its all-reduce). The hook is DDP's
    default (divide by the world size, all-reduce), with a clock around it. On a GPU the
    end is when the all-reduce's future completed, which for NCCL is not the kernel's
    end: the chapter measures on CPU ranks. ``exchange=False`` skips the all-reduce
    (each rank keeps its own gradients): the backward pass without communication.
    ``find_unused_parameters=True`` passes that option to DDP (which then keeps the
    buckets it starts with); PyTorch's C++ warning that no parameter went unused, printed
    to stderr with a timestamp, is dropped (any other line written meanwhile is kept).
    """
    here = device()
    torch.manual_seed(0)
    module = SeedCNN().to(here)
    names = {id(p): name for name, p in module.named_parameters()}
    clock = time.perf_counter
    ready: dict[str, float] = {}
    buckets: list[dict] = []
    for name, parameter in module.named_parameters():  # registered before DDP's hooks
        parameter.register_post_accumulate_grad_hook(
            lambda _, name=name: ready.__setitem__(name, clock()))
    model = _wrap(module, bucket_cap_mb=bucket_cap_mb,
                  find_unused_parameters=find_unused_parameters)

    def timed_allreduce(_, bucket):
        buffer = bucket.buffer()
        entry = {"index": bucket.index(),
                 "parameters": [names[id(p)] for p in bucket.parameters()],
                 "bytes": buffer.numel() * buffer.element_size(), "start": clock()}
        buckets.append(entry)
        if not exchange:
            entry["end"] = entry["start"]
            skipped = torch.futures.Future()
            skipped.set_result(buffer)
            return skipped
        work = dist.all_reduce(buffer.div_(dist.get_world_size()), async_op=True)

        def finished(future):
            entry["end"] = clock()
            return future.value()[0]

        return work.get_future().then(finished)

    if isinstance(model, DDP):
        model.register_comm_hook(None, timed_allreduce)
    generator = torch.Generator().manual_seed(rank())
    images = torch.randn(batch_size, 3, 32, 32, generator=generator).to(here)
    labels = torch.randint(0, 10, (batch_size,), generator=generator).to(here)
    records = []
    unused_warning = "find_unused_parameters=True was specified"  # timestamped, once
    with (native_stderr_silenced(keep_lines_without=unused_warning) if find_unused_parameters
          else nullcontext()):
        for _ in range(steps):
            ready.clear()
            buckets.clear()
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(images), labels)
            start = clock()
            loss.backward()
            returned = clock()
            records.append({
                "backward_s": returned - start,
                "ready": {name: t - start for name, t in ready.items()},
                "buckets": [{**b, "start": b["start"] - start, "end": b["end"] - start}
                            for b in buckets],
            })
    return records


def plot_timeline(record: dict, predicted_s: list[float] | None = None, ax=None):
    """One step of :func:`backward_timeline`: a dot per parameter when its gradient was
    ready, a bar per bucket from the hook's call to its all-reduce's end (and, if given,
    the predicted duration as an outline), and the line where ``backward()`` returned."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3))
    ms = 1e3
    names = sorted(record["ready"], key=record["ready"].get)
    rows = {name: len(record["buckets"]) + k for k, name in enumerate(names)}
    ax.scatter([record["ready"][n] * ms for n in names], [rows[n] for n in names],
               color="C0", zorder=3, label="gradient ready")
    for row, bucket in enumerate(record["buckets"]):
        width = (bucket["end"] - bucket["start"]) * ms
        ax.barh(row, width, left=bucket["start"] * ms, height=0.6, color="C1",
                label="all-reduce (measured)" if row == 0 else None)
        if predicted_s is not None:
            ax.barh(row, predicted_s[row] * ms, left=bucket["start"] * ms, height=0.6,
                    fill=False, edgecolor="k", linestyle="--",
                    label="cost model's prediction" if row == 0 else None)
    ax.axvline(record["backward_s"] * ms, color="C3", label="backward() returns")
    labels = [f"bucket {b['index']}: {b['bytes'] / 1e6:.2f} MB" for b in record["buckets"]]
    ax.set_yticks(range(len(labels) + len(names)), labels + names)
    ax.invert_yaxis()
    ax.set(xlabel="ms since loss.backward() was called",
           title="DDP backward: gradients become ready, buckets are all-reduced")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(alpha=0.3, axis="x")
    ax.figure.tight_layout()
    return ax


# ------------------------------------------------------------------ uneven inputs


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def uneven_batch(rank_index: int, step: int, size: int = 4) -> tuple:
    """The deterministic batch that rank ``rank_index`` trains on in ``step``."""
    generator = torch.Generator().manual_seed(1000 * rank_index + step)
    return (torch.randn(size, 8, generator=generator),
            torch.randint(0, 4, (size,), generator=generator))


@contextmanager
def counted_all_reduces(sizes: list):
    """Within the block, every ``torch.distributed.all_reduce`` call made in this process
    (by DDP's and Join's Python code too) appends its tensor's number of elements to
    ``sizes``. DDP's bucket all-reduces are issued from C++ and are not counted."""
    real_all_reduce = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield sizes
    finally:
        dist.all_reduce = real_all_reduce


def uneven_steps(steps_per_rank: list[int], use_join: bool, lr: float = 0.1) -> dict:
    """Inside a rank: SGD steps of a small model under DDP, rank r running
    ``steps_per_rank[r]`` steps (as when ranks get different numbers of batches), then a
    ``dist.barrier()`` (as before saving a checkpoint). Without Join, a rank that runs
    out of batches waits in the barrier while another waits in its all-reduce: on gloo,
    neither returns until the group's timeout (with NCCL the barrier, itself an
    all-reduce, may pair with the bucket's). With ``Join([model])`` a finished rank takes part
    in the others' all-reduces with zero gradients, and the replicas end equal.
    ``forward_all_reduces`` lists, per forward pass, the sizes of the all-reduces it
    sent (Join's, none without it)."""
    from torch.distributed.algorithms import Join

    model = _wrap(_tiny_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    forward_all_reduces = []
    with Join([model]) if use_join else nullcontext():
        for step in range(steps_per_rank[rank()]):
            images, labels = uneven_batch(rank(), step)
            optimizer.zero_grad()
            with counted_all_reduces([]) as sizes:
                output = model(images)
            forward_all_reduces.append(sizes)
            F.cross_entropy(output, labels).backward()
            optimizer.step()
    dist.barrier()
    return {"rank": rank(), "weights": torch.cat([p.detach().flatten()
                                                  for p in model.parameters()]),
            "forward_all_reduces": forward_all_reduces}


def uneven_reference(steps_per_rank: list[int], lr: float = 0.1) -> torch.Tensor:
    """In one process: what DDP with Join computes for :func:`uneven_steps`. In each step
    the gradient is the sum of the gradients of the ranks still training, divided by
    the initial number of ranks (Join's default, ``divide_by_initial_world_size``)."""
    model = _tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    ranks = len(steps_per_rank)
    for step in range(max(steps_per_rank)):
        optimizer.zero_grad()
        for r in range(ranks):
            if step < steps_per_rank[r]:
                images, labels = uneven_batch(r, step)
                (F.cross_entropy(model(images), labels) / ranks).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# ------------------------------------------------------------------ gradient clipping


def clipping_data(samples: int = 32, seed: int = 0) -> tuple:
    """A fixed batch of images and labels, the same in every process."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(samples, 3, 32, 32, generator=generator),
            torch.randint(0, 10, (samples,), generator=generator))


def _my_share(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.chunk(world_size())[rank()]


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().cpu() for p in model.parameters()])


def small_cnn() -> nn.Module:
    """The small network the clipping checks train (seeded: the same weights every call)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                         nn.Flatten(), nn.Linear(128, 10))


def amp_clipped_step(unscale_first: bool, max_norm: float = 0.1, lr: float = 0.5,
                     init_scale: float = 2.0 ** 10) -> dict:
    """Inside a rank (or one process): one SGD step on this rank's share of
    :func:`clipping_data` under float16 autocast with a ``GradScaler``, clipping the
    gradients' total norm to ``max_norm``.

    The right order is ``scaler.scale(loss).backward()``, ``scaler.unscale_(optimizer)``,
    ``clip_grad_norm_``, ``scaler.step``, ``scaler.update``. With
    ``unscale_first=False`` the clip sees the gradients still multiplied by the scale.
    Returns the norm the clip saw, the gradients' true norm (after the all-reduce, in
    real units), the size of the weight update and the new weights.
    """
    here = device()
    model = _wrap(small_cnn().to(here))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(here.type, init_scale=init_scale)
    images, labels = (_my_share(t).to(here) for t in clipping_data())
    before = _flat(model)
    with torch.autocast(here.type, dtype=torch.float16):
        loss = F.cross_entropy(model(images), labels)
    scaler.scale(loss).backward()  # DDP all-reduces the scaled gradients here
    true_norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in model.parameters()])
    ).item() / scaler.get_scale()
    if unscale_first:
        scaler.unscale_(optimizer)
    seen = nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    scaler.step(optimizer)  # unscales first if unscale_ was not called
    scaler.update()
    after = _flat(model)
    return {"seen_norm": seen, "true_norm": true_norm, "scale": init_scale,
            "update_norm": torch.linalg.vector_norm(after - before).item(),
            "weights": after}


def accumulate_and_clip(micro_batches: int, clip_each_micro_batch: bool = False,
                        max_norm: float = 0.1, lr: float = 0.5) -> dict:
    """Inside a rank (or one process): one SGD step over this rank's share of
    :func:`clipping_data`, accumulated over ``micro_batches`` (all but the last inside
    ``no_sync``), with the total gradient norm clipped to ``max_norm``.

    Right: clip once, after the last backward, when the gradients are summed over the
    micro-batches and averaged over the ranks. Wrong (``clip_each_micro_batch``): clip
    after every backward, which inside ``no_sync`` clips one rank's partial sum.
    Returns the norm before the (final) clip and the new weights.
    """
    model = _wrap(small_cnn())
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    images, labels = (_my_share(t) for t in clipping_data())
    pieces = list(zip(images.chunk(micro_batches), labels.chunk(micro_batches), strict=True))
    for i, (x, y) in enumerate(pieces):
        last = i == len(pieces) - 1
        quiet = model.no_sync() if isinstance(model, DDP) and not last else nullcontext()
        with quiet:
            (F.cross_entropy(model(x), y) / len(pieces)).backward()
        if clip_each_micro_batch or last:
            norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    optimizer.step()
    return {"norm": norm, "weights": _flat(model)}


# ------------------------------------------------------------------ changed after wrapping


def changed_after_wrapping(lr: float = 0.1) -> dict:
    """Inside a rank: a small model wrapped in DDP, then changed in two ways: a new head
    appended after ``DDP(...)`` (created from the same seed on every rank, so it starts
    equal), and the first layer re-initialised in place with a different seed per rank.
    Then one SGD step on this rank's own batch.

    Returns each layer's gradient and its weights before and after the step. The new head
    is not registered with DDP's reducer: its gradient stays this rank's own. The first
    layer is still registered: its gradient is averaged, but its values, different per
    rank since the re-initialisation, are never broadcast again."""
    model = _wrap(_tiny_model())
    net = model.module if isinstance(model, DDP) else model
    torch.manual_seed(0)
    net.append(nn.Linear(4, 4))            # a new head, after wrapping
    torch.manual_seed(rank())
    net[0].reset_parameters()              # in place, a different initialisation per rank
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    before = {"head": net[-1].weight.detach().clone(), "first": net[0].weight.detach().clone()}
    images, labels = uneven_batch(rank(), 0)
    F.cross_entropy(model(images), labels).backward()
    optimizer.step()
    return {name: {"before": before[name], "grad": layer.weight.grad.clone(),
                   "after": layer.weight.detach().clone()}
            for name, layer in (("head", net[-1]), ("first", net[0]))}
