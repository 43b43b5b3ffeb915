"""Chapter 14's planner: a training configuration's memory, time and MFU, predicted.

:func:`predict` takes a :class:`Model` (a decoder-only transformer's sizes), a
:class:`Cluster` (GPUs, their memory and speed, the links between them) and a
:class:`Plan` (how many GPUs each parallelism takes, the micro-batches, ZeRO's stage,
recomputation) and returns a :class:`Prediction`: bytes per GPU by component, the
step's compute, each parallelism's communication (its time, and the part no
computation hides), the pipeline's bubble, the step time and the MFU.

Everything is the workbook's own formulas, each checked in its chapter against a run:

* parameters, FLOPs (``6·N + 12·L·s·h`` a token, attention over the full square: the
  convention MFU is quoted in) and activations (chapter 10, :mod:`mgpu_helpers.planning.costs`),
  generalised to grouped-query attention, a gated MLP and experts;
* what each ZeRO stage shards (chapter 07), what a rank keeps under TP with SP (chapter
  11), CP's 1/c of the tokens (chapter 12), the experts over EP (chapter 13), the
  pipeline's micro-batches in flight and its bubble ``(p-1)/(m+p-1)`` (chapter 06);
* each collective priced by chapter 03's ring model: ``steps·α + bytes_sent/B``.

The mesh is laid out as torchtitan lays it, outermost first ``pp, dp, cp, tp``: TP's
ranks are neighbours, so TP stays inside a node while ``tp <= gpus_per_node``; a
group whose ranks span nodes runs at the inter-node bandwidth (its slowest link). EP
takes its ranks from ``dp x cp`` (torchtitan's way), and the experts are not split by TP.

Assumptions, stated once (each is a choice real frameworks also offer):

* sequence parallelism wherever ``tp > 1``; activations of ``precision.activation``
  bytes (bfloat16 by default); the loss's logits in float32 on the last stage;
* ZeRO's shard group is ``dp x cp`` (the ranks that hold the same slice of the model).
  ZeRO-3 without a pipeline is FSDP2's default: it gathers the weights for each
  micro-batch's forward and backward and reduce-scatters after each backward. Under a
  pipeline it does what ``PipelineStage`` asks of FSDP2: no resharding or gradient sync
  until the last micro-batch, so it gathers for each forward and once for the backward
  passes, reduce-scatters once, and holds the stage's weights and gradients whole
  meanwhile (:func:`stage_memory`);
* what overlaps: data-parallel traffic hides behind the step's compute, CP's ring
  behind attention's compute; TP, EP and the pipeline's sends are on the critical path
  (async TP and Megatron's overlap options hide part of TP's: not modelled);
* a micro-batch takes the same time on every stage (the layers split evenly); the
  embedding and head sit on the first and last stage and add memory there, not time;
* compute runs at ``efficiency`` x the GPU's peak: the planner predicts how far below
  that the step falls, not how fast the kernels are. Time counts attention as a causal
  fused kernel does it (:data:`ATTENTION_TIME_FLOPS`); MFU counts the model's FLOPs with
  the full square, the convention it is quoted in.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.gpt import GPTConfig
from . import costs
from .costs import MIXED, Precision, ceil_div

GB = 10**9
ACTIVATION_BYTES = 2   # bfloat16 activations
LOGIT_BYTES = 4        # the loss's logits in float32
FLOAT32_BYTES = 4
#: Attention's FLOPs a token per layer and unit of s·h that a causal fused kernel does in
#: a training step (chapter 10): forward 2, backward 5 (q·kᵀ recomputed), half the square.
ATTENTION_TIME_FLOPS = 7


def _whole(name: str, value, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
    return value


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer's sizes.

    Args:
        name: what tables call it.
        layers, dim, heads: L, h, a.
        ffn: the MLP's hidden width (each expert's, for a mixture of experts).
        vocab: the vocabulary (rows of the embedding, columns of the head; not tied).
        kv_heads: key-value heads (grouped-query attention); default ``heads``.
        gated: a gated MLP (SwiGLU: gate, up and down matrices) rather than up and down.
        norm_parameters: 2 for LayerNorm (weight and bias), 1 for RMSNorm.
        positions: rows of a learned position embedding (0 with rotary embeddings).
        experts, top_k: experts per MLP and how many each token visits (1, 1: dense).
    """

    name: str
    layers: int
    dim: int
    heads: int
    ffn: int
    vocab: int
    kv_heads: int | None = None
    gated: bool = False
    norm_parameters: int = 2
    positions: int = 0
    experts: int = 1
    top_k: int = 1

    def __post_init__(self):
        for name in ("layers", "dim", "heads", "ffn", "vocab", "experts", "top_k"):
            _whole(f"Model.{name}", getattr(self, name))
        _whole("Model.positions", self.positions, least=0)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        _whole("Model.kv_heads", self.kv_heads)
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"Model {self.name!r}: dim ({self.dim}) must be a multiple of "
                             f"heads ({self.heads}), and heads of kv_heads ({self.kv_heads})")
        if self.norm_parameters not in (1, 2):
            raise ValueError(f"Model {self.name!r}: norm_parameters is 2 (LayerNorm) or 1 "
                             f"(RMSNorm), got {self.norm_parameters!r}")
        if self.top_k > self.experts:
            raise ValueError(f"Model {self.name!r}: top_k ({self.top_k}) exceeds experts "
                             f"({self.experts})")

    @classmethod
    def from_gpt(cls, config: GPTConfig, name: str = "workbook GPT") -> Model:
        """The workbook's GPT (LayerNorm, GELU MLP, learned positions, untied head)."""
        return cls(name, config.layers, config.dim, config.heads,
                   config.mlp_ratio * config.dim, config.vocab_size,
                   positions=config.context)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.dim // self.heads)

    @property
    def moe(self) -> bool:
        return self.experts > 1

    def attention_parameters(self) -> int:
        """q and o (h x h), k and v (h x kv_dim), per layer."""
        return 2 * self.dim * self.dim + 2 * self.dim * self.kv_dim

    def expert_parameters(self) -> int:
        """One MLP (one expert's), per layer."""
        return (3 if self.gated else 2) * self.dim * self.ffn

    def parameters(self) -> dict[str, int]:
        """Parameters per component (the router is ``h x experts`` a layer)."""
        h, layers = self.dim, self.layers
        counts = {
            "embeddings": (self.vocab + self.positions) * h,
            "attention": layers * self.attention_parameters(),
            "MLP / experts": layers * self.experts * self.expert_parameters(),
            "norms": (2 * layers + 1) * self.norm_parameters * h,
            "head": self.vocab * h,
        }
        if self.moe:
            counts["routers"] = layers * h * self.experts
        return counts

    def total_parameters(self) -> int:
        return sum(self.parameters().values())

    def active_matmul_parameters(self) -> int:
        """N of the 6N rule: the weights one token's matrix products use (``top_k``
        experts of each MLP, the router, the head; not the embeddings, lookups)."""
        per_layer = (self.attention_parameters() + self.top_k * self.expert_parameters()
                     + (self.dim * self.experts if self.moe else 0))
        return self.layers * per_layer + self.vocab * self.dim

    def flops_per_token(self, length: int) -> int:
        """Training FLOPs (forward and backward) per token of ``length``-token sequences,
        attention over the full square (chapter 10; PaLM's appendix B)."""
        return 6 * self.active_matmul_parameters() + 12 * self.layers * length * self.dim

    def layer_activation_elements(self, tokens: int, tp: int = 1,
                                  element_bytes: int = ACTIVATION_BYTES) -> float:
        """Elements one layer keeps for its backward pass for ``tokens`` tokens on each of
        ``tp`` ranks with SP (chapter 10's count generalised; chapter 11's split): the
        block's input, residual, two norm outputs, attention output (h each), q (h), k
        and v (kv_dim each), the MLP's hidden tensors (2 x ffn, or 4 x ffn gated: gate,
        up, the activation and the product) for each of ``top_k`` experts; per token the
        norms' statistics and attention's float32 log-sum-exp, in elements of
        ``element_bytes``. With
        tp > 1 the two gathered norm outputs stay whole, the rest splits."""
        h = self.dim
        stream = 6 * h + 2 * self.kv_dim + self.top_k * (4 if self.gated else 2) * self.ffn
        extra = 2 * self.norm_parameters + self.heads * FLOAT32_BYTES / element_bytes
        whole = tokens * (stream + extra)
        if tp == 1:
            return whole
        gathered = 2 * tokens * h
        return gathered + (whole - gathered) / tp


#: Published shapes: Llama 2 7B (Touvron et al., 2023, and its config.json: 32 layers,
#: h 4096, 32 heads, SwiGLU 11008, vocabulary 32000) and Llama 3 (Llama Team, "The Llama 3
#: Herd of Models", 2024, Table 3: 8B 32 x 4096, ffn 14336; 70B 80 x 8192, ffn 28672;
#: 405B 126 x 16384, ffn 53248; 8 key-value heads; vocabulary 128,256). RMSNorm, rotary
#: positions (no position table), untied heads.
LLAMA2_7B = Model("Llama 2 7B", 32, 4096, 32, 11008, 32000, gated=True, norm_parameters=1)
LLAMA3_8B = Model("Llama 3 8B", 32, 4096, 32, 14336, 128256, kv_heads=8, gated=True,
                  norm_parameters=1)
LLAMA3_70B = Model("Llama 3 70B", 80, 8192, 64, 28672, 128256, kv_heads=8, gated=True,
                   norm_parameters=1)
LLAMA3_405B = Model("Llama 3 405B", 126, 16384, 128, 53248, 128256, kv_heads=8, gated=True,
                    norm_parameters=1)
#: Mixtral 8x7B (Jiang et al., "Mixtral of Experts", 2024, Table 1): Mistral 7B's shape
#: with 8 SwiGLU experts per layer, 2 per token.
MIXTRAL_8X7B = Model("Mixtral 8x7B", 32, 4096, 32, 14336, 32000, kv_heads=8, gated=True,
                     norm_parameters=1, experts=8, top_k=2)
PUBLISHED = (LLAMA2_7B, LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, MIXTRAL_8X7B)


@dataclass(frozen=True)
class Cluster:
    """GPUs and their links. Bandwidths are per GPU, one direction, as a ring uses them."""

    name: str
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float = 0.0
    inter_latency: float = 0.0


#: An H100 SXM node as NVIDIA's data sheet gives it: 80 GB, 989 TFLOP/s dense bfloat16,
#: NVLink 4 at 900 GB/s per GPU (both directions: 450 GB/s for a ring), and one 400 Gb/s
#: InfiniBand NDR adapter per GPU (50 GB/s). Latencies: a few microseconds per ring step,
#: an order of magnitude, not a measurement (chapter 11 takes 0 at these sizes).
H100_NODES = Cluster("H100 SXM nodes (NVLink 4, NDR InfiniBand)", 8, 80 * GB, 989e12,
                     450e9, 50e9, intra_latency=3e-6, inter_latency=10e-6)


@dataclass(frozen=True)
class Plan:
    """How a step is spread: GPUs = ``dp x cp x tp x pp``.

    Args:
        dp, tp, pp, cp: degrees of data, tensor (with sequence), pipeline and context
            parallelism. ep: expert parallelism, ranks taken from ``dp x cp``.
        zero: ZeRO's stage over ``dp x cp``: 0 (DDP), 1, 2, 3 (FSDP2).
        micro_batch: sequences per micro-batch on each data-parallel rank.
        micro_batches: micro-batches per step (the pipeline's m; gradient accumulation
            without a pipeline).
        schedule: ``"1f1b"`` (a stage keeps at most pp micro-batches) or ``"gpipe"``
            (all m).
        virtual_stages: v > 1 is interleaved 1F1B: each GPU holds v chunks of the
            layers; the bubble shrinks to ``(p-1)/(v·m)`` of the compute, and the first
            stage keeps ``min(v·m, v·p + p - 1)`` chunks' activations (Megatron-LM's
            warm-up count, plus the one in flight), ``1 + (p-1)/(p·v)`` times 1F1B's.
        checkpointing: recompute every layer in backward (keep only its input).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 3
    micro_batch: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    checkpointing: bool = False

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "micro_batches",
                     "virtual_stages"):
            _whole(f"Plan.{name}", getattr(self, name))
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Plan.zero is ZeRO's stage, 0 (DDP) to 3 (FSDP2), got {self.zero!r}")
        if self.schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"Plan.schedule is '1f1b' or 'gpipe', got {self.schedule!r}")
        if self.virtual_stages > 1 and self.schedule != "1f1b":
            raise ValueError("Plan.virtual_stages > 1 is the interleaved 1F1B schedule: "
                             "set schedule='1f1b'")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"Plan: ep ({self.ep}) must divide dp x cp ({self.dp * self.cp}): "
                             "expert parallelism takes its ranks from the data-parallel ones")

    @property
    def gpus(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def describe(self) -> str:
        parts = [f"{name} {getattr(self, name)}" for name in ("dp", "tp", "pp", "cp", "ep")
                 if getattr(self, name) > 1] or ["one GPU"]
        extra = [f"ZeRO-{self.zero}", f"mb {self.micro_batch} x {self.micro_batches}"]
        if self.virtual_stages > 1:
            extra.append(f"{self.virtual_stages} chunks a GPU")
        return ", ".join(parts + extra) + (", AC" if self.checkpointing else "")


@dataclass(frozen=True)
class Traffic:
    """One parallelism's communication in a step, per GPU."""

    bytes_sent: float
    seconds: float
    exposed: float


@dataclass
class Prediction:
    memory: dict[str, float]
    fits: bool
    compute_s: float
    communication: dict[str, Traffic]
    bubble_s: float
    step_s: float
    mfu: float
    tokens_per_step: int

    @property
    def exposed_s(self) -> float:
        return sum(t.exposed for t in self.communication.values())


def check_plan(model: Model, plan: Plan, length: int) -> None:
    """Refuse a plan the model cannot take, naming the size that does not divide."""
    if plan.ep > 1 and not model.moe:
        raise ValueError(f"{model.name} has no experts: ep must be 1")
    rules = (("heads", model.heads, "tp"), ("kv_heads", model.kv_heads, "tp"),
             ("experts", model.experts, "ep"))
    for size_name, size, degree_name in rules:
        degree = getattr(plan, degree_name)
        if size % degree:
            raise ValueError(f"{model.name}: {size_name} ({size}) is not a multiple of "
                             f"{degree_name} ({degree}): pick a {degree_name} that divides it")
    if length % (2 * plan.cp if plan.cp > 1 else 1):
        raise ValueError(f"a sequence of {length} tokens does not split into 2 x cp = "
                         f"{2 * plan.cp} zig-zag chunks: pad it to a multiple")
    if model.layers < plan.pp * plan.virtual_stages:
        raise ValueError(f"{model.name}: {model.layers} layers cannot fill pp x "
                         f"virtual_stages = {plan.pp * plan.virtual_stages} pipeline stages")


def _link(cluster: Cluster, span: int) -> tuple[float, float]:
    """Bandwidth and latency of a group whose ranks cover ``span`` consecutive GPUs (its
    size times the degrees laid out inside it, outermost first pp, dp, cp, tp): a group
    that spans nodes runs at its slowest link, the inter-node one."""
    if span > cluster.gpus_per_node:
        return cluster.inter_bandwidth, cluster.inter_latency
    return cluster.intra_bandwidth, cluster.intra_latency


def gather_bytes(precision: Precision) -> int:
    """Bytes per parameter ZeRO-3 gathers: the 16-bit copies where the precision makes
    them, else the weights as stored."""
    return precision.copies or precision.weight


def collective_seconds(kind: str, nbytes: float, ranks: int, bandwidth: float,
                       latency: float) -> float:
    """Chapter 03's ring model: ``steps·α + bytes_sent/B`` for one collective to which
    each rank contributes ``nbytes``."""
    if ranks == 1:
        return 0.0
    steps = {"all_reduce": 2 * (ranks - 1), "send": 1}.get(kind, ranks - 1)
    return steps * latency + costs.ring_bytes_sent(kind, nbytes, ranks) / bandwidth


def stage_layers(model: Model, plan: Plan) -> int:
    """Layers on the fullest stage: ``ceil(L / pp)`` (an uneven split, as Llama 3 405B's
    126 layers over 16 stages, costs the pipeline its slowest stage's time)."""
    return ceil_div(model.layers, plan.pp)


def layers_in_flight(model: Model, plan: Plan, stage: int) -> int:
    """Layer activations x micro-batches pipeline stage ``stage`` keeps at its peak:
    GPipe all m micro-batches, 1F1B ``min(m, p - stage)``, interleaved 1F1B (v chunks of
    ``ceil(L / (p·v))`` layers) ``min(v·m, 2(p - stage - 1) + (v - 1)·p + 1)`` chunks."""
    m, p, v = plan.micro_batches, plan.pp, plan.virtual_stages
    if plan.schedule == "gpipe":
        return stage_layers(model, plan) * m
    if v == 1:
        return stage_layers(model, plan) * min(m, p - stage)
    chunk = ceil_div(model.layers, p * v)
    return chunk * min(v * m, 2 * (p - stage - 1) + (v - 1) * p + 1)


def stage_parameters(model: Model, plan: Plan, stage: int) -> dict[str, float]:
    """Parameters one GPU of pipeline stage ``stage`` holds before ZeRO shards them:
    ``dense`` (split by TP; the norms whole), ``experts`` (split by EP), and per layer
    (``layer``) and at the stage's ends (``edges``: the embeddings on the first stage,
    the final norm and the head on the last), the dense ones included; ``matmul``: those
    of matrix products, all but the embeddings (lookups) and the norms' weights (what
    autocast makes 16-bit copies of)."""
    t, h = plan.tp, model.dim
    norm = model.norm_parameters * h
    dense_layer = (model.attention_parameters() / t + 2 * norm
                   + (h * model.experts if model.moe else 0))
    expert_layer = model.experts * model.expert_parameters() / (plan.ep if model.moe else t)
    edges = ((stage == 0) * (model.vocab / t + model.positions) * h
             + (stage == plan.pp - 1) * (model.vocab * h / t + norm))
    layers = stage_layers(model, plan)
    lookups = (stage == 0) * (model.vocab / t + model.positions) * h
    norms = layers * 2 * norm + (stage == plan.pp - 1) * norm
    dense, experts = layers * dense_layer + edges, layers * expert_layer
    return {"dense": dense, "experts": experts, "layer": dense_layer + expert_layer,
            "edges": edges, "matmul": dense + experts - lookups - norms}


def stage_memory(model: Model, plan: Plan, length: int, stage: int,
                 precision: Precision = MIXED) -> dict[str, float]:
    """Bytes per GPU of pipeline stage ``stage`` at the peak of a step, by component.

    ``weights``, ``gradients`` and ``optimizer`` are the training state at rest, as ZeRO
    shards it (what a rank holds after the optimizer's step); ``working set`` what exists
    only during the step: without a pipeline, ZeRO-3's gathered edges, two layers and a
    layer's gradient; under a pipeline ZeRO-3 keeps the stage's weights gathered from the
    first backward pass on and its gradients whole until the last micro-batch (what
    ``PipelineStage`` asks of FSDP2): ZeRO-1's memory with ZeRO-3's state at rest; without
    ZeRO-3, ``precision.copies`` of the matrix products' weights (autocast's)."""
    held = stage_parameters(model, plan, stage)
    shards = plan.dp * plan.cp
    expert_shards = shards // plan.ep

    def sharded(from_stage: int) -> float:
        if plan.zero < from_stage:
            return held["dense"] + held["experts"]
        return held["dense"] / shards + held["experts"] / expert_shards

    memory = {"weights": sharded(3) * precision.weight,
              "gradients": sharded(2) * precision.gradient,
              "optimizer": sharded(1) * precision.optimizer}
    gathered = gather_bytes(precision)
    if plan.zero == 3 and shards > 1 and plan.pp > 1:  # the stage whole, and its gradients
        memory["working set"] = (held["dense"] + held["experts"]) * (
            gathered + precision.gradient) - memory["gradients"]
    elif plan.zero == 3 and shards > 1:  # the edges, two layers, a layer's gradient
        memory["working set"] = (held["edges"] * gathered
                                 + held["layer"] * (2 * gathered + precision.gradient))
    else:
        memory["working set"] = held["matmul"] * precision.copies
    tokens = plan.micro_batch * length // plan.cp
    t, e = plan.tp, precision.activation
    kept_layers = layers_in_flight(model, plan, stage)  # layers x micro-batches kept
    if plan.checkpointing:  # each layer's input (1/t of it under SP), one layer recomputed
        kept = (kept_layers * tokens * model.dim / t
                + model.layer_activation_elements(tokens, t, e))
    else:
        kept = kept_layers * model.layer_activation_elements(tokens, t, e)
    memory["activations"] = kept * e
    if stage == plan.pp - 1:  # float32 logits of its vocabulary share, and their gradient
        memory["activations"] += 2 * tokens * model.vocab / t * LOGIT_BYTES
    memory["total"] = sum(memory.values())
    return memory


def predict(model: Model, cluster: Cluster, plan: Plan, length: int,
            precision: Precision = MIXED, efficiency: float = 0.6,
            headroom: float = 0.1) -> Prediction:
    """Memory, time and MFU of one training step; see the module's notes.

    Args:
        length: tokens per sequence.
        precision: bytes per parameter (:data:`mgpu_helpers.planning.costs.MIXED` by default).
        efficiency: the share of ``cluster.peak_flops`` the matrix products reach.
        headroom: the share of a GPU's memory a plan must leave free to fit.
    """
    _whole("length", length)
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency is a share of the peak, in (0, 1], got {efficiency!r}")
    check_plan(model, plan, length)
    stages = {0, plan.pp - 1}
    memories = [stage_memory(model, plan, length, s, precision) for s in sorted(stages)]
    memory = max(memories, key=lambda m: m["total"])
    m, b = plan.micro_batches, plan.micro_batch
    tokens_per_step = plan.dp * m * b * length
    gpus = plan.gpus
    model_flops = model.flops_per_token(length) * tokens_per_step / gpus
    # the pipeline runs at its slowest stage: ceil(L / pp) layers
    slowest = stage_layers(model, plan) * plan.pp / model.layers
    # time counts the work a causal fused kernel does: about 7·L·s·h a token for attention
    # (chapter 10's costs module), not the 12 of the MFU convention; recomputation adds a
    # forward pass, 2N and attention's causal 2·L·s·h
    per_token = 6 * model.active_matmul_parameters()
    attention = ATTENTION_TIME_FLOPS * model.layers * length * model.dim
    if plan.checkpointing:
        per_token += 2 * model.active_matmul_parameters()
        attention += 2 * model.layers * length * model.dim
    rate = cluster.peak_flops * efficiency
    compute_s = (per_token + attention) * tokens_per_step / gpus * slowest / rate
    attention_s = attention * tokens_per_step / gpus * slowest / rate

    layers = stage_layers(model, plan)
    tokens = b * length // plan.cp  # a micro-batch's tokens on one rank before SP
    e, t, shards = precision.activation, plan.tp, plan.dp * plan.cp
    communication = {}

    def priced(dimension: str, calls, ranks: int, span: int, hidden_by: float = 0.0):
        bandwidth, latency = _link(cluster, span)
        sent = sum(count * costs.ring_bytes_sent(kind, n, ranks) for kind, n, count in calls)
        seconds = sum(count * collective_seconds(kind, n, ranks, bandwidth, latency)
                      for kind, n, count in calls)
        communication[dimension] = Traffic(sent, seconds, max(0.0, seconds - hidden_by))

    passes = 2 + plan.checkpointing  # forward, backward, and the recomputed forward
    if t > 1:  # SP: per layer 2 all-gathers and 2 reduce-scatters of b·s·h each way
        slab = tokens * model.dim * e
        count = 2 * passes * layers * m
        calls = [("all_gather", slab / t, count), ("reduce_scatter", slab, count)]
        priced("tp", calls, t, t)
    if plan.cp > 1:  # chapter 12's ring: K and V forward, c - 1 sends; backward c sends
        kv_block = 2 * tokens * model.kv_dim / t * e  # of K, V, dK and dV (dK, dV go home)
        forward = (plan.cp - 1) * layers * m * (1 + plan.checkpointing)
        priced("cp", [("send", kv_block, forward), ("send", 2 * kv_block, plan.cp * layers * m)],
               plan.cp, plan.cp * t, hidden_by=attention_s)
    if plan.ep > 1:  # dispatch and combine, forward and backward, per MoE layer
        routed = tokens * model.top_k * model.dim * e / t  # SP: each rank routes its 1/t
        count = (4 + 2 * plan.checkpointing) * layers * m
        priced("ep", [("all_to_all", routed, count)], plan.ep, plan.ep * t)
    if plan.pp > 1:  # a stage's output forward, its gradient backward, per micro-batch
        message = tokens * model.dim * e / t  # and chunk: a middle stage sends both
        count = (2 if plan.pp > 2 or plan.virtual_stages > 1 else 1) * m * plan.virtual_stages
        priced("pp", [("send", message, count)], 2, plan.gpus)
    if shards > 1:  # hidden behind the step's compute, as far as it goes
        held = max((stage_parameters(model, plan, s) for s in stages),
                   key=lambda h: h["dense"] + h["experts"])
        params = held["dense"] + held["experts"]  # per GPU, before ZeRO
        if plan.zero == 3 and plan.pp > 1:  # PipelineStage: gathers per forward, once
            calls = [("all_gather", params * gather_bytes(precision) / shards, m + 1),
                     ("reduce_scatter", params * precision.gradient, 1)]
        elif plan.zero == 3:  # FSDP2's default: gather each way, sync every micro-batch
            calls = [("all_gather", params * gather_bytes(precision) / shards, 2 * m),
                     ("reduce_scatter", params * precision.gradient, m)]
        else:
            calls = [("all_reduce", params * precision.gradient, 1)]
        priced("dp", calls, shards, shards * t, hidden_by=compute_s)
    critical = compute_s + sum(communication[k].exposed for k in ("tp", "ep", "pp")
                               if k in communication)
    bubble_s = (plan.pp - 1) / (plan.virtual_stages * m) * critical
    step_s = critical + bubble_s + sum(communication[k].exposed for k in ("cp", "dp")
                                       if k in communication)
    mfu = model_flops / (step_s * cluster.peak_flops)
    fits = memory["total"] <= cluster.memory_bytes * (1 - headroom)
    return Prediction(memory, fits, compute_s, communication, bubble_s, step_s, mfu,
                      tokens_per_step)


def candidate_plans(model: Model, cluster: Cluster, gpus: int, length: int,
                    global_batch: int):
    """Every plan of ``gpus`` GPUs over powers of two for tp (within a node), pp and cp,
    with dp the rest, whose global batch is ``global_batch`` sequences: micro-batches of
    1 to 8 sequences (their number makes up the batch), ZeRO-1 or ZeRO-3 where there is
    more than one data-parallel rank, 1F1B with 1 or 2 chunks a GPU under a pipeline,
    with and without recomputation."""
    degrees = [d for d in (1, 2, 4, 8, 16, 32, 64, 128) if d <= gpus]
    for tp, pp, cp in ((tp, pp, cp) for tp in degrees if tp <= cluster.gpus_per_node
                       for pp in degrees for cp in degrees):
        if gpus % (tp * pp * cp):
            continue
        dp = gpus // (tp * pp * cp)
        for micro_batch in (1, 2, 4, 8):
            if global_batch % (dp * micro_batch):
                continue
            for zero, chunks, checkpointing in (
                    (zero, chunks, checkpointing)
                    for zero in ((1, 3) if dp * cp > 1 else (0,))
                    for chunks in ((1, 2) if pp > 1 else (1,))
                    for checkpointing in (False, True)):
                plan = Plan(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, micro_batch=micro_batch,
                            micro_batches=global_batch // (dp * micro_batch),
                            virtual_stages=chunks, checkpointing=checkpointing)
                try:
                    check_plan(model, plan, length)
                except ValueError:
                    continue
                yield plan


def best_plan(model: Model, cluster: Cluster, gpus: int, length: int, global_batch: int,
              **options) -> tuple[Plan, Prediction] | None:
    """The plan that fits with the shortest predicted step (None if none fits)."""
    best = None
    for plan in candidate_plans(model, cluster, gpus, length, global_batch):
        prediction = predict(model, cluster, plan, length, **options)
        if prediction.fits and (best is None or prediction.step_s < best[1].step_s):
            best = (plan, prediction)
    return best



MEMORY_PARTS = ("weights", "gradients", "optimizer", "working set", "activations")


def format_prediction(prediction: Prediction, plan: Plan) -> str:
    """A prediction as text: GB per GPU by component, then the step's times and MFU."""
    memory = prediction.memory
    lines = [f"{plan.describe()} on {plan.gpus} GPUs",
             "memory per GPU (GB): " + ", ".join(f"{part} {memory[part] / GB:.1f}"
                                                  for part in MEMORY_PARTS)
             + f"; total {memory['total'] / GB:.1f}: "
             + ("fits" if prediction.fits else "does not fit"),
             f"step {prediction.step_s:.2f} s = compute {prediction.compute_s:.2f} s"
             f" + exposed communication {prediction.exposed_s:.2f} s"
             f" + bubble {prediction.bubble_s:.2f} s; MFU {prediction.mfu:.0%}"]
    for name, traffic in prediction.communication.items():
        lines.append(f"  {name}: {traffic.bytes_sent / GB:.2f} GB sent per GPU, "
                     f"{traffic.seconds:.3f} s, exposed {traffic.exposed:.3f} s")
    return "\n".join(lines)
