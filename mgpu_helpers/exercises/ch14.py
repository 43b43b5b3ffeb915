"""Chapter 14's exercises: a training configuration's numbers worked out by hand, at H100
scale. The reader's function takes sizes and returns a number (or None, where 14.4 asks
for it); the checker draws the sizes afresh on each check, computes the answer from the
formula itself and, where the number is wrong, names the term that is. No ranks: every
case runs in this process.

While the reader's function runs, the planner and what it is built from (the public
functions of :mod:`mgpu_helpers.planning.planner`, :mod:`mgpu_helpers.planning.strategy`,
:mod:`mgpu_helpers.planning.costs` and the pipeline's bubble formulas) refuse to run: wherever a
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
from fractions import Fraction

from .core import Case, Exercise, as_number, beyond, calls_during

GB = 10**9
RULE = "compute it from the formula; the planner is what you are checking"
#: Where the functions that would do the work live.
_HOMES = ("mgpu_helpers.planning.planner", "mgpu_helpers.planning.strategy",
          "mgpu_helpers.planning.costs", "mgpu_helpers.parallel.pipeline.timeline")


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
                # as the chapter imports them: planner.x (from mgpu_helpers.planning)
                shown = home.removeprefix("mgpu_helpers.planning.").removeprefix("mgpu_helpers.")
                found[value] = f"{shown}.{name}"
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
    modules that import it: ``parallel.pipeline``...) holds a
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


# ------------------------------------------ 14.4 the cheapest configuration that fits

#: A plan fits when its state and activations take at most this share of a GPU's memory:
#: the planner's rule (``planner.predict``'s ``headroom=0.1``, and ``<=``).
USABLE = Fraction(9, 10)
DPS = tuple(2**k for k in range(11))  # the data-parallel sizes tried: 1, 2, 4 ... 1024
_MEMORIES = (40, 80, 94, 141, 192)  # GB: A100, H100, H100 NVL, H200, B200
#: The boundary case's memories: 0.9 x and 0.1 x of these are exact in binary floating
#: point, so state + activations can equal 0.9 x memory_gb in the reader's arithmetic too.
_BOUNDARY_MEMORIES = (40, 80)


def _fit_state(parameters: int, tp: int, dp: int) -> Fraction:
    """GB of training state per GPU, exactly: ZeRO-3 (FSDP) over dp, split by tp."""
    return Fraction(parameters * sum(PER_PARAMETER), tp * dp * GB)


def _fewest(args: tuple) -> int | None:
    """The answer, in exact arithmetic: the first tp x dp that fits, or None."""
    parameters, layers, per_layer, tp, memory = args
    kept, usable = layers * Fraction(per_layer), USABLE * memory
    return next((tp * dp for dp in DPS
                 if _fit_state(parameters, tp, dp) + kept <= usable), None)


def _fit_variant(args: tuple, usable=0.9, activations=True, split=True, strict=False,
                 unit=GB, per_parameter=16, largest=DPS[-1]) -> int | None:
    """What a reader's loop returns, in floats; the keywords make the mistakes."""
    parameters, layers, per_layer, tp, memory = args
    kept = layers * per_layer if activations else 0
    for dp in (dp for dp in DPS if dp <= largest):
        total = parameters * per_parameter / ((tp if split else 1) * dp) / unit + kept
        if (total < usable * memory) if strict else (total <= usable * memory):
            return tp * dp
    return None


def _exact_at_the_boundary(args: tuple, dp: int) -> bool:
    """True when every usual way of writing the sum gives exactly 0.9 x memory_gb at
    ``dp`` (a multiplication by 1e-9 rounds for some sizes: those are drawn again)."""
    p, layers, per_layer, tp, memory = args
    state, usable = _fit_state(p, tp, dp), USABLE * memory
    states = (p * 16 / (tp * dp) / 1e9, p / (tp * dp) * 16 / 1e9, p * 16 / 1e9 / tp / dp,
              p / 1e9 * 16 / (tp * dp), p * 16 / (tp * dp * 1e9), p * 16 * 1e-9 / (tp * dp),
              p * 1e-9 * 16 / tp / dp, p / (tp * dp) * 16 * 1e-9, p * 16e-9 / (tp * dp),
              p * 1.6e-8 / tp / dp)
    limits = (0.9 * memory, memory * 0.9, memory * (1 - 0.1), memory - 0.1 * memory,
              memory - memory / 10, memory * 9 / 10)
    kept = layers * per_layer
    in_bytes = (p * 16 / (tp * dp) + kept * 1e9, 0.9 * memory * 1e9, memory * 1e9 * 0.9)
    return (all(Fraction(s) == state for s in states)
            and all(Fraction(limit) == usable for limit in limits)
            and Fraction(kept) == layers * Fraction(per_layer) == usable - state
            and (float(state) + kept) / 0.9 == memory
            and all(Fraction(b) == usable * GB for b in in_bytes))


def _fit_draw(draw, kind: str) -> tuple | None:
    if kind == "boundary":
        memory, tp = draw.choice(_BOUNDARY_MEMORIES), draw.choice([4, 8])
        dp, layers = 2**draw.randint(1, 9), draw.randint(8, 96)
        per_layer = draw.randint(1, 48) / 16
        state = USABLE * memory - layers * Fraction(per_layer)
        if state < 1:
            return None
        parameters = state * GB * tp * dp / sum(PER_PARAMETER)  # a whole number
        args = (int(parameters), layers, per_layer, tp, memory)
        return args if _exact_at_the_boundary(args, dp) else None
    memory, layers = draw.choice(_MEMORIES), draw.randint(16, 126)
    tp, usable = draw.choice([1, 2, 4, 8]), 0.9 * memory
    if kind == "dp 1":  # fits on one rank; the state not split by tp does not
        tp = draw.choice([2, 4, 8])
        kept = usable * draw.uniform(0.2, 0.6)
        state = (usable - kept) * draw.uniform(0.6, 0.9)
    elif kind in ("doublings", "1024"):
        # at dp the plan fits with room to spare (dp's exact ceiling is not a power of
        # two); at dp / 2 it needs some of the 10% headroom, and without activations
        # dp / 4 would fit
        dp = 1024 if kind == "1024" else 2**draw.randint(2, 9)
        over = memory * draw.uniform(0.021, 0.05)
        at_dp = over * draw.uniform(2, 4)
        kept = usable + over - 2 * at_dp
        state = at_dp * dp
    elif kind == "activations":
        kept = usable * draw.uniform(1.03, 1.3)
        state = usable * draw.uniform(0.5, 50)
    else:  # "beyond 1024": the activations fit, the state does not even over 1024 ranks
        kept = usable * draw.uniform(0.85, 0.97)
        state = DPS[-1] * (usable - kept) * draw.uniform(1.2, 3)
    per_layer = round(kept / layers, 4)
    parameters = max(1, round(state * tp * GB / sum(PER_PARAMETER) / 10**6)) * 10**6
    return parameters, layers, per_layer, tp, memory


def _fit_inputs(kind: str) -> tuple[int, int, float, int, int]:
    draw = random.SystemRandom()
    while (args := _fit_draw(draw, kind)) is None:
        pass
    return args


def _fit_trial(fn, kind: str):
    args = _fit_inputs(kind)
    return _call("14.4", fn, args), {"args": args, "gpus": _fewest(args)}


def _fit_departures(args: tuple) -> list[tuple[str, list[tuple]]]:
    """Each way of going wrong: (keyword, [(value, weight, what it is)]), the right way
    first; a bytes-per-parameter or GiB reading weighs more, being less likely. Readings
    of one weight are told in this order."""
    parameters, layers, per_layer, tp, memory = args
    dp = (_fewest(args) or tp) // tp  # where a strict < differs, if anywhere
    return [  # in the order ties are told: stopping short matters only at dp = 1024
        ("largest", [(DPS[-1], 0, ""), (DPS[-2], 1, (
            f"dp goes up to {DPS[-1]} = 2**10, included: you stopped at {DPS[-2]}"))]),
        ("usable", [(0.9, 0, ""), (1.0, 1, "a plan fits when state + activations <= 0.9 x "
                                           "memory_gb (10% headroom, the planner's rule): "
                                           "you compared with all of memory_gb")]),
        ("activations", [(True, 0, ""), (False, 1, (
            f"each GPU also keeps layers x activations_gb_per_layer = "
            f"{layers * per_layer:.6g} GB of activations, whatever dp is: you left them "
            "out"))]),
        ("split", [(True, 0, ""), (False, 1, (
            f"tensor parallelism splits the model over tp = {tp} GPUs before FSDP shards "
            "it over dp: divide the state by tp x dp, not by dp alone"))]),
        ("strict", [(False, 0, ""), (True, 1, (
            f"at dp = {dp} state + activations come to 0.9 x memory_gb = {0.9 * memory:g} "
            "GB exactly, and that fits (<=, the planner's rule): you used <"))]),
        ("unit", [(GB, 0, ""),
                  (1, 1, "your state is in bytes: divide it by 10**9 to compare it with "
                         "memory_gb (GB)"),
                  (2**30, 1.5, "your state is in GiB (2**30 bytes): memory_gb counts GB, "
                               "10**9 bytes")]),
        ("per_parameter", [(16, 0, ""), (12, 1.5, (
            "AdamW in mixed precision keeps 2 + 2 + 12 = 16 bytes a parameter (bfloat16 "
            "weights and gradients; float32 master weights and two moments): you used "
            "12"))]),
    ]


def _fit_mistake(value: float | None, args: tuple) -> str | None:
    """What explains ``value`` (a number, or None): the readings with the fewest
    departures from the rule that give it, two at most."""
    tp = args[3]
    departures = _fit_departures(args)
    names = [name for name, _ in departures]
    returned_dp = ("you returned dp: the task asks for the number of GPUs, tp x dp "
                   f"(tp = {tp})")
    found = []
    for choice in itertools.product(*(options for _, options in departures)):
        answer = _fit_variant(args, **dict(zip(names, (c[0] for c in choice), strict=True)))
        weight = sum(c[1] for c in choice)
        order = tuple(i for i, c in enumerate(choice) if c[1])
        said = [c[2] for c in choice if c[2]]
        if said and answer == value:
            found.append((weight, order, said))
        if tp > 1 and answer is not None and value == answer / tp:
            found.append((weight + 1, (*order, len(names)), [*said, returned_dp]))
    if not found:
        return None
    found.sort(key=lambda item: item[:2])
    best = [said for weight, _, said in found if weight == found[0][0]]
    return "; or: ".join("; ".join(said) for said in best[:2])


def _fit_why_none(args: tuple) -> str:
    parameters, layers, per_layer, tp, memory = args
    kept, usable = layers * per_layer, 0.9 * memory
    if kept >= usable:
        return (f"the activations alone, layers x activations_gb_per_layer = {kept:.6g} GB, "
                f"are more than 0.9 x memory_gb = {usable:.6g} GB, whatever dp is")
    most = float(_fit_state(parameters, tp, DPS[-1])) + kept
    return (f"even dp = {DPS[-1]} leaves {most:.6g} GB on each GPU, more than 0.9 x "
            f"memory_gb = {usable:.6g} GB")


def _gpus(value: float) -> str:
    return f"{int(value)}" if value.is_integer() else f"{value:.6g}"


def _fit_judge(got, expected) -> str | None:
    if got["called"]:
        return _refusal(got["called"])
    args, right = expected["args"], expected["gpus"]
    parameters, layers, per_layer, tp, memory = args
    where = (f"for parameters={parameters:,}, layers={layers}, activations_gb_per_layer="
             f"{per_layer!r}, tp={tp}, memory_gb={memory!r}")
    value = got["value"]
    number = as_number(value)
    if right is None:
        if value is None:
            return None
        shown = (f"{where}: expected None, got {value!r}: {_fit_why_none(args)}; return None "
                 f"when no dp from 1 to {DPS[-1]} fits")
        why = _fit_mistake(number, args) if number is not None else None
        return shown + (f" (and {why})" if why else "")
    dp = right // tp
    shown = f"{where}: expected {right} GPUs (tp {tp} x dp {dp}), got "
    if value is None:
        state = float(_fit_state(parameters, tp, dp))
        kept = layers * per_layer
        return shown + "None: " + (_fit_mistake(None, args) or (
            f"at dp = {dp} the state ({state:.6g} GB) and the activations ({kept:.6g} GB) "
            f"come to {state + kept:.6g} GB, within 0.9 x memory_gb = {0.9 * memory:.6g} "
            "GB"))
    if number is None:
        return (f"{where}: expected a number of GPUs (or None where no dp fits), got "
                f"{type(value).__name__}")
    if number == right:
        return None
    shown += _gpus(number) if math.isfinite(number) else f"{number}"
    if not (math.isfinite(number) and number.is_integer()):
        return shown + ": a number of GPUs is whole: tp x dp"
    whole = int(number)
    if whole > 0 and whole % tp == 0 and (whole // tp) & (whole // tp - 1):
        return (shown + f": dp is a power of two (1, 2, 4 ... {DPS[-1]}): you returned tp x "
                f"{whole // tp}, and {whole // tp} is not one; the smallest power of two "
                f"that fits is {dp}")
    why = _fit_mistake(number, args)
    return shown + (f": {why}" if why else "")


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
    Exercise(
        key="14.4", difficulty=2, minutes=20,
        title="the cheapest configuration that fits", function="fewest_gpus",
        cases=[Case("fits on dp = 1, sizes drawn afresh", ("dp 1",)),
               Case("several doublings of dp", ("doublings",)),
               Case("state + activations exactly 0.9 x memory_gb at some dp", ("boundary",)),
               Case("the activations alone do not fit", ("activations",)),
               Case("not even dp = 1024 is enough", ("beyond 1024",)),
               Case("dp = 1024, the last to try", ("1024",))],
        trial=_fit_trial, judge=_fit_judge,
        hint=("each GPU holds parameters x 16 bytes / (tp x dp) of state (ZeRO-3 shards all "
              "of it over dp; divide by 10**9 for GB) and layers x activations_gb_per_layer "
              "GB of activations, whatever dp is",
              "try dp = 1, 2, 4 ... 1024 in turn and return tp x dp at the first where state "
              "+ activations <= 0.9 x memory_gb; if none does, return None"),
    ),
]
