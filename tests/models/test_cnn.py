"""The tutorial CNN: shapes, size, and a clear error for the wrong image size."""

import pytest
import torch

from mgpu_helpers.models import SeedCNN


def test_seed_cnn_maps_32x32_rgb_to_class_scores():
    model = SeedCNN()
    assert model(torch.randn(5, 3, 32, 32)).shape == (5, 10)
    assert sum(p.numel() for p in model.parameters()) == (
        3 * 64 * 9 + 64 + 64 * 64 * 9 + 64 + 64 * 16 * 16 * 512 + 512 + 512 * 10 + 10)


def test_seed_cnn_accepts_channels_last():
    x = torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)
    assert SeedCNN()(x).shape == (2, 10)


def test_seed_cnn_rejects_other_sizes():
    with pytest.raises(ValueError, match="expects 32x32 images, got"):
        SeedCNN()(torch.randn(1, 3, 28, 28))


def test_seed_cnn_as_sequential_computes_the_same_with_the_same_layers():
    from mgpu_helpers.models import as_sequential
    model = SeedCNN()
    steps = as_sequential(model)
    x = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(steps(x), model(x))
    assert steps[0] is model.conv1 and steps[-1] is model.fc2
    with pytest.raises(TypeError, match="takes a SeedCNN, got Linear"):
        as_sequential(torch.nn.Linear(2, 2))
