"""Tensor, sequence and loss parallelism (chapter 11; the plans reused by chapter 14).

* :mod:`.by_hand`: Megatron-LM's f and g (:class:`CopyToTP`, :class:`ReduceFromTP`),
  each rank's slice of a weight (:func:`keep_slice_`), and a GPT block split over the
  ranks between them (:class:`TensorParallel`, :func:`tensor_parallel_`);
* :mod:`.sequence`: sequence parallelism, the tokens' all-gather and reduce-scatter in
  place of g's all-reduce (:class:`GatherTokens`, :class:`ScatterTokens`,
  :class:`SequenceParallelRegion`, :func:`sequence_parallel_`) and the sum of the
  unsplit weights' gradients (:func:`sum_unsplit_gradients_`);
* :mod:`.vocabulary`: the embedding and the cross-entropy over a vocabulary split across
  ranks (:func:`vocab_parallel_embedding`, :func:`vocab_parallel_cross_entropy`);
* :mod:`.plan`: the same with PyTorch's DTensor: a GPT block's parallelize plan
  (:func:`block_plan`, TP alone or TP + SP) and the whole GPT's (:func:`parallelize_gpt`).

As in :mod:`~mgpu_helpers.parallel.pipeline`, the algorithm (which rank holds which
slice) lives apart from the communication (f, g and the token collectives).
"""

from .by_hand import CopyToTP, ReduceFromTP, TensorParallel, keep_slice_, tensor_parallel_
from .plan import block_plan, parallelize_gpt
from .sequence import (
    GatherTokens,
    ScatterTokens,
    SequenceParallelRegion,
    gather_tokens,
    scatter_tokens,
    sequence_parallel_,
    sum_unsplit_gradients_,
)
from .vocabulary import vocab_parallel_cross_entropy, vocab_parallel_embedding

__all__ = [
    "CopyToTP", "GatherTokens", "ReduceFromTP", "ScatterTokens", "SequenceParallelRegion",
    "TensorParallel", "block_plan", "gather_tokens", "keep_slice_", "parallelize_gpt",
    "scatter_tokens", "sequence_parallel_", "sum_unsplit_gradients_", "tensor_parallel_",
    "vocab_parallel_cross_entropy", "vocab_parallel_embedding",
]
