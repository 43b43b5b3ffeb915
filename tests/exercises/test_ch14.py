"""Chapter 14's exercises (analytic, in this process): the reference passes on every draw,
the stub is not attempted, each plausible mistake fails on every draw and says why, the
planner and its formulas are refused however they are reached and put back after, copied
answers fail the next check, and the checker's formulas agree with the planner's."""

import dataclasses
import inspect
import random
from fractions import Fraction

import numpy as np
import pytest

from mgpu_helpers import exercises
from mgpu_helpers.exercises import ch14, core
from mgpu_helpers.parallel import pipeline
from mgpu_helpers.parallel.pipeline import timeline
from mgpu_helpers.planning import costs, planner, strategy
from solutions import ch14 as solutions

KEYS = ("14.1", "14.2", "14.3", "14.4")
DRAWS = 5  # every case is drawn afresh: a mistake must fail on every draw, not on most


@pytest.fixture(autouse=True)
def private_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("MGPU_EXERCISE_PROGRESS", str(tmp_path / "progress.json"))


def stub(*args):
    raise NotImplementedError


def text(report):
    return "\n".join(report.lines())


def test_chapter_14_registers_four_exercises_in_this_process():
    registered = [key for key in exercises.registry() if key.startswith("14.")]
    assert registered == list(KEYS)
    assert all(case.world == 0 for key in KEYS for case in exercises.get(key).cases)


@pytest.mark.parametrize("key", KEYS)
def test_the_reference_and_other_correct_answers_pass_every_draw(key):
    for right in [solutions.REFERENCE[key], *solutions.ALTERNATIVES[key]]:
        for _ in range(DRAWS):
            report = core.evaluate(exercises.get(key), right)
            assert report.passed, text(report)


@pytest.mark.parametrize("key", KEYS)
def test_the_untouched_stub_is_not_attempted(key):
    exercise = exercises.get(key)
    (line,) = exercises.run(key, stub, record=False).lines()
    assert line == (f"Exercise {key} · {exercise.title}: not attempted yet (replace the "
                    f"NotImplementedError in `{exercise.function}`, then run this cell again)")


MISTAKES = [(key, index) for key in KEYS for index in range(len(solutions.MISTAKES[key]))]


@pytest.mark.parametrize(("key", "index"), MISTAKES)
def test_each_mistake_fails_on_every_draw_and_says_why(key, index):
    wrong, status, phrase = solutions.MISTAKES[key][index]
    for _ in range(DRAWS):
        report = core.evaluate(exercises.get(key), wrong)
        assert not report.passed and status in {o.status for o in report.outcomes}, text(report)
        assert phrase in text(report), text(report)


def test_each_exercise_has_three_mistakes_or_more():
    assert all(len(solutions.MISTAKES[key]) >= 3 for key in KEYS)


# ------------------------------------------------------------------ the planner refused

WATCHED = [(planner, "predict"), (planner, "stage_memory"), (planner, "layers_in_flight"),
           (planner, "collective_seconds"), (costs, "ring_bytes_sent"),
           (costs, "training_state_bytes"), (strategy, "memory_budget"),
           (timeline, "theoretical_bubble"), (pipeline, "theoretical_bubble")]


def test_every_helper_is_back_on_its_module_after_a_check_even_one_that_raised():
    before = [getattr(module, name) for module, name in WATCHED]
    for wrong in (solutions.tp_bytes_through_the_planner, solutions.bubble_through_the_package,
                  solutions.fewest_gpus_through_the_planner, solutions.REFERENCE["14.1"]):
        for key in KEYS:
            core.evaluate(exercises.get(key), wrong)
    assert [getattr(module, name) for module, name in WATCHED] == before
    assert planner.predict.__module__ == "mgpu_helpers.planning.planner"


def test_a_refusal_caught_by_the_readers_code_still_fails_the_case():
    def swallowing(pp, micro_batches, virtual_stages):
        try:
            return planner.collective_seconds("send", 1, 2, 1.0, 0.0)
        except Exception:  # the refusal: fall back to the formula
            return (pp - 1) / (virtual_stages * micro_batches + pp - 1)

    report = core.evaluate(exercises.get("14.3"), swallowing)
    assert {o.status for o in report.outcomes} == {"fail"}
    assert "your function called planner.collective_seconds: compute it from the formula" in (
        report.outcomes[0].detail)


def test_the_refusal_names_the_helper_the_reader_called_not_one_it_calls():
    report = core.evaluate(exercises.get("14.3"), solutions.bubble_through_an_alias)
    assert "timeline.theoretical_bubble does not run inside exercise 14.3" in text(report)
    assert "check_counts" not in text(report)


def test_the_checkers_own_formulas_run_outside_the_refusal():
    # the reference's numbers are the checker's: drawing and judging need no helper
    assert ch14._bubble(4, 8, 2) == pytest.approx(3 / 19)
    assert costs.ring_bytes_sent("all_gather", 10, 2) == 10  # usable again


# ------------------------------------------------------------------ fresh inputs


@pytest.mark.parametrize("key", KEYS)
def test_answers_copied_from_one_check_fail_the_next(key, monkeypatch):
    # two checks, two known draws (os.urandom's would differ, but might coincide)
    seeds = iter(range(1, 1000))
    monkeypatch.setattr(random, "SystemRandom", lambda: random.Random(next(seeds)))
    exercise = exercises.get(key)
    seen, again = [], []

    def answer(expected):
        return expected[next(k for k in expected if k != "args")]

    recording = dataclasses.replace(exercise, judge=lambda got, expected: seen.append(expected))
    assert core.evaluate(recording, solutions.REFERENCE[key]).passed
    answers = iter([answer(expected) for expected in seen])

    def copied(*args):  # the case's answer as the last check showed it, in the cases' order
        return next(answers)

    def judged(got, expected):
        again.append(expected)
        return exercise.judge(got, expected)

    report = core.evaluate(dataclasses.replace(exercise, judge=judged), copied)
    assert not report.passed, text(report)
    # 14.4's answers are few (tp x a power of two, or None where nothing fits): a copied
    # one can be right by chance; every one that differs from the new draw's fails
    fixed = ("tp 1", "pp 1", "activations", "beyond 1024")  # 0, or None, by construction
    drawn = [o for o, before, now in zip(report.outcomes, seen, again, strict=True)
             if o.case.args[0] not in fixed and (key != "14.4" or answer(before) != answer(now))]
    assert drawn and all(o.status == "fail" for o in drawn), text(report)


# ------------------------------------------------------------------ what a failure says


def state_said(value, args):
    return ch14._state_judge({"value": value, "called": []},
                             {"args": args, "gb": ch14._state(*args)})


def test_14_1_names_the_term_that_is_wrong():
    args = (70 * 10**9, 4, 4, 2, 3)  # ZeRO-3 over 4 ranks, 1/8 of the model per GPU
    right = 70e9 / 8 * 16 / 4 / 1e9
    assert state_said(right, args) is None
    weights_whole = 70e9 / 8 * (2 + 2 / 4 + 12 / 4) / 1e9
    said = state_said(weights_whole, args)
    assert said.startswith("for 70,000,000,000 parameters, dp=4, tp=4, pp=2, zero=3: "
                           "expected 35 GB, got")
    assert "your weights term is 4x too big" in said
    assert "your result is in bytes" in state_said(right * 1e9, args)
    assert "GiB" in state_said(right * 1e9 / 2**30, args)
    assert "you divided by tp = 4 only" in state_said(right * 2, args)
    assert "expected a number (GB per GPU), got str" in state_said("35", args)
    assert "expected 35 GB, got nan" in state_said(float("nan"), args)
    # ZeRO-1: the weights and gradients whole, Adam's 12 bytes sharded
    zero1 = (70 * 10**9, 4, 4, 2, 1)
    said = state_said(70e9 / 8 * (2 / 4 + 2 + 12 / 4) / 1e9, zero1)
    assert ("ZeRO-1 keeps the weights whole on every data-parallel rank (sharding them "
            "starts at ZeRO-3)") in said


def test_14_2_names_the_missing_pass_and_the_all_reduce_pricing():
    args = (8192, 8192, 10, 4, 8, True)
    right = ch14._tp_bytes(*args)
    assert right == 3 * 10 * 8 * 4 * 3 / 4 * 8192 * 8192 * 2

    def said(value, sizes=args):
        return ch14._tp_judge({"value": value, "called": []},
                              {"args": sizes, "bytes": ch14._tp_bytes(*sizes)})

    assert said(right) is None and said(int(right)) is None
    assert "3 passes, not 2" in said(right * 2 / 3)
    assert "priced as an all-reduce" in said(right * 2)
    assert "with tp = 1 there is no tensor parallelism" in said(5.0, (8192, 8192, 10, 1, 8,
                                                                      False))
    assert said(0, (8192, 8192, 10, 1, 8, False)) is None


def test_14_3_tells_the_bubble_over_the_compute_from_the_share_of_the_step():
    def said(value, args):
        return ch14._bubble_judge({"value": value, "called": []},
                                  {"args": args, "share": ch14._bubble(*args)})

    assert said(3 / 19, (4, 8, 2)) is None
    assert "over the compute time" in said(3 / 16, (4, 8, 2))
    assert "virtual stages are missing" in said(3 / 11, (4, 8, 2))
    assert "busy share" in said(16 / 19, (4, 8, 2))
    assert "one stage has no bubble" in said(0.1, (1, 8, 1))


def fit_said(value, args):
    return ch14._fit_judge({"value": value, "called": []},
                           {"args": args, "gpus": ch14._fewest(args)})


def test_14_4_names_the_mistake_and_asks_for_none_where_nothing_fits():
    # 7B parameters over tp 2: 56 GB of state at dp = 1, 28 at dp = 2, 14 at dp = 4;
    # 32 layers x 1.5 GB = 48 GB of activations; 0.9 x 80 = 72 GB usable
    args = (7 * 10**9, 32, 1.5, 2, 80)
    assert ch14._fewest(args) == 8
    assert fit_said(8, args) is None and fit_said(8.0, args) is None
    assert fit_said(np.int64(8), args) is None
    # 4 is dp, and also what fits without the headroom (28 + 48 = 76 GB <= 80): both told
    assert fit_said(4, args).endswith(
        "expected 8 GPUs (tp 2 x dp 4), got 4: a plan fits when state + activations <= 0.9 x "
        "memory_gb (10% headroom, the planner's rule): you compared with all of memory_gb; "
        "or: you returned dp: the task asks for the number of GPUs, tp x dp (tp = 2)")
    assert fit_said(2, args).endswith("got 2: each GPU also keeps layers x "
                                      "activations_gb_per_layer = 48 GB of activations, "
                                      "whatever dp is: you left them out")
    assert "is not one" in fit_said(6, args)
    assert "a number of GPUs is whole" in fit_said(7.5, args)
    assert "got None: your state is in bytes" in fit_said(None, args)
    assert "expected a number of GPUs (or None where no dp fits), got str" in fit_said("8",
                                                                                       args)
    too_many = (7 * 10**9, 32, 2.5, 2, 80)  # 80 GB of activations: over 72 whatever dp is
    assert ch14._fewest(too_many) is None and fit_said(None, too_many) is None
    said = fit_said(0, too_many)
    assert "the activations alone, layers x activations_gb_per_layer = 80 GB" in said
    assert "return None when no dp from 1 to 1024 fits" in said
    assert "return None" in fit_said(False, too_many)
    huge = (10**15, 32, 1.5, 1, 80)  # 16 PB of state: 15.6 TB a GPU at dp = 1024
    assert ch14._fewest(huge) is None
    assert "even dp = 1024 leaves" in fit_said(1024, huge)


def test_14_4_at_exactly_0_9_x_memory_it_fits_and_less_than_is_named():
    # 72 GB usable: 40 GB of activations and, at dp = 8 over tp 4, 32 GB of state
    args = (64 * 10**9, 20, 2.0, 4, 80)
    assert ch14._fit_state(64 * 10**9, 4, 8) == 32
    assert ch14._fewest(args) == 32
    assert solutions.fewest_gpus(*args) == 32
    assert solutions.fewest_gpus_closed_form(*args) == 32
    assert "come to 0.9 x memory_gb = 72 GB exactly, and that fits" in fit_said(64, args)


KINDS = [case.args[0] for case in exercises.get("14.4").cases]


@pytest.mark.parametrize("kind", KINDS)
def test_14_4s_draws_have_the_edge_their_case_names(kind):
    for _ in range(40):
        args = ch14._fit_inputs(kind)
        parameters, layers, per_layer, tp, memory = args
        right, kept = ch14._fewest(args), layers * Fraction(per_layer)
        usable = Fraction(9, 10) * memory
        dp = (right or tp) // tp

        def variant(args=args, **departures):
            return ch14._fit_variant(args, **departures)

        assert variant() == right  # floats, away from every threshold but the boundary's
        if kind == "dp 1":
            assert right == tp > 1 and variant(split=False) > tp
        elif kind in ("doublings", "1024"):
            assert dp == (1024 if kind == "1024" else dp) and dp >= 4
            assert variant(usable=1.0) == right // 2  # only the headroom lets dp / 2 fit
            assert variant(activations=False) <= right // 4
            ceiling = solutions.fewest_gpus_exact_ceiling(*args) // tp
            assert dp // 2 < ceiling < dp
        elif kind == "boundary":
            assert ch14._fit_state(parameters, tp, dp) + kept == usable
            assert variant(strict=True) == 2 * right and tp > 2
        elif kind == "activations":
            assert right is None and kept > usable
        else:
            assert right is None and kept < usable
            assert ch14._fit_state(parameters, tp, 1024) + kept > usable


# ------------------------------------------------------------------ agreement with the planner


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_14_1s_formula_is_the_planners_state_without_tp_or_pp(zero):
    model = planner.Model("a 7B-like GPT", layers=32, dim=4096, heads=32, ffn=11008,
                          vocab=32000, gated=True, norm_parameters=1)
    memory = planner.stage_memory(model, planner.Plan(dp=8, zero=zero), 4096, 0)
    state = memory["weights"] + memory["gradients"] + memory["optimizer"]
    expected = ch14._state(model.total_parameters(), 8, 1, 1, zero) * ch14.GB
    assert state == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("tp", "micro_batches", "checkpointing"),
                         [(2, 1, False), (4, 8, True), (8, 3, False)])
def test_14_2s_formula_is_the_planners_tp_traffic(tp, micro_batches, checkpointing):
    model = planner.Model("a GPT", layers=12, dim=2048, heads=16, ffn=8192, vocab=1000)
    plan = planner.Plan(tp=tp, micro_batches=micro_batches, checkpointing=checkpointing)
    sent = planner.predict(model, planner.H100_NODES, plan, 4096).communication["tp"]
    assert sent.bytes_sent == pytest.approx(
        ch14._tp_bytes(4096, 2048, 12, tp, micro_batches, checkpointing), rel=1e-12)


@pytest.mark.parametrize(("pp", "micro_batches", "virtual"), [(2, 1, 1), (4, 8, 2), (8, 3, 1)])
def test_14_3s_formula_is_the_pipelines_and_the_planners_bubble(pp, micro_batches, virtual):
    share = ch14._bubble(pp, micro_batches, virtual)
    assert share == pytest.approx(timeline.theoretical_bubble(pp, micro_batches, virtual))
    model = planner.Model("a GPT", layers=16, dim=1024, heads=8, ffn=4096, vocab=1000)
    plan = planner.Plan(pp=pp, micro_batches=micro_batches, virtual_stages=virtual)
    prediction = planner.predict(model, planner.H100_NODES, plan, 2048)
    assert prediction.bubble_s / prediction.step_s == pytest.approx(share, rel=1e-12)


@pytest.mark.parametrize(("tp", "dp"), [(1, 1), (2, 8), (8, 64)])
def test_14_4s_state_is_the_planners_at_zero_3_with_the_norms_whole(tp, dp):
    model = planner.LLAMA2_7B  # rotary: no position embedding; the norms stay whole
    memory = planner.stage_memory(model, planner.Plan(dp=dp, tp=tp, zero=3), 4096, 0)
    state = memory["weights"] + memory["gradients"] + memory["optimizer"]
    norms = model.parameters()["norms"]
    split = ch14._fit_state(model.total_parameters() - norms, tp, dp) * ch14.GB
    assert state == pytest.approx(float(split) + norms * 16 / dp, rel=1e-12)
    assert float(split) == pytest.approx(
        ch14._state(model.total_parameters() - norms, dp, tp, 1, 3) * ch14.GB, rel=1e-12)


def test_14_4s_headroom_is_the_planners():
    headroom = inspect.signature(planner.predict).parameters["headroom"].default
    assert ch14.USABLE == 1 - Fraction(headroom).limit_denominator(100)
