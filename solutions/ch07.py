"""Chapter 07: reference solutions and plausible mistakes."""

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _Zero1:
    def __init__(self, params, lr, owners, shard_everything=False, sync=True):
        self.params, self.owners, self.sync = params, owners, sync
        rank = dist.get_rank()
        mine = params if shard_everything else [
            p for p, owner in zip(params, owners, strict=True) if owner == rank]
        self.adam = torch.optim.Adam(mine, lr=lr)

    def step(self):
        self.adam.step()
        if self.sync:
            for p, owner in zip(self.params, self.owners, strict=True):
                dist.broadcast(p.data, src=owner)


def _balanced_owners(params, world):
    # the largest parameters first, each to the rank that holds the fewest elements so far
    load, owners = [0] * world, [0] * len(params)
    for index in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        owner = load.index(min(load))
        owners[index] = owner
        load[owner] += params[index].numel()
    return owners


def zero1_adam(params, lr):
    params = list(params)
    return _Zero1(params, lr, _balanced_owners(params, dist.get_world_size()))


def largest_models(bytes_per_rank, ranks):
    per_parameter = {"DDP": 4 + 4 + 8, "ZeRO-1": 4 + 4 + 8 / ranks,
                     "ZeRO-2": 4 + (4 + 8) / ranks, "ZeRO-3": (4 + 4 + 8) / ranks}
    return {stage: int(bytes_per_rank // cost) for stage, cost in per_parameter.items()}


class _CopyToShards(torch.autograd.Function):
    """Identity forward; backward sums x's partial gradients over the ranks."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _SumShards(torch.autograd.Function):
    """All-reduce forward; backward passes the (replicated) gradient through."""

    @staticmethod
    def forward(ctx, partial):
        total = partial.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


def tp_feed_forward(x, w1, b1, w2, b2):
    if x.requires_grad:
        x = _CopyToShards.apply(x)
    hidden = F.relu(F.linear(x, w1, b1))         # column-parallel: my hidden features
    return _SumShards.apply(F.linear(hidden, w2)) + b2  # row-parallel: sum, then b2 once


# Plausible mistakes -------------------------------------------------------------------

def zero1_adam_that_shards_nothing(params, lr):
    """Every rank keeps Adam's state for every parameter: right weights, nothing saved."""
    params = list(params)
    return _Zero1(params, lr, _balanced_owners(params, dist.get_world_size()),
                  shard_everything=True)


def zero1_adam_without_sync(params, lr):
    """Each rank updates its own share and never sends it: the replicas drift apart."""
    params = list(params)
    return _Zero1(params, lr, _balanced_owners(params, dist.get_world_size()), sync=False)


class _Zero1AveragingAgain(_Zero1):
    """Sums the gradients over the ranks once more before stepping, as if step() received
    each rank's own: Adam steps on N times the averaged gradient."""

    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad)
        super().step()


def zero1_adam_summing_the_gradients_again(params, lr):
    params = list(params)
    return _Zero1AveragingAgain(params, lr, _balanced_owners(params, dist.get_world_size()))


def zero1_adam_from_torch(params, lr):
    """torch's own ZeroRedundancyOptimizer: ZeRO-1, not written."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(list(params), torch.optim.Adam, lr=lr)


def largest_models_with_whole_byte_shards(bytes_per_rank, ranks):
    """Integer division of the sharded bytes: 8 // 3 == 2."""
    per_parameter = {"DDP": 16, "ZeRO-1": 8 + 8 // ranks, "ZeRO-2": 4 + 12 // ranks,
                     "ZeRO-3": 16 // ranks}
    return {stage: bytes_per_rank // cost for stage, cost in per_parameter.items()}


def largest_models_where_zero1_shards_gradients(bytes_per_rank, ranks):
    """Takes ZeRO-1 for ZeRO-2: it shards only the optimizer state."""
    per_parameter = {"DDP": 16, "ZeRO-1": 4 + 12 / ranks, "ZeRO-2": 4 + 12 / ranks,
                     "ZeRO-3": 16 / ranks}
    return {stage: int(bytes_per_rank // cost) for stage, cost in per_parameter.items()}


def largest_models_nan(bytes_per_rank, ranks):
    """nan for every stage (0 / 0 somewhere): no comparison with nan is true."""
    return {stage: float("nan") for stage in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")}


def tp_feed_forward_bias_on_every_rank(x, w1, b1, w2, b2):
    """Adds b2 to each partial sum: the all-reduce adds it N times."""
    hidden = F.relu(F.linear(x, w1, b1))
    return _SumShards.apply(F.linear(hidden, w2, b2))


def tp_feed_forward_forward_only(x, w1, b1, w2, b2):
    """Right output and weight gradients; x's gradient stays this rank's partial sum."""
    return _SumShards.apply(F.linear(F.relu(F.linear(x, w1, b1)), w2)) + b2


# Other correct solutions --------------------------------------------------------------

def largest_models_numpy(bytes_per_rank, ranks):
    """NumPy's integers: numbers like any other."""
    import numpy as np

    return {stage: np.int64(count) for stage, count in
            largest_models(bytes_per_rank, ranks).items()}


def tp_feed_forward_in_float64(x, w1, b1, w2, b2):
    """Computes in float64 and returns a float64 output (the gradients stay float32:
    autograd casts them back to each shard's dtype)."""
    return tp_feed_forward(x.double(), w1.double(), b1.double(), w2.double(), b2.double())


REFERENCE = {"07.1": zero1_adam, "07.2": largest_models, "07.3": tp_feed_forward}
# exercise -> other correct solutions, which must pass too
ALTERNATIVES = {"07.2": [largest_models_numpy], "07.3": [tp_feed_forward_in_float64]}
# exercise -> (wrong solution, the status it must get, a phrase its report must contain)
MISTAKES = {
    "07.1": [(zero1_adam_that_shards_nothing, "fail", "no memory saved"),
             (zero1_adam_without_sync, "fail", "differ from plain Adam's"),
             (zero1_adam_summing_the_gradients_again, "fail",
              "exp_avg) on this rank is 2 times plain Adam's"),
             (zero1_adam_from_torch, "fail", "the exercise is to write ZeRO-1 yourself")],
    "07.2": [(largest_models_with_whole_byte_shards, "fail", "ZeRO-1: expected 1,610,612,736"),
             (largest_models_where_zero1_shards_gradients, "fail", "ZeRO-1: expected"),
             (largest_models_nan, "fail", "got nan (not a finite number)")],
    "07.3": [(tp_feed_forward_bias_on_every_rank, "fail", "the output differs"),
             (tp_feed_forward_forward_only, "fail", "the gradient of x differs")],
}
