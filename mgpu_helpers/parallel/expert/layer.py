"""The mixture-of-experts layer (chapter 13, sections 1 and 2): a router sends each token
to its top-k experts, whose outputs are weighted back together."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    """One expert: an MLP from ``dim`` to ``hidden`` and back."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """``experts`` experts, each token sent to its ``top_k``; with ``capacity_factor``, an
    expert keeps at most that factor times its even share of the assignments. After each
    forward: ``aux_loss`` (the load-balancing loss), ``tokens_per_expert``, ``dropped``."""

    def __init__(self, dim, hidden, experts, top_k, capacity_factor=None):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(experts))
        self.top_k, self.capacity_factor = top_k, capacity_factor

    def route(self, x):  # x: (tokens, dim) -> weights and chosen experts, (tokens, k) each
        probabilities = self.router(x).softmax(-1)
        weights, chosen = probabilities.topk(self.top_k, -1)
        experts = probabilities.shape[-1]
        load = torch.bincount(chosen.flatten(), minlength=experts)
        share = load.float() / chosen.numel()  # f_e (not differentiable: counts)
        self.aux_loss = experts * (share * probabilities.mean(0)).sum()
        self.tokens_per_expert = load
        return weights / weights.sum(-1, keepdim=True), chosen

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = self.route(x)
        capacity = math.inf if self.capacity_factor is None else \
            math.ceil(self.capacity_factor * chosen.numel() / len(self.experts))
        out, self.dropped = torch.zeros_like(x), 0
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)  # in token order
            if len(token) > capacity:  # the first `capacity` assignments are kept
                self.dropped += len(token) - capacity
                token, slot = token[:capacity], slot[:capacity]
            # an expert with no token still runs (on nothing): its gradient is zeros, not None
            out.index_add_(0, token, weights[token, slot, None] * expert(x[token]))
        return out.reshape(shape)
