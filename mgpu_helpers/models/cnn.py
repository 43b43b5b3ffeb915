"""The seeds' CNN, the model of chapters 03 to 09, and its nine steps as an
``nn.Sequential`` for pipeline stages."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class SeedCNN(nn.Module):
    """The seeds' CNN for 32x32 RGB images: conv 3->64, conv 64->64, max-pool,
    fc 64*16*16 -> 512 -> classes.

    The original tutorial's version misses its imports and uses ``x.view(-1, 64*16*16)``,
    which breaks on non-contiguous inputs (``channels_last``) and hides shape mistakes by
    silently changing the batch size; ``torch.flatten(x, 1)`` keeps the batch dimension.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(64, 64, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(64 * 16 * 16, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (32, 32):
            raise ValueError(f"SeedCNN expects 32x32 images, got {tuple(x.shape[-2:])}")
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


def as_sequential(model: SeedCNN) -> nn.Sequential:
    """The tutorial CNN as an ``nn.Sequential`` of its nine steps, sharing its layers, so that
    it can be cut into pipeline stages (chapter 06). Computes exactly what ``model`` does."""
    if not isinstance(model, SeedCNN):
        raise TypeError(f"as_sequential takes a SeedCNN, got {type(model).__name__}")
    return nn.Sequential(model.conv1, nn.ReLU(), model.conv2, nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), model.fc1, nn.ReLU(), model.fc2)
