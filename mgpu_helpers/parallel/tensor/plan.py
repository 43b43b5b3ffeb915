"""Tensor and sequence parallelism with PyTorch's DTensor (chapter 11, section 4;
chapter 14 composes the same plans with pipeline and data parallelism): the GPT's
parallelize plans, for ``parallelize_module`` on a 1-D (``"tp"``) mesh."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def block_plan(sequence_parallel=True):
    """The plan of one GPT block (:class:`mgpu_helpers.models.gpt.Block`): q, k, v and
    the MLP's up projection column-parallel, o and down row-parallel; with
    ``sequence_parallel``, the norms on this rank's tokens and the block's input and
    output sharded along the sequence (``Shard(1)``)."""
    if not sequence_parallel:  # the block's input and output whole on every rank
        return {"attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(),
                "attention.v": ColwiseParallel(), "attention.o": RowwiseParallel(),
                "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                        desired_input_layouts=(Replicate(),)),
        "attention.q": ColwiseParallel(),
        "attention.k": ColwiseParallel(),
        "attention.v": ColwiseParallel(),
        "attention.o": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                  desired_input_layouts=(Replicate(),)),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
    }


def parallelize_gpt(model, mesh):
    """TP + SP for the whole GPT on ``mesh``, its logits left sharded over the vocabulary
    (for ``loss_parallel``), in place."""
    for block in model.blocks:
        parallelize_module(block, mesh, block_plan())
    parallelize_module(model, mesh, {
        # the embeddings stay whole; block 0 takes this rank's tokens of their sum: no
        # communication forward, an all-gather of the gradient in backward
        "blocks.0": PrepareModuleInput(input_layouts=(Replicate(),),
                                       desired_input_layouts=(Shard(1),),
                                       use_local_output=True),
        "norm": SequenceParallel(),
        # the head's logits stay sharded over the vocabulary, for loss_parallel
        "head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    })
