"""Context parallelism (chapter 12): the sequence cut across ranks, attention computed by
each rank for its own queries over every rank's keys and values.

* :mod:`.ring`: the blocks of causal attention and their online-softmax merge
  (:func:`attend`, :func:`merge`); which positions a rank holds, in order or zig-zag
  (:func:`chunk_starts`, :func:`positions_of`); the ring's message to the next rank
  (:func:`pass_along`); :class:`RingAttention`, forward and backward, K and V passed
  around the ring while each rank computes;
* :mod:`.all_gather`: the other design, every rank's K and V gathered before attention
  (:class:`GatherKV`, :func:`all_gather_attention`);
* :mod:`.gpt`: the workbook's GPT under context parallelism: its attention replaced by
  the ring (:class:`RingSelfAttention`, :func:`context_parallel_`), this rank's tokens
  (:func:`my_tokens`) and the loss over the whole batch's answers (:func:`cp_loss`).

As in :mod:`~mgpu_helpers.parallel.pipeline`, the algorithm (which block meets which)
lives apart from the communication (:func:`pass_along`, :class:`GatherKV`).
"""

from .all_gather import GatherKV, all_gather_attention
from .gpt import RingSelfAttention, context_parallel_, cp_loss, my_tokens
from .ring import RingAttention, attend, chunk_starts, merge, pass_along, positions_of

__all__ = [
    "GatherKV", "RingAttention", "RingSelfAttention", "all_gather_attention", "attend",
    "chunk_starts", "context_parallel_", "cp_loss", "merge", "my_tokens", "pass_along",
    "positions_of",
]
