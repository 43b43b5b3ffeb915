"""Chapter 07's ZeRO-3 from scratch: a linear layer whose parameters, gradients and
optimizer state live in 1/N shards, one per rank.

Each rank stores a flat shard of the layer's weight and bias (padded so that N shards
are equal). The forward pass all-gathers the full parameters, computes, and lets them
go; the backward pass all-gathers them again, computes the gradients, and
reduce-scatters the parameter gradient, so each rank receives the averaged gradient of
its own shard only. The optimizer then updates each rank's shard. Per step, each layer
therefore runs two all-gathers and one reduce-scatter of its parameters: a volume of 3Ψ
against DDP's one all-reduce, 2Ψ (FSDP's 1.5x), on a backend with a true reduce-scatter
(NCCL). Gloo runs the single-tensor reduce-scatter as an all-reduce of the whole
gradient, so there it is 4Ψ. :func:`train_sharded_and_ddp` reads what ran from the
flight recorder.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..measure.flight_recorder import collectives_so_far
from .memory import collectives_volume

# the single-tensor collectives, under the names this PyTorch has (recent releases renamed
# all_gather_into_tensor and reduce_scatter_tensor)
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class _ShardedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, layer):
        weight, bias = layer.unflatten(layer.gather(shard))  # full parameters, briefly
        ctx.save_for_backward(x, shard)  # the shard is saved, not the gathered weight
        ctx.layer = layer
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, shard = ctx.saved_tensors
        layer = ctx.layer
        weight, _ = layer.unflatten(layer.gather(shard))  # gathered again for backward
        rows, inputs = grad_output.reshape(-1, grad_output.shape[-1]), x.reshape(-1, x.shape[-1])
        full_gradient = layer.flatten(rows.T @ inputs, rows.sum(0))
        gradient = torch.empty_like(shard)
        REDUCE_SCATTER(gradient, full_gradient, op=dist.ReduceOp.SUM)
        return grad_output @ weight, gradient / dist.get_world_size(), None


class ShardedLinear(nn.Module):
    """``nn.Linear`` with ZeRO-3 sharding inside a process group: this rank keeps
    ``shard``, 1/N of the flattened weight and bias (padded so that N shards are equal)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        world, rank = dist.get_world_size(), dist.get_rank()
        self.out_features, self.in_features = linear.weight.shape
        self.numel = linear.weight.numel() + linear.bias.numel()
        shard_size = math.ceil(self.numel / world)
        flat = self.flatten(linear.weight.detach(), linear.bias.detach())
        flat = F.pad(flat, (0, shard_size * world - self.numel))
        self.shard = nn.Parameter(flat[rank * shard_size:(rank + 1) * shard_size].clone())

    def flatten(self, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        flat = torch.cat([weight.flatten(), bias])
        padded = self.shard.numel() * dist.get_world_size() if hasattr(self, "shard") else 0
        return F.pad(flat, (0, max(0, padded - flat.numel())))

    def unflatten(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight_numel = self.out_features * self.in_features
        return (flat[:weight_numel].view(self.out_features, self.in_features),
                flat[weight_numel:self.numel])

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        full = shard.new_empty(shard.numel() * dist.get_world_size())
        ALL_GATHER(full, shard.detach())
        return full

    def full_parameters(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The full weight and bias (an all-gather), for checks."""
        weight, bias = self.unflatten(self.gather(self.shard))
        return weight.clone(), bias.clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ShardedLinearFunction.apply(x, self.shard, self)


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def _batch(step: int, rank: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(size, 32, generator=generator), torch.randint(0, 10, (size,),
                                                                     generator=generator)


def train_sharded_and_ddp(steps: int = 3, lr: float = 1e-2) -> dict:
    """Inside a rank: the same small MLP trained ``steps`` Adam steps on this rank's
    batches twice, as ZeRO-3 (:class:`ShardedLinear` layers) and under DDP. Returns both
    models' full parameters, the bytes each stores on this rank (parameters, gradients,
    Adam's moments), the parameter count Ψ and the collectives of the last step as the
    flight recorder saw them (per kind: calls, and volume in elements as
    :func:`~mgpu_helpers.labs.memory.collectives_volume` counts it)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    sharded = nn.Sequential(*(ShardedLinear(m) if isinstance(m, nn.Linear) else m
                              for m in _mlp()))
    ddp = DDP(_mlp())
    results = {}
    for name, model in (("ZeRO-3", sharded), ("DDP", ddp)):
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        for step in range(steps):
            x, y = _batch(step, dist.get_rank())
            before = len(collectives_so_far())
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        last_step = collectives_volume(collectives_so_far()[before:])
        params = list(model.parameters())
        stored = {"parameters": sum(p.numel() * p.element_size() for p in params),
                  "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params),
                  "optimizer state": sum(t.numel() * t.element_size()
                                         for state in optimizer.state.values()
                                         for t in state.values() if t.dim() > 0)}
        if name == "ZeRO-3":
            full = [t for m in model if isinstance(m, ShardedLinear) for t in m.full_parameters()]
        else:
            full = [p.detach().clone() for p in model.module.parameters()]
        results[name] = {"weights": full, "stored": stored, "collectives": last_step,
                         "parameter count": sum(p.numel() for p in full)}
    return results
