"""Chapter 02's seeding experiment: a dataset whose samples are the random rotation
angles an augmentation draws, to see which ranks and workers draw the same ones.
Chapter 09's augmentation lab (:mod:`.debug_labs.augmentation`) draws from it too.

It lives in a module, not in the notebook, so that DataLoader workers started by *spawn*
or *forkserver* can unpickle it.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class RandomAngles(Dataset):
    """``length`` samples, each the rotation angle ``RandomAffine(degrees)`` draws for it: a
    stand-in for an augmented dataset, whose randomness is all it returns.

    The angle comes from the global torch generator of the process that loads the sample
    (a ``DataLoader`` worker, or the training process itself with ``num_workers=0``).
    """

    def __init__(self, length: int = 6, degrees: float = 10.0):
        from torchvision.transforms import v2  # here: importing torchvision takes a while

        self.length = length
        self.affine = v2.RandomAffine(degrees=degrees)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> float:
        return float(self.affine.make_params([torch.empty(3, 32, 32)])["angle"])
