"""How the ranks are arranged: one size per parallelism, checked, and the device mesh.

A job that combines parallelisms arranges its ranks in a grid with one named axis per
parallelism. :class:`ParallelDims` holds the sizes, refuses a set that cannot work, and
builds the ``DeviceMesh`` (``init_device_mesh``) whose named sub-meshes the wrapping code
takes: ``fully_shard(block, mesh=mesh["fsdp"])``, ``parallelize_module(block,
mesh["tp"], plan)``.

The axes, outermost first: ``pp`` (pipeline stages), ``dp`` (replicas: DDP, or the
replicate dimension of HSDP), ``fsdp`` (parameter shards: FSDP2, ZeRO-3), ``ep``
(expert shards), ``cp`` (sequence chunks: context parallelism), ``tp`` (tensor slices).
Consecutive ranks differ in the innermost axis: tensor parallelism, which talks in every
layer, gets the ranks of one node (NVLink); pipeline stages, which exchange one
activation per micro-batch, may sit on different nodes. Each size is its own axis, so the
sizes multiply to the world size (``ep`` ranks hold different experts and replicate the
rest of the model, like data-parallel ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from .ranks import device

#: The mesh axes, outermost (slowest-varying rank index) first.
AXES = ("pp", "dp", "fsdp", "ep", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """The size of each parallelism; 1 means not used. The product is the world size.

    Args:
        pp: pipeline stages. dp: replicas of the model. fsdp: ranks that shard the
            parameters. ep: ranks that share out the experts. cp: ranks that split each
            sequence. tp: ranks that split each layer's matrices.
    """

    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self):
        for axis in AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"ParallelDims: {axis} must be a whole number >= 1 (1: that "
                                 f"parallelism is not used), got {size!r}")

    @classmethod
    def filling(cls, world_size: int, axis: str = "fsdp", **sizes: int) -> ParallelDims:
        """The sizes given, and ``axis`` sized to take the ranks they leave: on 8 ranks,
        ``ParallelDims.filling(8, tp=2)`` is ``fsdp=4, tp=2``."""
        if axis not in AXES:
            raise ValueError(f"ParallelDims.filling: axis must be one of {', '.join(AXES)}, "
                             f"got {axis!r}")
        if axis in sizes:
            raise ValueError(f"ParallelDims.filling sizes {axis} itself: leave it out, or "
                             "fill another axis")
        given = cls(**sizes)  # checks each size
        rest, left = divmod(world_size, given.world_size)
        if left or rest < 1:
            raise ValueError(
                f"{world_size} ranks cannot be filled along {axis}: the other sizes "
                f"({given._sizes_text()}) multiply to {given.world_size}, which does not "
                f"divide {world_size}. Choose sizes whose product divides {world_size}.")
        return cls(**{**sizes, axis: rest})

    @property
    def world_size(self) -> int:
        """How many ranks this arrangement needs: the product of the sizes."""
        return math.prod(getattr(self, axis) for axis in AXES)

    @property
    def axes(self) -> tuple[tuple[str, int], ...]:
        """The axes in use (size above 1), outermost first, as ``(name, size)``; one
        ``("dp", 1)`` axis when nothing is parallel (a single rank)."""
        used = tuple((axis, getattr(self, axis)) for axis in AXES if getattr(self, axis) > 1)
        return used or (("dp", 1),)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits on each axis in use: the innermost axis varies fastest,
        as in the mesh :meth:`build_mesh` makes."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1} for "
                             f"{self._sizes_text()}, got {rank!r}")
        place = {}
        for axis, size in reversed(self.axes):
            rank, place[axis] = divmod(rank, size)
        return {axis: place[axis] for axis, _ in self.axes}

    def check_world(self, world_size: int) -> None:
        """Raise ValueError, saying what fits, unless the sizes multiply to ``world_size``."""
        if world_size == self.world_size:
            return
        hint = ""
        others = self.world_size // self.fsdp
        if world_size % others == 0:
            hint = f" For example fsdp={world_size // others}, the others unchanged."
        raise ValueError(
            f"ParallelDims({self._sizes_text()}) arranges {self.world_size} ranks, but this "
            f"job has {world_size}. The sizes must multiply to the number of ranks: change "
            f"them, or start {self.world_size} ranks.{hint}")

    def build_mesh(self, device_type: str | None = None):
        """The ``DeviceMesh`` of the running process group, one named axis per
        parallelism in use (:attr:`axes`). Call it in every rank, after the group exists.

        Args:
            device_type: ``"cuda"`` or ``"cpu"``; default, the device this rank computes
                on (``mgpu_helpers.device()``). A CPU check passes ``"cpu"``.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ParallelDims.build_mesh needs a running process group: call "
                               "it inside a rank (mgpu_helpers.launch, torchrun)")
        self.check_world(dist.get_world_size())
        names, shape = zip(*self.axes, strict=True)
        return init_device_mesh(device_type or device().type, shape, mesh_dim_names=names)

    def _sizes_text(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                         if getattr(self, f.name) != 1) or "every size 1"
