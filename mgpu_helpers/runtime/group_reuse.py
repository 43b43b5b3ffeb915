"""Code written for torchrun runs unchanged under ``launch``.

A function written for torchrun creates its process group itself::

    def main():
        dist.init_process_group("nccl")        # reads RANK, WORLD_SIZE, MASTER_ADDR...
        local_rank = int(os.environ["LOCAL_RANK"])
        ...
        dist.destroy_process_group()

``launch`` has already created the group when such a function starts (so that
``mh.rank()`` and collectives work in functions that do not), and PyTorch refuses a
second ``init_process_group`` ("trying to initialize the default process group twice!").
While the function runs, :func:`reusing_launched_group` replaces ``init_process_group``
by a version that checks the call against the launch and then uses the group that is
already there. A call that contradicts the launch (another world size, a rank that is
not this one, NCCL in a gloo-only launch) is an error that says so. Once the function
has destroyed the group, a further call creates a new one, as PyTorch would.

The replacement is installed where such code looks the function up:
``torch.distributed.init_process_group``, ``torch.distributed.distributed_c10d``, and the
function's own module globals (``from torch.distributed import init_process_group`` in a
notebook cell binds the name there).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch.distributed as dist
from torch.distributed import distributed_c10d

from .backend import backend_device_type

_ORIGINAL = distributed_c10d.init_process_group


class GroupMismatchError(RuntimeError):
    """init_process_group was called with settings the launch did not start."""


def _wanted(value) -> bool:
    return value is not None and value != -1


def check_compatible(backend, world_size, rank, launched_backend: str,
                     launched_world: int, launched_rank: int) -> None:
    """Raise :class:`GroupMismatchError` if an ``init_process_group`` call asks for a
    group other than the one ``launch`` made. ``init_method`` and ``store`` only say how
    to meet, which the launch has done already, so they are not compared."""
    problems = []
    if _wanted(world_size) and int(world_size) != launched_world:
        problems.append(f"world_size={world_size}, but launch started {launched_world} ranks")
    if _wanted(rank) and int(rank) != launched_rank:
        problems.append(f"rank={rank}, but this is rank {launched_rank}")
    if backend is not None:
        asked = str(backend).lower()
        gpu_asked = backend_device_type(asked) == "cuda"
        if gpu_asked and backend_device_type(launched_backend) != "cuda":
            problems.append(f"backend={backend!r}, but launch made a {launched_backend} group "
                            "(CPU ranks); pass backend='auto' to launch on a GPU node")
        elif not gpu_asked and "gloo" not in asked:
            problems.append(f"backend={backend!r}, but launch made a {launched_backend} group")
    if problems:
        raise GroupMismatchError(
            "init_process_group(...) contradicts the launch that started this function: "
            + "; ".join(problems) + ". Drop the argument (the launch sets RANK, WORLD_SIZE, "
            "LOCAL_RANK, MASTER_ADDR and MASTER_PORT as torchrun does) or change the launch."
        )


def _reusing_init(launched_backend: str, launched_world: int, launched_rank: int):
    @functools.wraps(_ORIGINAL)
    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1,
                           rank=-1, store=None, *args, **kwargs):
        if not dist.is_initialized():  # the function destroyed the launch's group
            return _ORIGINAL(backend, init_method, timeout, world_size, rank, store,
                             *args, **kwargs)
        check_compatible(backend, world_size, rank, launched_backend, launched_world,
                         launched_rank)
        return None

    init_process_group.reuses_launched_group = True
    return init_process_group


@contextmanager
def reusing_launched_group(fn, backend: str, world_size: int, rank: int):
    """While the block runs, ``init_process_group`` reuses the group launch created for
    ``fn`` (see the module docstring); everything is put back afterwards."""
    replacement = _reusing_init(backend, world_size, rank)
    namespaces = [vars(dist), vars(distributed_c10d)]
    user_globals = getattr(fn, "__globals__", None)
    if isinstance(user_globals, dict):
        namespaces.append(user_globals)
    replaced = []
    for namespace in namespaces:
        for name, value in list(namespace.items()):
            if value is _ORIGINAL:
                namespace[name] = replacement
                replaced.append((namespace, name))
    try:
        yield
    finally:
        for namespace, name in replaced:
            if namespace.get(name) is replacement:
                namespace[name] = _ORIGINAL
