"""What training a :class:`~mgpu_helpers.models.gpt.GPT` costs, predicted from its sizes.

Chapter 10 checks each formula against a measurement that does not use it (PyTorch's
FLOP counter, the bytes autograd saves, the bytes the optimizer allocates); chapter 14's
planner predicts configurations with them. Notation: h the width (``dim``), L the
blocks, a the heads, r the MLP ratio, V the vocabulary, b sequences of s tokens.

* Parameters: an embedding row per token and per position, per block ``(4 + 2r)·h²``
  matrices (``q, k, v, o, up, down``) and two layer norms (``2h`` each), a final norm,
  the head ``V·h``.
* FLOPs of one training step (forward and backward) per token:
  ``6·N + 12·L·s·h``, where N counts the parameters of matrix products (every matrix
  but the embeddings, which are lookups): 2 FLOPs per weight per token forward, 4
  backward. The second term is attention's two products without weights (``q·kᵀ`` and
  the probabilities times ``v``) forward and their four gradient products backward,
  over the **full** s x s square: the convention MFU is quoted in (PaLM, appendix B) and
  what ``FlopCounterMode`` counts for the MATH kernel. The fused kernels GPUs run
  (flash, memory-efficient, cuDNN) recompute ``q·kᵀ`` in backward, and the counter
  charges them ``14·L·s·h``; a causal kernel also skips the masked half, so the work it
  really does is about ``6·N + 7·L·s·h``.
* Activations kept for the backward pass, per block: ``(8 + 2r)·b·s·h`` elements, eight
  tensors the size of the residual stream (the block's input, the two normalised
  inputs, q, k, v, the attention's output, the residual between attention and MLP) and
  two r times wider (the MLP's hidden layer before and after GELU): ``16·b·s·h`` for
  r = 4. Plus, per token, the layer norms' means and reciprocal standard deviations (4
  elements) and attention's log-sum-exp (``a`` float32 numbers): the scaled-dot-product
  kernels that keep no s x s matrix (flash and memory-efficient attention; PyTorch's CPU
  default) keep only those. Exact on CPUs, where the chapter measures it. On CUDA a few
  bytes per token more: the layer norms' statistics stay float32 under bfloat16, the
  memory-efficient kernel pads its log-sum-exp to a multiple of 32 tokens, and the
  fused kernels keep a random seed and offset. Korthikanti et al. (2022) count
  ``34·s·b·h + 5·a·s²·b`` bytes at 2 bytes an element for r = 4, with dropout: its two
  s·b·h masks (1 byte an element) are 2 of the 34, and ``5·a·s²·b`` is attention's
  s x s softmax output (2 bytes), dropout mask (1) and dropout output (2), kept by an
  attention that materialises its scores. Without dropout and with a fused kernel theirs
  is ``32·s·b·h`` bytes, 16 elements: this one.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.gpt import GPTConfig

FLOAT32_BYTES = 4


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up: what the largest of ``b`` shards of ``a`` holds."""
    return -(-a // b)


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter a GPU holds for the weights, their gradients and AdamW's state
    (before any sharding), and ``copies``: bytes per parameter of the matrix products for
    the 16-bit copies of their weights that live through the step where the weights are
    whole on every GPU (autocast's, under DDP and ZeRO-1/2; FSDP2's gathered copies are
    counted in its working set instead). ``activation``: bytes per activation element."""

    name: str
    weight: int
    gradient: int
    optimizer: int
    copies: int = 0
    activation: int = 2


#: The ZeRO paper's mixed precision (Rajbhandari et al., 2020, section 3.1: 2 + 2 + 12
#: bytes a parameter, "16Ψ"): 16-bit weights and gradients, and in the optimizer float32
#: master weights and Adam's two float32 moments. The planner's and the strategy map's
#: default.
MIXED = Precision("ZeRO paper: 16-bit weights and gradients, float32 master weights and "
                  "Adam moments", 2, 2, 12)
#: PyTorch's own mixed precision: float32 weights, gradients and Adam moments (4 + 4 + 8),
#: and bfloat16 copies of the weights for the matrix products: FSDP2 with
#: ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
#: gathers them a block at a time (its working set); under DDP (and
#: ZeroRedundancyOptimizer) ``torch.autocast`` makes them, a matrix product keeping its
#: weight's copy for the backward pass and autocast caching the copies until its ``with``
#: block ends (``copies``).
PYTORCH = Precision("PyTorch: float32 state, bfloat16 copies for the matrix products",
                    4, 4, 8, 2)
#: Megatron-LM's default mixed precision: bfloat16 weights, float32 gradients (its
#: "main grads", accumulated and reduced in float32), float32 master weights and Adam
#: moments: 2 + 4 + 12 = 18 bytes a parameter (Megatron-Core's distributed optimizer
#: documentation; with ``--use-distributed-optimizer`` the 12, and the gradients' share,
#: are sharded over the data-parallel ranks).
MEGATRON = Precision("Megatron-LM: bfloat16 weights, float32 gradients, float32 master "
                     "weights and Adam moments", 2, 4, 12)
#: Everything in float32, activations too: the workbook's CPU runs.
FLOAT32 = Precision("float32 throughout", 4, 4, 8, 0, 4)


def parameter_counts(config: GPTConfig) -> dict[str, int]:
    """Parameters per component of the model, as ``GPT(config)`` holds them."""
    h, r, layers = config.dim, config.mlp_ratio, config.layers
    return {
        "token embedding": config.vocab_size * h,
        "position embedding": config.context * h,
        "attention (q, k, v, o)": layers * 4 * h * h,
        "MLP (up, down)": layers * 2 * r * h * h,
        "layer norms": layers * 2 * 2 * h + 2 * h,
        "head": config.vocab_size * h,
    }


def matmul_parameters(config: GPTConfig) -> int:
    """N of the 6N rule: the parameters that take part in matrix products."""
    counts = parameter_counts(config)
    return counts["attention (q, k, v, o)"] + counts["MLP (up, down)"] + counts["head"]


def training_flops_per_token(config: GPTConfig, length: int) -> int:
    """FLOPs of a forward and backward pass per token of a ``length``-token sequence,
    attention counted over the full square (``FlopCounterMode``'s convention)."""
    return 6 * matmul_parameters(config) + 12 * config.layers * length * config.dim


def activation_bytes_per_block(config: GPTConfig, batch: int, length: int,
                               element_bytes: int = FLOAT32_BYTES) -> int:
    """Bytes one block keeps for its backward pass, with an attention kernel that keeps
    no s x s matrix; ``element_bytes`` 4 in float32, 2 in bfloat16. Exact on CPUs; on
    CUDA a few bytes per token more (see the module's notes)."""
    tokens = batch * length
    stream = (8 + 2 * config.mlp_ratio) * config.dim
    return tokens * (stream * element_bytes + 4 * element_bytes + config.heads * FLOAT32_BYTES)


def activation_bytes(config: GPTConfig, batch: int, length: int,
                     element_bytes: int = FLOAT32_BYTES) -> int:
    """Bytes the whole model keeps for its backward pass (the loss's own excluded): the
    blocks, the final layer norm (its input, output and statistics) and the token ids
    the two embeddings keep (int64; the position ids once per sequence position)."""
    tokens = batch * length
    final_norm = tokens * (2 * config.dim * element_bytes + 2 * element_bytes)
    ids = 8 * (tokens + length)
    return (config.layers * activation_bytes_per_block(config, batch, length, element_bytes)
            + final_norm + ids)


def training_state_bytes(parameters: int, shards: int = 1, weight_bytes: int = 4,
                         gradient_bytes: int = 4, optimizer_bytes: int = 8) -> int:
    """Bytes a rank holds for ``parameters`` after an AdamW step, when weights, gradients
    and the optimizer's two moments are split over ``shards`` ranks (1 for DDP, the
    shard group for FSDP2 and HSDP). The defaults are float32 training, 16 bytes a
    parameter; mixed precision as the ZeRO paper counts it is 2 + 2 + 12, the same 16."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    per_parameter = weight_bytes + gradient_bytes + optimizer_bytes
    return ceil_div(parameters, shards) * per_parameter


def ring_bytes_sent(kind: str, nbytes: int, world: int) -> float:
    """Bytes each rank sends for one collective on a ring of ``world`` ranks, ``nbytes``
    being what it contributes (what ``labs.comm_log.CollectivesLogged`` records); a point-to-point
    ``send`` sends its message, a ``recv`` nothing; an all-to-all keeps its own
    ``1/N`` and sends the rest."""
    if world < 1:
        raise ValueError(f"a ring needs at least one rank, got world={world}")
    if kind in ("send", "recv"):
        return float(nbytes) if kind == "send" else 0.0
    if kind == "all_reduce":
        return 2 * (world - 1) / world * nbytes
    if kind == "all_gather":
        return (world - 1) * nbytes
    if kind in ("reduce_scatter", "all_to_all"):
        return (world - 1) / world * nbytes
    raise ValueError(f"no ring formula for {kind!r}: expected all_reduce, all_gather, "
                     "reduce_scatter, all_to_all, send or recv")
