"""Chapter 07's meters: what a rank holds after training steps, and the collectives that
tensor parallelism runs.

:class:`StepMeter` watches the training steps of chapter 07's section 1 (DDP, FSDP2) and
of its appendix's section 1 (DDP with bucket views, ZeRO-1): it times each step, can
measure the activations autograd keeps, records DDP's bucket buffers through a
communication hook, and reports the bytes of the distinct storages behind each kind of
state after the last step. :class:`CollectivesSeen` records the collectives DTensor issues
(chapter 07, section 6), with the bytes of their input.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from ..measure.memory import ActivationMeter
from .memory import held_by_kind, record_bucket_buffers, storages


class StepMeter:
    """Measures the training steps run inside ``with meter.step():`` blocks.

    Args:
        model: the wrapped model (``DistributedDataParallel``, or a model sharded by
            ``fully_shard``). Under DDP a communication hook that all-reduces as DDP does
            by default keeps each bucket's flat buffer, so that its bytes can be counted.
        optimizer: the model's optimizer (``ZeroRedundancyOptimizer`` counts its own
            share of the state only).
        activations: also measure the peak bytes autograd keeps for the backward pass
            (:class:`~mgpu_helpers.measure.memory.ActivationMeter`, the parameters excluded).
    """

    def __init__(self, model: torch.nn.Module, optimizer, activations: bool = False):
        self.model, self.optimizer, self.activations = model, optimizer, activations
        ddp = isinstance(model, DistributedDataParallel)
        self.buckets = record_bucket_buffers(model) if ddp else {}
        self.seconds: list[float] = []
        self.peak_activations = 0

    @contextmanager
    def step(self):
        """Times the block and, if asked, measures the activations it keeps."""
        meter = ActivationMeter(exclude=self.model.parameters()) if self.activations else None
        start = time.perf_counter()
        with meter or nullcontext():
            yield
        self.seconds.append(time.perf_counter() - start)
        if meter is not None:
            self.peak_activations = max(self.peak_activations, meter.peak)

    def report(self) -> dict:
        """After the steps: ``"memory"``, the bytes per kind of state (parameters,
        gradients, optimizer state, bucket buffers no gradient lives in, and the peak of
        the activations, 0 unless measured); ``"weights"``, the full weights (gathered
        under FSDP); ``"seconds"``, the median step time; ``"gradients"``, how many there
        are, and ``"gradients in a bucket"``, how many live in a bucket buffer's
        storage."""
        if not self.seconds:
            raise RuntimeError("StepMeter.report() found no step: run the training steps "
                               "inside `with meter.step():` first")
        params = list(self.model.parameters())
        held = held_by_kind(params, self.optimizer, self.buckets)
        in_buckets = storages(self.buckets.values())
        weights = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                   for p in params]
        return {"memory": held | {"activations (peak)": self.peak_activations},
                "weights": weights,
                "seconds": sorted(self.seconds)[len(self.seconds) // 2],
                "gradients": len(params),
                "gradients in a bucket": sum(
                    not in_buckets.keys().isdisjoint(storages([p.grad])) for p in params)}


class CollectivesSeen(TorchDispatchMode):
    """While active, records each collective DTensor runs: ``(name, bytes of its
    input)`` in ``calls``. DTensor issues functional collectives (the
    ``_c10d_functional`` operators), which a dispatch mode sees as they run."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name().split("::")[-1]
        if func.namespace == "_c10d_functional" and not name.startswith(("_", "wait")):
            self.calls.append((name, sum(a.numel() * a.element_size() for a in args
                                         if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))
