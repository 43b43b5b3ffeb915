"""Chapter 07's activation checkpointing: store less in forward, recompute in backward.

:func:`checkpointed_step` runs one forward and backward pass of the tutorial CNN: its
convolutional part (two convolutions with their ReLUs, then pooling), run by the
caller's function (plainly, or under ``torch.utils.checkpoint``, as the chapter writes
it), then its classifier. It measures what autograd keeps from the forward pass to the
backward pass, the gradients, and how many convolutions ran again in backward.

What each way keeps of the convolutional part, for a batch of 32: plainly, the input
images, both ReLUs' outputs (8 MiB each; ReLU's backward needs its output, and the next
layer's input is the same tensor) and the pooling's int64 indices (4 MiB); full
checkpointing only the input; selective checkpointing that keeps the convolutions'
outputs, the input and those outputs (the same 8 MiB each, in place of the ReLUs'),
recomputing the ReLUs and the pooling, so it saves the indices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ..measure.memory import ActivationMeter
from ..models import SeedCNN


class _ConvolutionCounter(TorchDispatchMode):
    """Counts the forward convolutions that actually run while it is active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func == torch.ops.aten.convolution.default
        return func(*args, **(kwargs or {}))


def _features(model: SeedCNN, x: torch.Tensor) -> torch.Tensor:
    x = F.relu(model.conv1(x))
    x = F.relu(model.conv2(x))
    return torch.flatten(F.max_pool2d(x, 2), 1)


def checkpointed_step(run_region: Callable, batch_size: int = 32, seed: int = 0) -> dict:
    """One forward and backward pass; see the module's docstring. ``run_region(region,
    images)`` must return ``region(images)``, the convolutional part's output, computed
    as it likes. Returns the peak bytes autograd kept (the region's input, which a
    checkpoint keeps a reference to, counts once, as without one, where the first
    convolution saves it), the gradients, and the convolutions run again in backward."""
    if not callable(run_region):
        raise TypeError(f"run_region must be a function (region, images) -> features, got "
                        f"{type(run_region).__name__}: pass the function itself, not its "
                        "result")
    torch.manual_seed(seed)
    model = SeedCNN()
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (batch_size,), generator=generator)
    region = functools.partial(_features, model)
    with ActivationMeter(exclude=model.parameters()) as meter:
        x = run_region(region, images)
        loss = F.cross_entropy(model.fc2(F.relu(model.fc1(x))), labels)
    with _ConvolutionCounter() as recomputed:
        loss.backward()
    return {"kept_bytes": meter.peak, "gradients": [p.grad for p in model.parameters()],
            "recomputed_convolutions": recomputed.count}
