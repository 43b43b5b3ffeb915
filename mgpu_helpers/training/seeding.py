"""One call to seed every random number generator a chapter uses."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

SEED_ENV_VAR = "MGPU_SEED"
DEFAULT_SEED = 0


def seed_everything(seed: int | None = None) -> int:
    """Seed Python's ``random``, NumPy and PyTorch (CPU and, if initialised, CUDA).

    Args:
        seed: the seed; ``None`` takes ``$MGPU_SEED`` (set in ``tests/notebook.env``,
            so tests and regenerated outputs agree), else 0.

    Returns:
        The seed used, so a notebook can print it.
    """
    if seed is None:
        text = os.environ.get(SEED_ENV_VAR, str(DEFAULT_SEED))
        try:
            seed = int(text)
        except ValueError:
            raise ValueError(
                f"{SEED_ENV_VAR}={text!r} is not an integer; set it to a whole number "
                f"such as 0, or unset it to use {DEFAULT_SEED}"
            ) from None
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}; NumPy rejects other values")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds CUDA devices lazily, without initialising CUDA
    return seed
