"""Every collective a rank runs, as the dispatcher sees it: chapter 11's meter.

:class:`CollectivesLogged` is a ``TorchDispatchMode``: while it is active, each
operator PyTorch runs passes through it, including the process group's (``c10d::``,
what ``dist.all_reduce`` and the rest call) and the functional collectives DTensor
issues (``_c10d_functional::``). An operator on DTensors is handed on to DTensor first
(as ``torch.distributed.tensor.debug.CommDebugMode`` does), so the collectives DTensor
runs inside it come back through the mode too. So it sees a collective however the code
under test reached it: a ``dist`` function, an alias of one, an autograd function's
backward, a DTensor redistribution or an operator's own (``loss_parallel``'s). Each
record is ``(kind, bytes)``: ``kind`` one of ``all_reduce``, ``all_gather``,
``reduce_scatter``, ``all_to_all``, ``broadcast``, ``scatter``, ``gather``, ``reduce``,
``send``, ``recv`` or ``other``; ``bytes`` the size of what this rank contributes (an
all-gather's shard, a reduce-scatter's whole input).

:func:`ring_bytes_sent` turns a record into what a ring sends from each rank (chapter
03): ``2(N-1)/N`` of an all-reduce's tensor, ``N-1`` shards of an all-gather, ``(N-1)/N``
of a reduce-scatter's input.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..planning.costs import ring_bytes_sent  # noqa: F401  (chapter 11-13 import it from here)

# operator name (without namespace and trailing underscores) -> kind
_KINDS = {
    "allreduce": "all_reduce", "all_reduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allgather": "all_gather", "_allgather_base": "all_gather",
    "all_gather_into_tensor": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "scatter": "scatter", "gather": "gather", "reduce": "reduce",
    "send": "send", "recv": "recv", "recv_any_source": "recv",
}
_NAMESPACES = ("c10d", "_c10d_functional")
_NOT_COLLECTIVES = ("wait", "barrier", "monitored_barrier", "wrap_tensor")


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _contributed(kind: str, name: str, args) -> int:
    """The bytes this rank puts into the collective."""
    if name in ("allgather", "_allgather_base", "allgather_into_tensor_coalesced",
                "reduce_scatter", "_reduce_scatter_base", "alltoall", "alltoall_base"):
        # c10d's (outputs, inputs) order: count the inputs only
        inputs = args[1] if len(args) > 1 else ()
    else:
        inputs = args[0] if args else ()
    return sum(t.numel() * t.element_size() for t in _tensors(inputs))


class CollectivesLogged(TorchDispatchMode):
    """While active, ``calls`` receives ``(kind, bytes)`` for each collective this rank
    runs (see the module's docstring)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(kind, DTensor) for kind in types):
            # let DTensor run first (a mode otherwise runs before a tensor subclass): the
            # collectives it issues come back through this mode
            return NotImplemented
        if func.namespace in _NAMESPACES:
            name = func.name().split("::")[-1].split(".")[0].rstrip("_")
            if not name.lstrip("_").startswith(_NOT_COLLECTIVES):
                kind = _KINDS.get(name, _KINDS.get(name.lstrip("_"), "other"))
                self.calls.append((kind, _contributed(kind, name, args)))
        return func(*args, **(kwargs or {}))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.calls]
