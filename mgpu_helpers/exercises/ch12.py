"""Chapter 12's exercises: merging two partial attention results, and ring attention with a
sliding window."""

from __future__ import annotations

import math
import random

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ..labs.comm_log import CollectivesLogged
from ..measure.traffic import sends_counted
from .core import Case, Exercise, largest_abs, shared_fresh_seed

# --------------------------------------------------------- 12.1 merging two partials


def _partial(scores: torch.Tensor, v: torch.Tensor, visible: torch.Tensor):
    """(out, lse) of attention restricted to the ``visible`` keys; a row that sees none
    has lse -inf and an output of zeros, as a block-wise kernel leaves it."""
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = scores.logsumexp(-1)
    weights = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return weights @ v, lse


def _merge_inputs(kind: str):
    generator = torch.Generator().manual_seed(random.SystemRandom().getrandbits(63))
    batch, heads = (int(torch.randint(1, 4, (), generator=generator)) for _ in range(2))
    n, d = int(torch.randint(3, 9, (), generator=generator)), int(torch.randint(2, 9, (),
                                                                               generator=generator))
    m_a, m_b = (int(torch.randint(2, 9, (), generator=generator)) for _ in range(2))
    q = torch.randn(batch, heads, n, d, generator=generator)
    k = torch.randn(batch, heads, m_a + m_b, d, generator=generator)
    v = torch.randn(batch, heads, m_a + m_b, d, generator=generator)
    scale = 300.0 if kind == "large" else 1.0  # scores in the hundreds: exp overflows
    scores = q @ k.transpose(-2, -1) * scale / math.sqrt(d)
    visible = torch.ones(n, m_a + m_b, dtype=torch.bool)
    if kind in ("empty rows", "blind rows"):  # some rows see no key of A, others none of B
        visible[: n // 2, :m_a] = False
        visible[n // 2:, m_a:] = False
        visible[0, m_a] = True  # and one row sees a single key of B only
    if kind == "blind rows":  # and one row sees no key at all (a padding query)
        visible[-1] = False
    a = _partial(scores[..., :m_a], v[..., :m_a, :], visible[:, :m_a])
    b = _partial(scores[..., m_a:], v[..., m_a:, :], visible[:, m_a:])
    return a, b, _partial(scores, v, visible), float(v.abs().max())


def _merge_trial(fn, kind: str):
    (out_a, lse_a), (out_b, lse_b), expected, v_max = _merge_inputs(kind)
    result = fn(out_a.clone(), lse_a.clone(), out_b.clone(), lse_b.clone())
    return {"result": result}, {"out": expected[0], "lse": expected[1], "kind": kind,
                                "out_tolerance": _out_tolerance(expected[1], v_max)}


def _out_tolerance(lse: torch.Tensor, v_max: float) -> float:
    """How far a right float32 merge may be from one process's float32 attention: each
    output weighs exp(its lse - the merged lse), and an lse of size L carries rounding of a
    few float32 steps of L (4 of them allowed: 1.4e-4 at L = 300), which the weight turns
    into that relative error of outputs up to max|v| (3,000 draws of each kind: the
    reference merge's largest difference was 0.09 of the bound). Never below 1e-5."""
    finite = lse[torch.isfinite(lse)]
    size = float(finite.abs().max()) if finite.numel() else 0.0
    return 1e-5 + 4 * torch.finfo(torch.float32).eps * max(1.0, size) * v_max


def _merge_judge(got, expected) -> str | None:
    result = got["result"]
    if not (isinstance(result, tuple | list) and len(result) == 2
            and all(isinstance(x, torch.Tensor) for x in result)):
        return f"expected (out, lse), two tensors; got {type(result).__name__}"
    out, lse = result
    for name, value, right in (("out", out, expected["out"]), ("lse", lse, expected["lse"])):
        if tuple(value.shape) != tuple(right.shape):
            return f"{name} has shape {tuple(value.shape)}, expected {tuple(right.shape)}"
        if torch.isnan(value).any():
            where = {"empty rows": "where a row saw no key in one set (its lse is -inf)",
                     "blind rows": "where a row saw no key in either set (both lse -inf): "
                                   "its merged lse is -inf and its output zeros",
                     }.get(expected["kind"], "with scores in the hundreds (exp overflows "
                                             "float32)")
            return (f"{name} holds NaN {where}: work with differences of log-sum-exps, "
                    "never exp(lse) itself")
    if not torch.allclose(lse.double(), expected["lse"].double(), rtol=1e-5, atol=1e-5):
        return (f"lse differs from the log-sum-exp over all the keys by up to "
                f"{largest_abs(lse - expected['lse']):.3g}")
    if not torch.allclose(out.double(), expected["out"].double(), rtol=1e-5,
                          atol=expected["out_tolerance"]):
        return (f"out differs from attention over all the keys by up to "
                f"{largest_abs(out - expected['out']):.3g}: each partial output weighs "
                "exp(its lse - the merged lse)")
    return None


# ------------------------------------------------- 12.2 ring attention, sliding window


def _window_attention(q, k, v, window: int) -> torch.Tensor:
    """One process's answer: a query at p sees keys p - window + 1 .. p."""
    length = q.shape[-2]
    positions = torch.arange(length)
    visible = (positions[None, :] <= positions[:, None]) & \
        (positions[None, :] > positions[:, None] - window)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)


def _pairs_needed(rank: int, n: int, window: int) -> int:
    """Block pairs (this rank's queries, rank j's keys) that some query's window reaches."""
    earliest_key = rank * n - window + 1  # the first query's oldest visible key
    return sum(1 for j in range(rank + 1) if j * n + n - 1 >= earliest_key)


def _window_case(seed: int, world: int, reach: str):
    """A case's sizes and whole-sequence q, k, v (drawn from ``seed``)."""
    generator = torch.Generator().manual_seed(seed)
    n = int(torch.randint(3, 7, (), generator=generator))
    d = int(torch.randint(2, 5, (), generator=generator)) * 2
    window = {"within a block": int(torch.randint(2, n + 1, (), generator=generator)),
              "over two blocks": n + int(torch.randint(1, n + 1, (), generator=generator)),
              "the whole sequence": world * n}[reach]
    q, k, v = (torch.randn(2, 2, world * n, d, generator=generator) for _ in range(3))
    return n, window, (q, k, v)


def _window_slices(seed: int, world: int, rank: int, reach: str):
    """This rank's q, k, v only: the whole sequence never sits in the frame that calls
    the reader's function."""
    n, window, tensors = _window_case(seed, world, reach)
    return n, window, [x[..., rank * n:(rank + 1) * n, :].clone() for x in tensors]


def _window_trial(fn, reach: str):
    """FlopCounterMode counts matrix products (the MATH kernel makes SDPA's count too):
    scores built from element-wise products instead would escape the bound."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seed = shared_fresh_seed()
    n, window, (q, k, v) = _window_slices(seed, world, rank, reach)
    batch, heads, _, d = q.shape
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as flops, \
            CollectivesLogged() as logged, sends_counted() as sent:
        out = fn(q, k, v, window, dist.group.WORLD)
    _, _, whole = _window_case(seed, world, reach)  # the expected answer, after the call
    block_pair = 4 * batch * heads * n * n * d  # q @ kᵀ and the weights @ v
    return ({"out": out, "flops": flops.get_total_flops(),
             "collectives": sorted({kind for kind, _ in logged.calls} - {"send", "recv"}),
             "sent": sum(size for _, size in sent)},
            {"out": _window_attention(*whole, window)[..., rank * n:(rank + 1) * n, :],
             "rank": rank, "world": world, "window": window, "n": n,
             "bound": _pairs_needed(rank, n, window) * block_pair, "pair": block_pair,
             # the next rank's first queries need the last window - 1 keys and values
             "kv bytes": 2 * batch * heads * min(n, window - 1) * d * 4})


def _window_judge(got, expected) -> str | None:
    rank, window, n = expected["rank"], expected["window"], expected["n"]
    shown = f"rank {rank} of {expected['world']}, {n} tokens each, window {window}"
    if got["collectives"]:
        return (f"{shown}: your function ran {', '.join(got['collectives'])}; K and V must "
                "travel point to point, around the ring (batch_isend_irecv, or isend/irecv)")
    if rank < expected["world"] - 1 and got["sent"] < expected["kv bytes"]:
        return (f"{shown}: this rank sent {got['sent']} bytes; the next rank's first queries "
                f"need its last keys and values (at least {expected['kv bytes']} bytes)")
    out = got["out"]
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(expected["out"].shape):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return f"{shown}: expected an output of shape {tuple(expected['out'].shape)}, got {shape}"
    if not torch.allclose(out.double(), expected["out"].double(), rtol=1e-5, atol=1e-5):
        return (f"{shown}: the output differs from one process's sliding-window attention by "
                f"up to {largest_abs(out - expected['out']):.3g}")
    if got["flops"] > expected["bound"]:
        return (f"{shown}: {got['flops']:,} FLOPs, more than the "
                f"{expected['bound'] // expected['pair']} block pairs some window reaches "
                f"({expected['bound']:,}): skip a pair whose keys all lie before every "
                "query's window, as the chapter skips those after the queries")
    return None


EXERCISES = [
    Exercise(
        key="12.1", difficulty=2, minutes=20,
        title="merging two partial attention results", function="merge_partials",
        cases=[Case("sizes drawn afresh", ("plain",)),
                Case("rows that saw no key of one set", ("empty rows",)),
                Case("a row that saw no key at all", ("blind rows",)),
                Case("scores in the hundreds", ("large",))],
        trial=_merge_trial, judge=_merge_judge,
        hint=("the merged lse is log(exp(lse_a) + exp(lse_b)), and each output weighs "
              "exp(its lse - the merged lse)",
              "compute the merged lse without exp of a large number: torch.logaddexp, which "
              "also gives -inf + -inf = -inf; a row whose lse is -inf in one set must get "
              "weight 0 from it, not NaN"),
    ),
    Exercise(
        key="12.2", difficulty=3, minutes=45,
        title="ring attention with a sliding window", function="window_ring_attention",
        cases=[Case("2 ranks, a window over two blocks", ("over two blocks",), 2),
               Case("4 ranks, a window within a block", ("within a block",), 4),
               Case("3 ranks, a window as long as the sequence", ("the whole sequence",), 3)],
        trial=_window_trial, judge=_window_judge, timeout=30.0,
        hint=("start from the chapter's forward pass with one chunk per rank; the mask "
              "hides a key that is after the query or at least window positions before it",
              "rank r's queries start at r·n: a block of keys that ends before "
              "r·n - window + 1 is out of every query's window; skip it as attend skips "
              "blocks after the queries"),
    ),
]
