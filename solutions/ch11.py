"""Chapter 11: reference solutions and plausible mistakes."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def vocab_parallel_argmax(logits, group):
    columns = logits.shape[-1]
    first = dist.get_rank(group) * columns
    best, index = logits.max(-1)  # the first of equal scores, within this rank's slice
    top = best.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    # the lowest global id among the ranks holding the best score
    beyond = columns * dist.get_world_size(group)
    candidate = torch.where(best == top, index + first, torch.full_like(index, beyond))
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=group)
    return candidate


def argmax_local_ids(logits, group):
    best, index = logits.max(-1)
    top = best.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    candidate = torch.where(best == top, index, torch.full_like(index, 10**9))
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=group)
    return candidate


def argmax_by_gathering(logits, group):
    pieces = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, logits.contiguous(), group=group)
    return torch.cat(pieces, -1).argmax(-1)


def argmax_gathering_through_the_backend(logits, group):
    # past torch.distributed's functions, straight to gloo: its own record still counts
    pieces = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    backend = group._get_backend(torch.device("cpu"))
    backend.allgather([pieces], [logits.contiguous()]).wait()
    return torch.cat(pieces, -1).argmax(-1)


def argmax_highest_of_ties(logits, group):
    columns = logits.shape[-1]
    best, index = logits.max(-1)
    top = best.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    candidate = torch.where(best == top, index + dist.get_rank(group) * columns,
                            torch.full_like(index, -1))
    dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=group)
    return candidate


def argmax_as_floats(logits, group):
    columns = logits.shape[-1]
    best, index = logits.max(-1)
    top = best.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    candidate = torch.where(best == top, (index + dist.get_rank(group) * columns).float(),
                            torch.full_like(best, float("inf")))
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=group)
    return candidate


def parallelize_block(block, mesh):
    kv_heads, t = block.attention.kv_heads, mesh.size()
    if kv_heads % t:
        raise ValueError(f"{kv_heads} key-value heads do not split over {t} ranks")
    gathered = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    parallelize_module(block, mesh, {
        "attention_norm": SequenceParallel(), "attention": gathered,
        "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(),
        "attention.v": ColwiseParallel(), "attention.o": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(), "mlp": gathered,
        "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1))})


def _plan(**changes):
    plan = {"attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                            desired_input_layouts=(Replicate(),)),
            "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(),
            "attention.v": ColwiseParallel(),
            "attention.o": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                      desired_input_layouts=(Replicate(),)),
            "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1))}
    for name, style in changes.items():
        name = name.replace("__", ".")
        if style is None:
            del plan[name]
        else:
            plan[name] = style
    return plan


def plan_without_refusal(block, mesh):
    parallelize_module(block, mesh, _plan())


def plan_refusing_whenever_heads_are_shared(block, mesh):
    if block.attention.kv_heads != block.attention.heads:
        raise ValueError("grouped-query attention does not split")
    parallelize_module(block, mesh, _plan())


def plan_without_gate(block, mesh):
    parallelize_module(block, mesh, _plan(mlp__gate=None))


def plan_gate_row_parallel(block, mesh):
    parallelize_module(block, mesh, _plan(mlp__gate=RowwiseParallel(output_layouts=Shard(1))))


def plan_without_sequence_parallel(block, mesh):
    parallelize_module(block, mesh, _plan(attention_norm=None, mlp_norm=None))


def plan_returning_a_dtensor(block, mesh):
    parallelize_module(block, mesh, _plan(
        mlp__down=RowwiseParallel(output_layouts=Shard(1), use_local_output=False)))


REFERENCE = {"11.1": vocab_parallel_argmax, "11.2": parallelize_block}
MISTAKES = {
    "11.1": [(argmax_local_ids, "fail", "add the rank's first id"),
             (argmax_by_gathering, "fail", "do not gather the logits"),
             (argmax_gathering_through_the_backend, "fail", "do not gather the logits"),
             (argmax_highest_of_ties, "fail", "tokens wrong"),
             (argmax_as_floats, "fail", "expected whole token ids")],
    "11.2": [(plan_without_refusal, "fail", "your function went ahead"),
             (plan_refusing_whenever_heads_are_shared, "fail", "yet your function raised"),
             (plan_without_gate, "fail", "mlp.gate.weight is not split"),
             (plan_gate_row_parallel, "fail", "mlp.gate.weight is placed (Shard(dim=1))"),
             (plan_without_sequence_parallel, "fail", "attention_norm.weight is not split"),
             (plan_returning_a_dtensor, "error", "got mixed torch.Tensor and DTensor")],
}
