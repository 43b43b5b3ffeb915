"""Chapter 11's exercises: the argmax of logits split over the vocabulary, and a
tensor- and sequence-parallel plan for a Llama-style block."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..labs.comm_log import CollectivesLogged
from ..measure.flight_recorder import collectives_so_far
from ..measure.traffic import sends_counted
from .core import Case, Exercise, largest_abs, shared_fresh_seed

# ------------------------------------------------------- 11.1 vocabulary-parallel argmax

#: Bytes per token the reader's collectives may carry: a value and an index, twice over,
#: and less than any slice of logits the cases draw (at least 16 columns of float32)
ARGMAX_BYTES_PER_TOKEN = 16


def _argmax_inputs(kind: str, seed: int, world: int) -> torch.Tensor:
    """The whole ``(tokens, vocab)`` logits of a case, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    tokens = int(torch.randint(3, 20, (), generator=generator))
    columns = int(torch.randint(16, 40, (), generator=generator))
    vocab = columns * world
    logits = torch.randn(tokens, vocab, generator=generator)
    if kind == "ties":
        # each row's best score appears twice, on two ranks (or twice on one): the lower
        # id must win, as torch.argmax's first occurrence does
        for row in range(tokens):
            first, second = sorted(torch.randperm(vocab, generator=generator)[:2].tolist())
            best = logits[row].max() + 1.0
            logits[row, first] = logits[row, second] = best
    elif kind == "one rank":
        # every row's best token on the last rank, and negative scores everywhere
        logits = -logits.abs() - 1.0
        for row in range(tokens):
            logits[row, int(torch.randint((world - 1) * columns, vocab, (),
                                          generator=generator))] = -0.5
    return logits


def _my_scores(kind: str, seed: int, world: int, rank: int) -> torch.Tensor:
    """This rank's slice of a case's logits (the whole tensor never sits in the frame that
    calls the reader's function)."""
    return _argmax_inputs(kind, seed, world).chunk(world, -1)[rank].clone()


_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4,
                "Short": 2, "Char": 1, "Byte": 1, "Bool": 1}


def _recorded_bytes(entries) -> int:
    """The input bytes of flight-recorder entries (gloo's own record of each collective)."""
    total = 0
    for entry in entries:
        for shape, dtype in zip(entry["input_sizes"], entry["input_dtypes"], strict=False):
            total += math.prod(shape) * _DTYPE_BYTES.get(dtype, 8)
    return total


def _argmax_trial(fn, kind: str):
    world = dist.get_world_size()
    seed = shared_fresh_seed()
    mine = _my_scores(kind, seed, world, dist.get_rank())
    # Three meters, since each misses a way the others see: the dispatcher (every
    # torch.distributed call, DTensor's too), gloo's flight recorder (a backend's own
    # collective methods, called directly) and the sends (point-to-point, which gloo does
    # not record). Files or sockets of the reader's own are not counted.
    before = len(collectives_so_far())
    with CollectivesLogged() as logged, sends_counted() as sent:
        result = fn(mine, dist.group.WORLD)
    recorded = _recorded_bytes(collectives_so_far()[before:])
    dispatched = sum(size for kind_, size in logged.calls if kind_ not in ("send", "recv"))
    moved = max(recorded, dispatched) + sum(size for _, size in sent)
    logits = _argmax_inputs(kind, seed, world)  # the expected answer, after the call
    return ({"result": result, "bytes": moved, "kinds": sorted(set(logged.kinds()))},
            {"ids": logits.argmax(-1), "tokens": logits.shape[0], "vocab": logits.shape[1],
             "world": world})


def _argmax_judge(got, expected) -> str | None:
    limit = ARGMAX_BYTES_PER_TOKEN * expected["tokens"]
    if got["bytes"] > limit:
        return (f"your collectives carried {got['bytes']:,} bytes from this rank for "
                f"{expected['tokens']} tokens, more than {ARGMAX_BYTES_PER_TOKEN} per token "
                f"({', '.join(got['kinds']) or 'not through torch.distributed'}): reduce to a "
                "value and an index per token, "
                "do not gather the logits")
    result, ids = got["result"], expected["ids"]
    if not isinstance(result, torch.Tensor):
        return f"expected a tensor of token ids, got {type(result).__name__}"
    if tuple(result.shape) != tuple(ids.shape):
        return (f"expected one id per token, shape {tuple(ids.shape)}; got "
                f"{tuple(result.shape)}")
    if result.is_floating_point() or result.is_complex():
        return f"expected whole token ids (an integer tensor), got {result.dtype}"
    wrong = (result.cpu() != ids).nonzero().flatten().tolist()
    if not wrong:
        return None
    row = wrong[0]
    columns = expected["vocab"] // expected["world"]
    got_id, right = int(result[row]), int(ids[row])
    why = ""
    if 0 <= got_id < columns and right >= columns:
        why = (": an id inside one rank's slice; add the rank's first id, "
               "rank x V/t, to make it global")
    return (f"{len(wrong)} of {len(ids)} tokens wrong; token {row}: got id {got_id}, "
            f"expected {right}{why}")


# ----------------------------------------------------- 11.2 the plan for a Llama block


class GatedMLP(nn.Module):
    """Llama's MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GroupedQueryAttention(nn.Module):
    """Causal attention with fewer key-value heads than query heads, as in Llama 2 70B and
    Llama 3: ``heads`` query heads share ``kv_heads`` key-value heads, query head i using
    key-value head i // (heads / kv_heads). As in the GPT, the heads are found from the
    widths the projections give, so a rank holding a slice runs its heads unchanged."""

    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        if dim % heads or heads % kv_heads:
            raise ValueError(f"GroupedQueryAttention: dim {dim} must be a multiple of heads "
                             f"{heads}, and heads a multiple of kv_heads {kv_heads}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (projection(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
                   for projection in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(batch, length, -1))


class LlamaBlock(nn.Module):
    """A pre-norm block as in Llama: ``RMSNorm``, grouped-query causal attention (``q``,
    ``k``, ``v``, ``o``), ``RMSNorm``, the gated MLP; each with its residual connection."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2, hidden: int = 64):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = GroupedQueryAttention(dim, heads, kv_heads)
        self.mlp_norm = nn.RMSNorm(dim)
        self.mlp = GatedMLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


_EXPECTED_PLACEMENTS = {
    "attention_norm.weight": (Replicate(),), "mlp_norm.weight": (Replicate(),),
    "attention.q.weight": (Shard(0),), "attention.k.weight": (Shard(0),),
    "attention.v.weight": (Shard(0),), "attention.o.weight": (Shard(1),),
    "mlp.gate.weight": (Shard(0),), "mlp.up.weight": (Shard(0),),
    "mlp.down.weight": (Shard(1),)}


def _llama_trial(fn, heads: int, kv_heads: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    seed = shared_fresh_seed()
    generator = torch.Generator().manual_seed(seed)
    head_dim = int(torch.randint(2, 5, (), generator=generator)) * 2
    dim = heads * head_dim
    hidden = world * int(torch.randint(2, 6, (), generator=generator)) * 2
    length = world * int(torch.randint(2, 5, (), generator=generator))
    x = torch.randn(2, length, dim, generator=generator)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        reference = LlamaBlock(dim, heads, kv_heads, hidden)
        torch.manual_seed(seed)
        block = LlamaBlock(dim, heads, kv_heads, hidden)
    mesh = init_device_mesh("cpu", (world,))
    got = {"refused": None, "placements": {}, "forward": [], "out": None, "grads": {},
           "x grad": None}
    expected = {"refuse": kv_heads % world != 0, "kv_heads": kv_heads, "world": world}
    try:
        fn(block, mesh)
    except ValueError as refusal:
        got["refused"] = f"ValueError: {refusal}"
        return got, expected
    got["placements"] = {name: tuple(p.placements) if isinstance(p, DTensor) else None
                         for name, p in block.named_parameters()}
    if expected["refuse"] or any(got["placements"].get(name) != right
                                 for name, right in _EXPECTED_PLACEMENTS.items()):
        return got, expected  # the judge names what is wrong; a forward pass would crash
    mine = x.chunk(world, 1)[rank].clone().requires_grad_()
    with CollectivesLogged() as logged:
        out = block(mine)
    got.update(forward=sorted(set(logged.kinds())), out=out)
    if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) and out.requires_grad:
        out.pow(2).sum().backward()
        got["grads"] = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                        for name, p in block.named_parameters()}
        got["x grad"] = mine.grad
    whole = x.clone().requires_grad_()
    expected_out = reference(whole)
    expected_out.pow(2).sum().backward()
    expected.update(out=expected_out.detach().chunk(world, 1)[rank],
                    grads={n: p.grad for n, p in reference.named_parameters()},
                    x_grad=whole.grad.chunk(world, 1)[rank])
    return got, expected


def _differs(a, b) -> bool:
    return not (isinstance(a, torch.Tensor) and a.shape == b.shape
                and torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-5))


def _llama_judge(got, expected) -> str | None:
    kv, world = expected["kv_heads"], expected["world"]
    if expected["refuse"]:
        if got["refused"]:
            return None
        return (f"{kv} key-value heads do not split over {world} ranks, and your function "
                "went ahead: a rank would hold part of a head. Raise ValueError saying so, "
                "before splitting anything")
    if got["refused"]:
        return (f"{kv} key-value heads split over {world} ranks, yet your function raised "
                f"{got['refused']}")
    for name, right in _EXPECTED_PLACEMENTS.items():
        placement = got["placements"].get(name)
        if placement is None:
            return (f"{name} is not split (not a DTensor): every weight of the block needs a "
                    "style in your plan, the norms SequenceParallel()")
        if placement != right:
            shown = ", ".join(map(repr, placement))
            if "norm" in name:
                why = "SequenceParallel()"
            else:
                why = "column-parallel" if right == (Shard(0),) else "row-parallel"
            return f"{name} is placed ({shown}); expected ({right[0]!r},): {why}"
    out = got["out"]
    if isinstance(out, DTensor):
        return ("the block returned a DTensor; expected a local tensor of this rank's tokens "
                "(use_local_output=True on the last style)")
    if not isinstance(out, torch.Tensor) or out.shape != expected["out"].shape:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return (f"the block returned shape {shape}; expected {tuple(expected['out'].shape)}, "
                "this rank's tokens: the row-parallel layers' output_layouts=Shard(1)")
    if _differs(out.detach(), expected["out"]):
        return (f"the output differs from the unsplit block's by up to "
                f"{largest_abs(out.detach() - expected['out']):.3g}: are the inputs of "
                "attention and the MLP gathered (PrepareModuleInput, Shard(1) to Replicate())?")
    if "all_reduce" in got["forward"] or got["forward"] != ["all_gather", "reduce_scatter"]:
        return (f"the forward pass ran {', '.join(got['forward']) or 'no collective'}; "
                "expected all-gathers and reduce-scatters only (sequence parallelism), "
                "no all-reduce")
    if not got["grads"]:
        return "the output does not require a gradient: backward cannot reach the weights"
    for name, right in expected["grads"].items():
        if _differs(got["grads"].get(name), right):
            return f"the gradient of {name} differs from the unsplit block's"
    if _differs(got["x grad"], expected["x_grad"]):
        return "the gradient of the block's input differs from the unsplit block's"
    return None


EXERCISES = [
    Exercise(
        key="11.1", difficulty=2, minutes=30,
        title="the most likely token from scores split over the vocabulary",
        function="vocab_parallel_argmax",
        cases=[Case("2 ranks, scores drawn afresh", ("random",), 2),
               Case("3 ranks, the best score twice in each row", ("ties",), 3),
               Case("4 ranks, every best token on the last rank", ("one rank",), 4)],
        trial=_argmax_trial, judge=_argmax_judge,
        hint=("each rank can find its own best score and where it is; what must the ranks "
              "agree on, and with which reduction?",
              "an all-reduce with ReduceOp.MAX gives every rank the best score; a rank's "
              "index becomes a global id by adding rank x V/t",
              "for ties, the lowest id among the ranks that hold the best score: an "
              "all-reduce with ReduceOp.MIN, each rank offering its id where it holds the "
              "best score, else a number above every id"),
    ),
    Exercise(
        key="11.2", difficulty=3, minutes=45,
        title="a parallelize plan for a Llama-style block", function="parallelize_block",
        cases=[Case("2 ranks, 4 query and 2 key-value heads", (4, 2), 2),
               Case("4 ranks, 8 query and 4 key-value heads", (8, 4), 4),
               Case("4 ranks, 8 query and 2 key-value heads: refused", (8, 2), 4)],
        trial=_llama_trial, judge=_llama_judge, timeout=30.0,
        hint=("start from the chapter's plan for one GPT block (section 4), and decide for "
              "each new layer, gate, and k and v with their narrower outputs, whether it is "
              "column- or row-parallel",
              "a rank must hold whole key-value heads and the query heads that use them: "
              "compare block.attention.kv_heads with mesh.size() before splitting, and "
              "raise ValueError when it does not divide",
              "the block takes and returns this rank's tokens: the norms run on them "
              "(SequenceParallel), attention and the MLP gather them first "
              "(PrepareModuleInput), and the last layer of each ends with a reduce-scatter "
              "to Shard(1)"),
    ),
]
