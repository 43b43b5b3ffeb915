"""Chapter 14's exercises: a training configuration's numbers worked out by hand, at H100
scale. The reader's function takes sizes and returns a number; the checker draws the sizes
afresh on each check, computes the answer from the formula itself and, where the number
is wrong, names the term that is. No ranks: every case runs in this process.

While the reader's function runs, the planner and what it is built from (the public
functions of :mod:`mgpu_helpers.planner`, :mod:`mgpu_helpers.strategy`,
:mod:`mgpu_helpers.costs` and the pipeline's bubble formulas) refuse to run: wherever a
module of this package holds one, it is replaced for the call by a function that raises
:class:`HelperRefused`, and put back after, whatever happened. One imported before the
check under another name is still recognised by its code (:func:`core.calls_during`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import itertools
import math
import random
import sys
from collections.abc import Callable

from .core import Case, Exercise, as_number, beyond, calls_during

GB = 10**9
RULE = "compute it from the formula; the planner is what you are checking"
#: Where the functions that would do the work live.
_HOMES = ("mgpu_helpers.planner", "mgpu_helpers.strategy", "mgpu_helpers.costs",
          "mgpu_helpers.parallel.pipeline.timeline")


class HelperRefused(RuntimeError):
    """The planner (or a formula it is built from) called inside a chapter 14 exercise."""


def _helpers() -> dict[Callable, str]:
    """The public functions of the planner's modules, by their shown name."""
    found = {}
    for home in _HOMES:
        module = importlib.import_module(home)
        for name, value in vars(module).items():
            if (inspect.isfunction(value) and value.__module__ == home
                    and not name.startswith("_")):
                found[value] = f"{home.removeprefix('mgpu_helpers.')}.{name}"
    return found


def _refuser(name: str, key: str, used: list[str], codes: dict) -> Callable:
    def refused(*args, **kwargs):
        # reached from inside another helper (one imported under another name before the
        # check, which calls this one through its module): name the one the reader called
        shown, frame = name, sys._getframe(1)
        while frame is not None:
            shown = codes.get(frame.f_code, shown)
            frame = frame.f_back
        used.append(shown)
        raise HelperRefused(f"{shown} does not run inside exercise {key}: {RULE}")

    refused.__name__ = refused.__qualname__ = name.rsplit(".", 1)[-1]
    return refused


@contextlib.contextmanager
def _helpers_refused(helpers: dict[Callable, str], key: str, used: list[str]):
    """Every module of this package that holds one of ``helpers`` (its home, and the
    modules that import it: ``parallel.pipeline``, ``pipeline_parallel``...) holds a
    refusing stand-in instead, until the block ends."""
    by_id = {id(function): (function, name) for function, name in helpers.items()}
    codes = {function.__code__: name for function, name in helpers.items()}
    replaced = []
    try:
        for module_name, module in list(sys.modules.items()):
            if module is None or not (module_name == "mgpu_helpers"
                                      or module_name.startswith("mgpu_helpers.")):
                continue
            for attribute, value in list(vars(module).items()):
                found = by_id.get(id(value))
                if found is not None and found[0] is value:
                    replaced.append((module, attribute, value))
                    setattr(module, attribute, _refuser(found[1], key, used, codes))
        yield
    finally:
        for module, attribute, value in reversed(replaced):
            setattr(module, attribute, value)


def _call(key: str, fn: Callable, args: tuple) -> dict:
    """``fn(*args)`` with the planner refused, and which helpers it reached."""
    helpers, used = _helpers(), []
    with _helpers_refused(helpers, key, used):
        value, called = calls_during(helpers, fn, *args)
    return {"value": value, "called": list(dict.fromkeys(used + called))}


def _refusal(called: list[str]) -> str:
    return f"your function called {', '.join(called)}: {RULE}"


def _close(value: float, right: float, relative: float) -> bool:
    return not beyond(abs(value - right), max(relative * abs(right), 1e-15))


def _times(value: float, right: float) -> str:
    return f" ({value / right:.4g} x the expected)" if right and math.isfinite(value) else ""


def _number(got, what: str) -> tuple[float | None, str | None]:
    value = as_number(got)
    if value is None:
        return None, f"expected a number ({what}), got {type(got).__name__}"
    return value, None


# ------------------------------------------------------ 14.1 the training state per GPU

#: Bytes per parameter of the weights, gradients and Adam's state (mixed precision, the ZeRO
#: paper's), and the ZeRO stage from which each is sharded over the data-parallel ranks.
PER_PARAMETER = (2, 2, 12)
SHARDED_FROM = {"weights": 3, "gradients": 2, "optimizer state": 1}
_OTHER_BYTES = {(4, 4, 8): "4 + 4 + 8, PyTorch's float32 state",
                (2, 2, 8): "2 + 2 + 8: Adam's state is its two float32 moments (4 + 4) and "
                           "the float32 master weights (4), 12 bytes"}
_UNITS = {GB: "", 1: "your result is in bytes: the task asks for GB, 10**9 bytes",
          2**30: "your result is in GiB (2**30 bytes): the task asks for GB, 10**9 bytes"}


def _state_inputs(kind: str) -> tuple[int, int, int, int, int]:
    draw = random.SystemRandom()
    parameters = draw.randint(7 * GB, 405 * GB)
    dp = draw.choice([2, 4, 8, 16, 32, 64, 128])
    tp, pp = draw.choice([1, 2, 4, 8]), draw.choice([1, 2, 4, 8, 16])
    zero = draw.randint(0, 3)
    if kind.startswith("zero"):
        zero = int(kind[-1])
    elif kind == "dp 1":
        dp, zero = 1, draw.randint(1, 3)
    elif kind == "large":
        tp, pp = 8, 16
    return parameters, dp, tp, pp, zero


def _state(parameters, dp, tp, pp, zero, per_parameter=PER_PARAMETER, sharded=None,
           split=None, unit=GB) -> float:
    """GB per GPU; the keywords make the variants a mistake gives."""
    if sharded is None:
        sharded = tuple(zero >= stage for stage in SHARDED_FROM.values())
    split = tp * pp if split is None else split
    held = sum(b / (dp if s else 1) for b, s in zip(per_parameter, sharded, strict=True))
    return parameters / split * held / unit


def _state_trial(fn, kind: str):
    args = _state_inputs(kind)
    return _call("14.1", fn, args), {"args": args, "gb": _state(*args)}


def _state_mistake(value: float, args: tuple) -> str | None:
    """What explains ``value``: the variant with the fewest departures from the formula
    that gives it."""
    parameters, dp, tp, pp, zero = args
    right_sharding = tuple(zero >= stage for stage in SHARDED_FROM.values())
    splits = [(tp * pp, None)] + [(split, said) for split, said in (
        (tp, f"by tp = {tp} only"), (pp, f"by pp = {pp} only"), (1, "by nothing"))
        if split != tp * pp]
    found = []
    for sharded, (split, split_said), per_parameter, (unit, unit_said) in itertools.product(
            itertools.product((False, True), repeat=3), splits,
            [PER_PARAMETER, *_OTHER_BYTES], _UNITS.items()):
        if not _close(value, _state(*args, per_parameter, sharded, split, unit), 1e-6):
            continue
        said = []
        for part, is_sharded, should in zip(SHARDED_FROM, sharded, right_sharding,
                                            strict=True):
            stage, them = SHARDED_FROM[part], "it" if part == "optimizer state" else "them"
            if should and not is_sharded:
                said.append(f"ZeRO-{zero} shards the {part} over the dp ranks: divide {them} "
                            f"by dp = {dp} too (your {part} term is {dp}x too big)")
            elif is_sharded and not should:
                said.append(f"ZeRO-{zero} keeps the {part} whole on every data-parallel rank "
                            f"(sharding {them} starts at ZeRO-{stage}): your {part} term is "
                            f"{dp}x too small")
        if split_said:
            said.append(f"each GPU holds 1/(tp x pp) = 1/{tp * pp} of the model; you "
                        f"divided {split_said}")
        if per_parameter != PER_PARAMETER:
            said.append("mixed precision keeps 2 + 2 + 12 bytes per parameter (bfloat16 "
                        "weights and gradients; float32 master weights and Adam's two "
                        f"moments); you used {_OTHER_BYTES[per_parameter]}")
        if unit_said:
            said.append(unit_said)
        if said:  # a change of bytes per parameter is the less likely reading
            found.append((len(said) + 0.5 * (per_parameter != PER_PARAMETER), said))
    if not found:
        return None
    found.sort(key=lambda item: item[0])
    (score, said), readings = found[0], ["; ".join(found[0][1])]
    if len(found) > 1 and found[1][0] <= score + 0.5 and len(found[1][1]) <= 2:
        readings.append("; ".join(found[1][1]))  # the same number, read another way
    return "; or: ".join(readings)


def _state_judge(got, expected) -> str | None:
    if got["called"]:
        return _refusal(got["called"])
    args, right = expected["args"], expected["gb"]
    parameters, dp, tp, pp, zero = args
    where = f"for {parameters:,} parameters, dp={dp}, tp={tp}, pp={pp}, zero={zero}"
    value, wrong = _number(got["value"], "GB per GPU")
    if wrong:
        return f"{where}: {wrong}"
    if _close(value, right, 1e-6):
        return None
    shown = f"{where}: expected {right:.7g} GB, got {value:.7g}{_times(value, right)}"
    why = _state_mistake(value, args) if math.isfinite(value) else None
    return shown + (f": {why}" if why else "")


# ------------------------------------------------ 14.2 the bytes tensor parallelism sends

ACTIVATION_BYTES = 2  # bfloat16


def _tp_inputs(kind: str) -> tuple[int, int, int, int, int, bool]:
    draw = random.SystemRandom()
    tokens = draw.randint(1, 8) * draw.choice([2048, 4096, 8192])
    dim = draw.choice([4096, 5120, 8192, 12288, 16384])
    layers, micro_batches = draw.randint(2, 32), draw.randint(2, 64)
    tp = draw.choice([2, 4, 8])
    checkpointing = draw.random() < 0.5
    if kind == "tp 1":
        tp = 1
    elif kind in ("off", "on"):
        checkpointing = kind == "on"
    elif kind == "smallest":
        layers, micro_batches, tp = 1, 1, 2
    return tokens, dim, layers, tp, micro_batches, checkpointing


def _tp_bytes(tokens, dim, layers, tp, micro_batches, checkpointing) -> float:
    slab = tokens * dim * ACTIVATION_BYTES
    per_collective = (tp - 1) / tp * slab  # the all-gather's and the reduce-scatter's
    passes = 2 + bool(checkpointing)  # forward, backward, the recomputed forward
    return passes * layers * micro_batches * 4 * per_collective


def _tp_trial(fn, kind: str):
    args = _tp_inputs(kind)
    return _call("14.2", fn, args), {"args": args, "bytes": _tp_bytes(*args)}


def _tp_mistakes(args: tuple) -> list[tuple[float, str]]:
    """(what a mistake gives, what it is), for the sizes ``args``."""
    tokens, dim, layers, tp, micro_batches, checkpointing = args
    right = _tp_bytes(*args)
    slab = tokens * dim * ACTIVATION_BYTES
    passes = 2 + bool(checkpointing)
    gather = passes * layers * micro_batches * 2 * (tp - 1) / tp * slab
    found = [
        (2 * right, "each all-gather and reduce-scatter priced as an all-reduce, 2(t-1)/t "
                    "of the slab: with sequence parallelism each of the layer's all-reduces "
                    "is split into that pair, and each half sends (t-1)/t"),
        (2 * right, "float32's 4 bytes an element: the activations are bfloat16, 2 bytes"),
        (right + gather * (tp - 1), "an all-gather's input is the rank's 1/tp share of the "
                                    "slab: the ring sends (t-1)/t of the slab, not (t-1) "
                                    "whole slabs"),
        (right * tp / (tp - 1) if tp > 1 else math.nan,
         "each ring sends (t-1)/t of the slab (its own share never leaves it), not all of it"),
        (right / passes, "you counted the forward pass only: backward runs as many "
                         "collectives (an all-gather's gradient is a reduce-scatter, and "
                         "a reduce-scatter's an all-gather)"),
        (right / 2, "each pass has 2 all-gathers and 2 reduce-scatters a layer (attention's "
                    "and the MLP's), not one of each"),
        (right / tp, "the tokens x dim slab is whole: the ring's (t-1)/t already counts "
                     "the shares (you divided by tp once more)"),
        (right / layers, "per layer: multiply by the layers"),
        (right / micro_batches, "per micro-batch: multiply by the micro-batches"),
        (right / GB, "the task asks for bytes, not GB"),
        (right * 8, "the task asks for bytes, not bits"),
    ]
    if checkpointing:
        found.insert(0, (right * 2 / 3, "with activation checkpointing backward runs the "
                                        "forward again: its 2 all-gathers and 2 reduce-"
                                        "scatters a layer count too (3 passes, not 2)"))
    else:
        found.insert(0, (right * 3 / 2, "without activation checkpointing nothing is "
                                        "recomputed: 2 passes, not 3"))
    return found


def _tp_judge(got, expected) -> str | None:
    if got["called"]:
        return _refusal(got["called"])
    args, right = expected["args"], expected["bytes"]
    tokens, dim, layers, tp, micro_batches, checkpointing = args
    where = (f"for tokens={tokens}, dim={dim}, layers={layers}, tp={tp}, micro_batches="
             f"{micro_batches}, checkpointing={checkpointing}")
    value, wrong = _number(got["value"], "bytes one GPU sends")
    if wrong:
        return f"{where}: {wrong}"
    if _close(value, right, 1e-9):
        return None
    if tp == 1:
        return (f"{where}: expected 0 bytes, got {value:,.0f}: with tp = 1 there is no "
                "tensor parallelism, and nothing to send")
    shown = f"{where}: expected {right:,.0f} bytes, got {value:,.0f}{_times(value, right)}"
    why = [said for wrong, said in _tp_mistakes(args) if _close(value, wrong, 1e-9)]
    return shown + (f": {'; or: '.join(why[:2])}" if why else "")


# --------------------------------------------------------- 14.3 the pipeline's bubble


def _bubble_inputs(kind: str) -> tuple[int, int, int]:
    draw = random.SystemRandom()
    pp, v = draw.randint(2, 16), 1
    micro_batches = draw.randint(1, 128)
    if kind == "interleaved":
        v = draw.randint(2, 4)
        micro_batches = pp * draw.randint(1, 8)  # Megatron-LM's rule: a multiple of pp
    elif kind == "pp 1":
        pp = 1
    elif kind == "few":
        pp = draw.randint(4, 16)
        micro_batches = draw.randint(1, pp - 1)
    return pp, micro_batches, v


def _bubble(pp, micro_batches, virtual_stages) -> float:
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)


def _bubble_trial(fn, kind: str):
    args = _bubble_inputs(kind)
    return _call("14.3", fn, args), {"args": args, "share": _bubble(*args)}


def _bubble_mistakes(p: int, m: int, v: int) -> list[tuple[float, str]]:
    right = _bubble(p, m, v)
    over_compute = ("that is the bubble over the compute time (Narayanan et al.'s form); the "
                    "share of the step divides the idle pieces by all of them, idle and busy")
    found = [(right * 100, "a share is between 0 and 1, not a percentage"),
             (1 - right, "that is the busy share; the idle share is 1 minus it"),
             ((p - 1) / (v * m), over_compute)]
    if v > 1:
        found += [((p - 1) / m, over_compute + ", and the v virtual stages shrink it"),
                  ((p - 1) / (m + p - 1), "the v virtual stages are missing: each stage works "
                                          "v·m pieces 1/v as long, and idles p - 1 of them"),
                  ((p - 1) / (v * (m + p - 1)), "the idle pieces are 1/v long too, so p - 1 of "
                                                "them against v·m busy ones: v·m + p - 1, not "
                                                "v·(m + p - 1)")]
    found.append((p / (v * m + p), "p - 1 pieces are idle, not p: the first stage starts at "
                                   "once and the last ends at once"))
    return found


def _bubble_judge(got, expected) -> str | None:
    if got["called"]:
        return _refusal(got["called"])
    (p, m, v), right = expected["args"], expected["share"]
    where = f"for pp={p}, micro_batches={m}, virtual_stages={v}"
    value, wrong = _number(got["value"], "the idle share of the step")
    if wrong:
        return f"{where}: {wrong}"
    if _close(value, right, 1e-9):
        return None
    if p == 1:
        return f"{where}: expected 0, got {value:.6g}: one stage has no bubble"
    shown = f"{where}: expected {right:.6g}, got {value:.6g}"
    why = [said for wrong, said in _bubble_mistakes(p, m, v) if _close(value, wrong, 1e-9)]
    return shown + (f": {'; or: '.join(why[:2])}" if why else "")


EXERCISES = [
    Exercise(
        key="14.1", difficulty=1, minutes=15,
        title="the training state on one GPU", function="training_state_gb",
        cases=[Case("ZeRO-0 (DDP), sizes drawn afresh", ("zero 0",)),
               Case("ZeRO-1", ("zero 1",)), Case("ZeRO-2", ("zero 2",)),
               Case("ZeRO-3", ("zero 3",)),
               Case("dp = 1: ZeRO has no ranks to shard over", ("dp 1",)),
               Case("tp 8 x pp 16: 128 GPUs a model copy", ("large",))],
        trial=_state_trial, judge=_state_judge,
        hint=("each GPU holds 1/(tp x pp) of the parameters, at 2 bytes of weights, 2 of "
              "gradients and 12 of Adam's state (float32 master weights and two moments) each",
              "ZeRO-1 divides the 12 by dp, ZeRO-2 the gradients' 2 as well, ZeRO-3 the "
              "weights' 2 as well; then divide the bytes by 10**9"),
    ),
    Exercise(
        key="14.2", difficulty=2, minutes=20,
        title="the bytes tensor parallelism sends in a step", function="tp_bytes_per_step",
        cases=[Case("tp = 1", ("tp 1",)),
               Case("no recomputation, sizes drawn afresh", ("off",)),
               Case("activation checkpointing", ("on",)),
               Case("one layer, one micro-batch, tp = 2", ("smallest",))],
        trial=_tp_trial, judge=_tp_judge,
        hint=("on a ring of t ranks an all-gather sends t - 1 pieces of its input (here the "
              "rank's 1/t of the slab) and a reduce-scatter (t-1)/t of its input (the "
              "slab): each sends (t-1)/t x tokens x dim x 2 bytes",
              "per layer and micro-batch: 4 collectives in the forward pass, 4 in backward, "
              "and 4 more for the recomputed forward with checkpointing; then times layers "
              "and micro_batches"),
    ),
    Exercise(
        key="14.3", difficulty=1, minutes=10,
        title="the pipeline's bubble", function="bubble_share",
        cases=[Case("1F1B (v = 1), sizes drawn afresh", ("1f1b",)),
               Case("interleaved, v drawn from 2 to 4", ("interleaved",)),
               Case("pp = 1", ("pp 1",)),
               Case("fewer micro-batches than stages", ("few",))],
        trial=_bubble_trial, judge=_bubble_judge,
        hint=("draw one stage's timeline: it works v·m pieces (each micro-batch's, 1/v of a "
              "stage's layers at a time) and idles while the pipeline fills and drains",
              "the idle pieces are p - 1, as long as the busy ones: the idle share is "
              "(p - 1) / (v·m + p - 1)"),
    ),
]
