"""Lab 5, randomness per rank (the data): augmentations that draw the same random numbers
on every rank, because every rank's DataLoader is seeded alike.

The augmenting dataset is chapter 02's :class:`~mgpu_helpers.labs.augmentation_seeds.RandomAngles`
(each sample the rotation angle ``RandomAffine`` draws for it), wrapped by
:class:`TaggedAngles` to say which sample and which DataLoader worker drew each angle.
"""

from __future__ import annotations

from torch.utils.data import DataLoader, Dataset, DistributedSampler, get_worker_info

from ...data.loading import loader_generator, seed_worker
from ...runtime.ranks import rank, world_size
from ..augmentation_seeds import RandomAngles


class TaggedAngles(Dataset):
    """:class:`~mgpu_helpers.labs.augmentation_seeds.RandomAngles` of ``length`` samples,
    each returned as ``(sample, worker, angle)``: its index, the id of the DataLoader
    worker that drew it (-1 for the loading process itself), and the angle."""

    def __init__(self, length: int, degrees: float):
        self.angles = RandomAngles(length, degrees=degrees)

    def __len__(self) -> int:
        return len(self.angles)

    def __getitem__(self, index: int) -> tuple[int, int, float]:
        worker = get_worker_info()
        return index, worker.id if worker is not None else -1, self.angles[index]


def lab_identical_augmentation(fixed: bool = False, samples_per_rank: int = 8,
                               seed: int = 0) -> list[tuple[int, int, float]]:
    """Each rank loads its own samples (``DistributedSampler``) with 2 DataLoader
    workers, and every sample draws a rotation angle. The DataLoader seeds each worker
    from the loader's generator plus the worker's id, so the workers of one rank differ;
    with the same generator seed on every rank (the bug), the ranks draw the same angles
    for their different samples. The fix seeds each rank's loader differently
    (``loader_generator(seed, rank)``). Returns ``(sample, worker, angle)`` for every
    sample, in the order loaded."""
    dataset = TaggedAngles(samples_per_rank * world_size(), degrees=30.0)
    loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=False),
                        num_workers=2, collate_fn=list, worker_init_fn=seed_worker,
                        generator=loader_generator(seed, rank() if fixed else 0))
    return [draw for batch in loader for draw in batch]
