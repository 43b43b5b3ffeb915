"""Memory a training step holds, measured: what autograd keeps for the backward pass.

:class:`ActivationMeter` counts the bytes of the tensors autograd saves during forward
passes (through ``torch.autograd.graph.saved_tensors_hooks``), now and at their peak. It
sees what autograd really keeps, whatever the layers are, so it checks a formula for
activation memory instead of repeating it: chapters 06 (a pipeline stage's micro-batches)
and 07 (activation checkpointing) use it.
"""

from __future__ import annotations

import torch


class ActivationMeter:
    """Counts the bytes autograd keeps for the backward pass (saved activations), now
    and at their peak, while the ``with`` block runs forward passes.

    Tensors that share storage with ``exclude`` (a model's parameters, which autograd
    also saves but which exist anyway) are not counted. A saved tensor stops counting
    when autograd frees it, after its backward has run; a tensor saved by two layers
    (a ReLU's output is also the next layer's input) counts once.
    """

    def __init__(self, exclude=()):
        self.current = 0
        self.peak = 0
        self._live: dict[int, list[int]] = {}  # storage -> [references, bytes]
        self._excluded = {p.untyped_storage().data_ptr() for p in exclude}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info):
        self._hooks.__exit__(*exc_info)

    def _pack(self, tensor: torch.Tensor):
        if tensor.untyped_storage().data_ptr() in self._excluded:
            return tensor
        return _Saved(tensor, self)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved


class _Saved:
    """A saved tensor that tells its meter when autograd lets go of it."""

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter):
        self.tensor, self.meter = tensor, meter
        self.storage = tensor.untyped_storage().data_ptr()
        entry = meter._live.setdefault(self.storage, [0, tensor.untyped_storage().nbytes()])
        entry[0] += 1
        if entry[0] == 1:
            meter.current += entry[1]
            meter.peak = max(meter.peak, meter.current)

    def __del__(self):
        entry = self.meter._live[self.storage]
        entry[0] -= 1
        if entry[0] == 0:
            self.meter.current -= entry[1]
            del self.meter._live[self.storage]
