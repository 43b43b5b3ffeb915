"""Mixture of experts and expert parallelism (chapter 13).

* :mod:`.layer`: :class:`Expert` (one MLP) and :class:`MoE`, the layer: a router choosing
  each token's top-k experts (with the load-balancing loss and the per-expert counts it
  records), an optional capacity, and the experts' outputs weighted back together;
* :mod:`.all_to_all`: expert parallelism, each rank holding some of the experts:
  :class:`AllToAll` (uneven ``all_to_all_single`` with its backward),
  :func:`expert_parallel_` (keep this rank's experts), :func:`expert_parallel_forward`
  (route, exchange the counts, dispatch, compute, combine) and
  :class:`ExpertParallelMoE` (the same as a module, for a model's blocks).

As in :mod:`~mgpu_helpers.parallel.pipeline`, the algorithm (which token goes to which
expert) lives apart from the communication (:class:`AllToAll`).
"""

from .all_to_all import AllToAll, ExpertParallelMoE, expert_parallel_, expert_parallel_forward
from .layer import Expert, MoE

__all__ = ["AllToAll", "Expert", "ExpertParallelMoE", "MoE", "expert_parallel_",
           "expert_parallel_forward"]
