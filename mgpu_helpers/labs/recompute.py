"""Chapter 07's activation checkpointing: store less in forward, recompute in backward.

:func:`checkpointed_step` runs one forward and backward pass of the seed CNN's
convolutional part (two convolutions with their ReLUs, then pooling) and its classifier,
with the convolutional part run three ways: storing every activation autograd wants
("none"), storing only its input and recomputing the rest in backward ("full"), or
storing the convolutions' outputs and recomputing only the cheap ReLUs and pooling
("selective", through a checkpoint policy). It measures what autograd keeps from the
forward pass to the backward pass, the gradients, and how many convolutions ran.

What each mode keeps of the convolutional part, for a batch of 32: "none" the input
images, both ReLUs' outputs (8 MiB each; ReLU's backward needs its output, and the next
layer's input is the same tensor) and the pooling's int64 indices (4 MiB); "full" only
the input; "selective" the input and both convolutions' outputs (the same 8 MiB each, in
place of the ReLUs'), recomputing the ReLUs and the pooling, so it saves the indices.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ..memory import ActivationMeter
from ..models import SeedCNN

MODES = ("none", "full", "selective")


def _save_convolutions(ctx, op, *args, **kwargs):
    if op == torch.ops.aten.convolution.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


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


def checkpointed_step(mode: str, batch_size: int = 32, seed: int = 0) -> dict:
    """One forward and backward pass; see the module's docstring. Returns the peak bytes
    autograd kept (the region's input, which the checkpoint keeps a reference to, counts
    once, as in "none", where the first convolution saves it), the gradients, and the
    convolutions run again in backward."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    torch.manual_seed(seed)
    model = SeedCNN()
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (batch_size,), generator=generator)
    features = functools.partial(_features, model)
    with ActivationMeter(exclude=model.parameters()) as meter:
        if mode == "none":
            x = features(images)
        elif mode == "full":
            x = checkpoint(features, images, use_reentrant=False)
        else:
            contexts = functools.partial(create_selective_checkpoint_contexts,
                                         _save_convolutions)
            x = checkpoint(features, images, use_reentrant=False, context_fn=contexts,
                           respect_saved_tensors_hooks=True)
        loss = F.cross_entropy(model.fc2(F.relu(model.fc1(x))), labels)
    with _ConvolutionCounter() as recomputed:
        loss.backward()
    return {"kept_bytes": meter.peak, "gradients": [p.grad for p in model.parameters()],
            "recomputed_convolutions": recomputed.count}
