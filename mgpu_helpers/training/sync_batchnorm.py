"""Synchronised batch normalisation that also runs on CPU ranks (gloo).

``nn.SyncBatchNorm`` computes the batch statistics over the *global* batch (every
rank's samples) instead of each rank's own share, but refuses CPU tensors ("expected
input tensor to be on GPU"). :class:`CpuSyncBatchNorm` is the same computation written
with a differentiable ``all_reduce``, so chapter 05 can show what synchronisation changes
on any machine. On GPUs use ``nn.SyncBatchNorm.convert_sync_batchnorm``: it is faster.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _SumAcrossRanks(torch.autograd.Function):
    """all_reduce(SUM) that autograd can differentiate: the gradient of a sum over ranks
    with respect to each rank's input is the sum over ranks of the output's gradient."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class CpuSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch norm over the batch of all ranks; plain batch norm outside a process group.

    Training forward: each rank sums its samples and their squares per channel, one
    ``all_reduce`` adds them up across ranks, and every rank normalises with the global
    mean and (biased) variance. The running statistics get the unbiased global variance,
    as in ``nn.BatchNorm``. Gradients flow back through the ``all_reduce``, so each rank's
    input gradient is the one single-process batch norm would give on the global batch.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        group = dist.group.WORLD
        synced = (self.training and dist.is_available() and dist.is_initialized()
                  and dist.get_world_size(group) > 1)
        if not synced:
            return super().forward(input)
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        count = torch.tensor([input.numel() / channels], dtype=input.dtype,
                             device=input.device)
        stats = torch.cat([input.sum(dims), (input * input).sum(dims), count])
        stats = _SumAcrossRanks.apply(stats, group)
        total = stats[-1]
        mean = stats[:channels] / total
        var = stats[channels:2 * channels] / total - mean * mean
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), total.item())
        shape = (1, channels) + (1,) * (input.dim() - 2)
        output = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            output = output * self.weight.view(shape) + self.bias.view(shape)
        return output

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor,
                              total: float) -> None:
        self.num_batches_tracked += 1
        factor = (1.0 / self.num_batches_tracked.item() if self.momentum is None
                  else self.momentum)
        unbiased = var * total / max(total - 1, 1)
        self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every ``BatchNorm1d/2d/3d`` in ``module`` by :class:`CpuSyncBatchNorm`,
    keeping its parameters, running statistics and settings (like
    ``nn.SyncBatchNorm.convert_sync_batchnorm``, which only runs on GPUs)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
            module, (CpuSyncBatchNorm, nn.SyncBatchNorm)):
        synced = CpuSyncBatchNorm(module.num_features, module.eps, module.momentum,
                                  module.affine, module.track_running_stats)
        synced.load_state_dict(module.state_dict())
        tensors = [*module.parameters(), *module.buffers()]
        if tensors:
            synced.to(tensors[0].device)
        synced.train(module.training)
        return synced
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child))
    return module
