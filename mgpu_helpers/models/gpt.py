"""A small decoder-only transformer (GPT), the model of Part III.

Token and position embeddings, a ``ModuleList`` of pre-norm blocks (layer norm, causal
multi-head self-attention through ``F.scaled_dot_product_attention``, layer norm, MLP,
each with its residual connection), a final layer norm and an output head. Every size
is an argument (:class:`GPTConfig`), so the same class is the laptop model of the
chapters and, with other numbers, a real one.

Choices later chapters rely on:

* the blocks are a ``ModuleList``, so each can be sharded (``fully_shard``), wrapped
  (activation checkpointing, ``torch.compile``) or handed to a pipeline stage alone;
* the attention has four separate projections ``q``, ``k``, ``v``, ``o`` and the MLP two,
  ``up`` and ``down``, none with a bias: tensor parallelism splits ``q``, ``k``, ``v`` and
  ``up`` by columns (output features) and ``o`` and ``down`` by rows, and a fused ``qkv``
  matrix would need its columns reordered first; the heads are found from the local
  width (``view(..., -1, head_dim)``), so a rank holding half the columns runs half the
  heads unchanged;
* the head is **not tied** to the token embedding: Part III shards the two differently
  (the embedding's rows, the head's vocabulary for the loss) and puts them on different
  pipeline stages, where a shared weight would need its gradient summed across ranks;
* ``forward`` takes the positions of the tokens it sees, so a rank holding one chunk of
  a long sequence (context parallelism) embeds its tokens at their true places;
* ``activation_checkpointing = True`` runs each block under ``torch.utils.checkpoint``:
  only the block's input is kept, the rest recomputed in backward. A switch of the
  model, not a wrapper around each block, so the parameters keep their names and a
  checkpoint saved with it loads without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    """The sizes of a :class:`GPT`.

    Args:
        vocab_size: tokens the model reads and predicts.
        context: the longest sequence it takes (rows of the position embedding).
        dim: the width of the residual stream (h).
        layers: transformer blocks (L).
        heads: attention heads per block (a); ``dim`` must be a multiple.
        mlp_ratio: the MLP's hidden width over ``dim`` (4 in GPT-2).
    """

    vocab_size: int
    context: int
    dim: int = 64
    layers: int = 2
    heads: int = 4
    mlp_ratio: int = 4

    def __post_init__(self):
        for name in ("vocab_size", "context", "dim", "layers", "heads", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a whole number >= 1, got {value!r}")
        if self.dim % self.heads:
            raise ValueError(f"GPTConfig: dim {self.dim} is not a multiple of heads "
                             f"{self.heads}: each head takes dim / heads features")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


class Attention(nn.Module):
    """Causal multi-head self-attention: project to queries, keys and values, attend
    (each position to itself and those before it), project back."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.q = nn.Linear(config.dim, config.dim, bias=False)
        self.k = nn.Linear(config.dim, config.dim, bias=False)
        self.v = nn.Linear(config.dim, config.dim, bias=False)
        self.o = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (projection(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
                   for projection in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    """Two linear layers with a GELU between, ``mlp_ratio`` times wider inside."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up = nn.Linear(config.dim, config.mlp_ratio * config.dim, bias=False)
        self.down = nn.Linear(config.mlp_ratio * config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.dim)
        self.attention = Attention(config)
        self.mlp_norm = nn.LayerNorm(config.dim)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Token ids (batch x length) in, next-token scores (batch x length x vocab) out."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab_size, config.dim)
        self.positions = nn.Embedding(config.context, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.activation_checkpointing = False

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Args:
            ids: token ids, ``batch x length``.
            positions: where each of the ``length`` tokens sits in its sequence; default
                ``0 .. length-1`` (a rank holding a later chunk passes its offsets).
        """
        if positions is None:
            if ids.shape[-1] > self.config.context:
                raise ValueError(f"a sequence of {ids.shape[-1]} tokens is longer than the "
                                 f"model's context of {self.config.context}: shorten it, or "
                                 "build the model with a larger GPTConfig.context")
            positions = torch.arange(ids.shape[-1], device=ids.device)
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.norm(x))
