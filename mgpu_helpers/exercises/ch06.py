"""Chapter 06's exercises: pipeline schedules, checked by simulating them.

The reader writes a schedule: for each of K stages, the order in which it runs the
forward ("F", m) and backward ("B", m) passes of M micro-batches. :func:`simulate` runs
the stages side by side with every pass taking one time unit, as chapter 06's
theory does: a stage's forward of micro-batch m waits for the previous stage's; its
backward waits for the next stage's backward (the last stage's for its own forward).
It reports a deadlock (a stage waiting for a pass that can never come), the step's
length, the bubble, and the most micro-batches whose activations a stage holds at once
(forward done, backward not yet).
"""

from __future__ import annotations

from .core import Case, Exercise, count


def simulate(schedule, stages: int, micro_batches: int) -> dict:
    """See the module's docstring; raises ValueError for a malformed schedule."""
    if not isinstance(schedule, (list, tuple)) or len(schedule) != stages:
        raise ValueError(f"expected a list of {stages} stages' orders, got "
                         f"{type(schedule).__name__} of length "
                         f"{len(schedule) if hasattr(schedule, '__len__') else '?'}")
    wanted = sorted((kind, m) for kind in "BF" for m in range(micro_batches))
    orders = []
    for stage, order in enumerate(schedule):
        order = [tuple(action) for action in order]
        unknown = [action for action in order if action not in wanted]
        if unknown:
            only = count(micro_batches, "micro-batch", "micro-batches")
            raise ValueError(f"stage {stage} runs {unknown[0]}, but there "
                             f"{'is' if micro_batches == 1 else 'are'} only {only} (m in "
                             f"0..{micro_batches - 1}): no stage can run more forward passes "
                             "than there are micro-batches")
        if sorted(order) != wanted:
            raise ValueError(f"stage {stage} must run ('F', m) and ('B', m) once for each "
                             f"micro-batch m in 0..{micro_batches - 1}; it runs {order}")
        orders.append(order)
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, m) -> time it finished
    position, holding, peak = [0] * stages, [0] * stages, [0] * stages
    time, busy = 0, 0
    while any(p < 2 * micro_batches for p in position):
        ran = []
        for stage in range(stages):
            if position[stage] == 2 * micro_batches:
                continue
            kind, m = orders[stage][position[stage]]
            if kind == "F":
                needs = [("F", stage - 1, m)] if stage > 0 else []
            else:
                needs = [("F", stage, m)] + (
                    [("B", stage + 1, m)] if stage < stages - 1 else [])
            if all(done.get(need, time + 1) <= time for need in needs):
                ran.append((stage, kind, m))
        if not ran:
            if not any(finish > time for finish in done.values()):
                waiting = [f"stage {s} waits to run {orders[s][position[s]]}"
                           for s in range(stages) if position[s] < 2 * micro_batches]
                return {"deadlock": "; ".join(waiting)}
        for stage, kind, m in ran:
            done[(kind, stage, m)] = time + 1
            position[stage] += 1
            holding[stage] += 1 if kind == "F" else -1
            peak[stage] = max(peak[stage], holding[stage])
            busy += 1
        time += 1
    return {"deadlock": None, "length": time, "bubble": 1 - busy / (stages * time),
            "peak_held": peak}


def _trial(kind: str):
    def trial(fn, stages: int, micro_batches: int):
        schedule = fn(stages, micro_batches)
        try:
            got = simulate(schedule, stages, micro_batches)
        except ValueError as error:  # a malformed schedule: a failed case, said plainly
            got = {"malformed": str(error)}
        best = 2 * (micro_batches + stages - 1)  # unit passes: fill, steady state, drain
        if kind == "GPipe":
            held = [micro_batches] * stages
        else:  # 1F1B: stage s holds at most K - s micro-batches (fewer if M is small)
            held = [min(stages - stage, micro_batches) for stage in range(stages)]
        return got, {"length": best, "peak_held": held, "kind": kind}
    return trial


def _judge(got, expected) -> str | None:
    if got.get("malformed"):
        return got["malformed"]
    if got["deadlock"]:
        return f"deadlock: {got['deadlock']}"
    if got["length"] != expected["length"]:
        return (f"the step takes {got['length']} time units, expected "
                f"{expected['length']} = 2(M+K-1): some stage waits longer than it must")
    if got["peak_held"] != expected["peak_held"]:
        fewer = (expected["kind"] == "GPipe"
                 and any(g < e for g, e in zip(got["peak_held"], expected["peak_held"],
                                                strict=True)))
        return (f"activations held at once, per stage: expected {expected['peak_held']}, "
                f"got {got['peak_held']}"
                + (": GPipe runs every forward before any backward" if fewer else ""))
    return None


def _cases():
    return [Case(f"K = {count(stages, 'stage')}, "
                 f"M = {count(micro_batches, 'micro-batch', 'micro-batches')}",
                 (stages, micro_batches))
            for stages, micro_batches in ((2, 4), (4, 4), (4, 8), (3, 2), (1, 3),
                                          # K - 1 > M: fewer micro-batches than a full
                                          # warm-up would take
                                          (4, 2), (6, 3), (5, 1))]


EXERCISES = [
    Exercise(
        key="06.1", difficulty=2, minutes=30,
        title="the GPipe schedule", function="gpipe_order",
        cases=_cases(), trial=_trial("GPipe"), judge=_judge,
        hint="every stage runs all its forward passes, then all its backward passes; the "
             "backward passes reach a stage in the order the next stage runs them",
    ),
    Exercise(
        key="06.2", difficulty=3, minutes=45,
        title="the 1F1B schedule", function="one_f_one_b_order",
        cases=_cases(), trial=_trial("1F1B"), judge=_judge,
        hint="stage s starts with K - s - 1 forward passes (never more than M), then "
             "alternates one forward and one backward, then finishes the backwards",
    ),
]
