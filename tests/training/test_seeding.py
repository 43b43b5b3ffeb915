"""seed_everything makes the random streams repeat, and rejects bad seeds clearly."""

import random

import numpy as np
import pytest
import torch

from mgpu_helpers.training.seeding import seed_everything


def draw():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_same_seed_same_draws():
    seed_everything(7)
    first = draw()
    seed_everything(7)
    assert draw() == first
    seed_everything(8)
    assert draw() != first


def test_default_comes_from_environment(monkeypatch):
    monkeypatch.setenv("MGPU_SEED", "123")
    assert seed_everything() == 123
    monkeypatch.delenv("MGPU_SEED")
    assert seed_everything() == 0


def test_bad_environment_seed_names_the_variable(monkeypatch):
    monkeypatch.setenv("MGPU_SEED", "abc")
    with pytest.raises(ValueError, match="MGPU_SEED='abc' is not an integer"):
        seed_everything()


def test_out_of_range_seed_is_rejected():
    with pytest.raises(ValueError, match="seed must be in"):
        seed_everything(-1)


def test_seeding_leaves_cuda_uninitialised():
    seed_everything(1)
    assert not torch.cuda.is_initialized()
