"""The exercises' checker (mgpu_helpers.exercises) and every exercise's cases: the
reference solution passes them all, the chapter's stub is "not attempted yet", and each
plausible mistake fails, with a message that says what went wrong."""

import dataclasses
import importlib
import os
import re
from pathlib import Path

import nbformat
import pytest

import mgpu_helpers as mh
from mgpu_helpers import exercises
from mgpu_helpers.exercises import core, progress

ROOT = Path(__file__).resolve().parents[2]
EXERCISES = exercises.registry()
pytestmark = pytest.mark.usefixtures("no_leftover_processes")



@pytest.fixture(autouse=True)
def private_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("MGPU_EXERCISE_PROGRESS", str(tmp_path / "progress.json"))
    return tmp_path / "progress.json"


# exercises whose check runs the reader's script under torchrun (seconds per run): `slow`,
# out of `make check`
TORCHRUN = {"05.4"}


def slow_if_launching(key, *rest):
    """`slow` (out of `make check`) where the check starts ranks: torchrun, or a launch
    per case (16 exercises: 13 s of one core in make check)."""
    launches = key in TORCHRUN or any(case.world for case in EXERCISES[key].cases)
    return pytest.param(key, *rest, marks=[pytest.mark.slow] if launches else [])


def solutions(chapter):
    return importlib.import_module(f"solutions.ch{chapter}")


def stub(*args):
    """What the chapters ship."""
    raise NotImplementedError("write this function")


def quick(exercise, seconds=6.0):
    # a mistake that hangs waits for the whole timeout: keep it short in the tests
    return dataclasses.replace(exercise, timeout=min(exercise.timeout, seconds))


def test_every_exercise_has_a_key_a_reference_and_a_mistake():
    assert EXERCISES, "no exercises registered"
    for key, exercise in EXERCISES.items():
        assert re.fullmatch(r"\d\d\.\d", key), key
        module = solutions(exercise.chapter)
        assert key in module.REFERENCE, f"{key} has no reference solution"
        assert module.MISTAKES.get(key), f"{key} has no plausible mistake to fail"
    per_chapter = exercises.chapter_progress()
    assert all(2 <= total <= 4 for _, total in per_chapter.values()), per_chapter


@pytest.mark.parametrize("key", [slow_if_launching(key) for key in EXERCISES])
def test_the_reference_solution_passes_every_case(key, monkeypatch):
    import torch

    # a check in this process (cases of world 0; 05.4's runs torchrun from here) keeps the
    # reader's random state, and seeds no GPU's generator (torch.manual_seed seeds, or
    # queues a seed for, every GPU's)
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: seeded.append(seed))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: seeded.append(seed))
    torch.manual_seed(123)
    seeded.clear()
    before = torch.get_rng_state()
    report = exercises.run(key, solutions(EXERCISES[key].chapter).REFERENCE[key])
    assert report.passed, "\n".join(report.lines())
    assert report.lines()[-1] == f"all {len(EXERCISES[key].cases)} cases passed"
    assert torch.equal(torch.get_rng_state(), before)
    assert seeded == []


@pytest.mark.parametrize("key", list(EXERCISES))
def test_the_stub_is_not_attempted_yet_and_runs_nothing(key):
    report = exercises.run(key, stub)
    assert not report.attempted and report.outcomes == []
    (line,) = report.lines()
    assert line.endswith("not attempted yet (replace the NotImplementedError in "
                         f"`{EXERCISES[key].function}`, then run this cell again)")


# `slow`, as the mistakes below (a torchrun exercise's other correct scripts take 15 s
# each: with MGPU_ALL_SCRIPT_MISTAKES=1 only, as tests/exercises/test_scripts.py's further
# mistakes)
ALTERNATIVES = [pytest.param(key, index, marks=[pytest.mark.slow])
                for key, exercise in EXERCISES.items()
                for index in range(len(getattr(solutions(exercise.chapter), "ALTERNATIVES",
                                               {}).get(key, [])))
                if key not in TORCHRUN or os.environ.get("MGPU_ALL_SCRIPT_MISTAKES") == "1"]


@pytest.mark.parametrize(("key", "index"), ALTERNATIVES)
def test_other_correct_solutions_pass_too(key, index):
    # NumPy scalars, float64 results, batch_isend_irecv, a ring that turns the other way
    right = solutions(EXERCISES[key].chapter).ALTERNATIVES[key][index]
    report = core.evaluate(EXERCISES[key], right)
    assert report.passed, "\n".join(report.lines())


def test_a_judge_that_cannot_compare_is_a_failed_case_not_a_crash():
    def judge(got, expected):
        return None if got == expected else got + expected  # list + str: TypeError

    exercise = dataclasses.replace(EXERCISES["04.2"], judge=judge)
    report = core.evaluate(exercise, lambda batch_size, n_devices: "sizes")
    assert [o.status for o in report.outcomes] == ["fail"] * len(exercise.cases)
    assert report.outcomes[0].detail.startswith("could not compare your result: TypeError: ")


def test_a_report_counts_its_cases_in_words():
    exercise = dataclasses.replace(EXERCISES["04.2"], cases=EXERCISES["04.2"].cases[1:2])
    reference = solutions("04").REFERENCE["04.2"]
    assert core.evaluate(exercise, reference).lines()[-1] == "the case passed"
    failed = core.evaluate(exercise, solutions("04").chunk_sizes_floor).lines()[-1]
    assert failed.startswith("0 of 1 case passed. Hint: ")
    assert core.count(1, "rank") == "1 rank" and core.count(3, "rank") == "3 ranks"
    assert not any("1 ranks" in case.label or "1 stages" in case.label
                   for exercise in EXERCISES.values() for case in exercise.cases)


@pytest.mark.parametrize(("value", "number"), [
    (3, 3.0), (0.5, 0.5), (True, None), ("1", None), ([1.0], None)])
def test_as_number_takes_real_numbers_only(value, number):
    assert core.as_number(value) == number


def test_as_number_takes_numpy_scalars_and_one_element_tensors():
    import numpy as np
    import torch

    assert core.as_number(np.float32(0.5)) == 0.5 and core.as_number(np.int64(7)) == 7.0
    assert core.as_number(torch.tensor(2.5, dtype=torch.float64)) == 2.5
    assert core.as_number(torch.tensor([4])) == 4.0
    assert core.as_number(torch.tensor([1.0, 2.0])) is None
    assert core.as_number(torch.tensor(True)) is None and core.as_number(np.bool_(True)) is None
    assert core.beyond(float("nan"), 1.0) and core.beyond(2.0, 1.0)
    assert not core.beyond(1.0, 1.0)


# `slow`, out of `make check` (which runs each exercise's reference and stub): 156
# mistakes, most judged on freshly launched ranks, took 18 s of a core there; `make test`
# runs them all
MISTAKES = [pytest.param(key, index, marks=[pytest.mark.slow])
            for key, exercise in EXERCISES.items()
            for index, (_, status, _) in enumerate(
                solutions(exercise.chapter).MISTAKES.get(key, []))]


def first_case_that_shows(exercise, wrong, status, phrase):
    """The report of the first case, checked alone, whose outcome is ``status`` and whose
    report says ``phrase``; else of every case. A mistake the checker names in an early
    case needs no run of the later ones (the checker itself runs them all, each on its
    own ranks: one case's report is what it shows for that case)."""
    for case in exercise.cases:
        report = core.evaluate(dataclasses.replace(exercise, cases=[case]), wrong)
        if status in {o.status for o in report.outcomes} and phrase in "\n".join(
                report.lines()):
            return report
    return core.evaluate(exercise, wrong)


@pytest.mark.parametrize(("key", "index"), MISTAKES)
def test_each_plausible_mistake_fails_and_says_why(key, index):
    exercise = EXERCISES[key]
    wrong, status, phrase = solutions(exercise.chapter).MISTAKES[key][index]
    if status == "hang":  # in the first case: every rank stopped, the other cases skipped
        report = core.evaluate(quick(exercise, seconds=2.0), wrong)
        assert [o.status for o in report.outcomes] == ["hang"] + ["skip"] * (
            len(report.outcomes) - 1), "\n".join(report.lines())
        # the fixture no_leftover_processes checks that no rank is left running
    elif key in TORCHRUN:  # the last case starts 2 ranks, the first 3
        report = first_case_that_shows(dataclasses.replace(
            exercise, cases=exercise.cases[::-1]), wrong, status, phrase)
    else:
        report = first_case_that_shows(quick(exercise), wrong, status, phrase)
    assert not report.passed
    assert status in {o.status for o in report.outcomes}, "\n".join(report.lines())
    text = "\n".join(report.lines())
    assert phrase in text and re.search(r"Hint( 1 of \d+)?: ", text), text  # or a ladder


def test_an_error_in_a_rank_shows_the_readers_frames_only():
    wrong = solutions("03").bidirectional_that_raises  # raises in every case: one will do
    first = dataclasses.replace(EXERCISES["03.1"], cases=EXERCISES["03.1"].cases[:1])
    text = "\n".join(core.evaluate(first, wrong).lines())
    assert "IndexError: list index out of range" in text
    assert "solutions/ch03.py" in text and "chunks[world] += 1" in text
    assert "mgpu_helpers" not in text  # no launcher or harness frames


def test_is_stub_tells_the_shipped_stub_from_an_attempt():
    def documented(x):
        """Docstring."""
        raise NotImplementedError

    def attempt(x):
        if x:
            raise NotImplementedError
        return x

    def other_error(x):
        raise ValueError("no")

    assert core.is_stub(stub) and core.is_stub(documented)
    assert not core.is_stub(attempt) and not core.is_stub(other_error)
    assert not core.is_stub(len)  # no source: attempted, and checked


def test_a_check_prints_and_records_progress(capsys, private_progress):
    exercises.check("01.1", solutions("01").channel_stats)  # its cases run in this process
    printed = capsys.readouterr().out
    assert printed.startswith("Exercise 01.1 · ") and "all 3 cases passed" in printed
    assert progress.passed() == {"01.1": True}
    exercises.check("01.1", stub)  # not attempted: nothing recorded, nothing lost
    assert progress.passed() == {"01.1": True}
    assert exercises.chapter_progress()["01"] == (1, len([k for k in EXERCISES if k[:2] == "01"]))


def test_progress_survives_a_corrupt_file_and_an_unknown_key_is_named(private_progress):
    private_progress.write_text("{not json")
    assert progress.passed() == {}
    progress.record("03.1", False)
    assert progress.passed() == {"03.1": False}
    with pytest.raises(KeyError, match="no exercise '99.9'; the exercises are 0"):
        exercises.check("99.9", stub)
    with pytest.raises(TypeError, match="checks a function"):
        exercises.run("03.1", 42)


def test_progress_lives_in_the_clones_git_ignored_runs_folder(monkeypatch):
    monkeypatch.delenv("MGPU_EXERCISE_PROGRESS")
    assert progress.progress_file() == ROOT / "runs" / "exercise_progress.json"
    assert "runs/" in (ROOT / ".gitignore").read_text().splitlines()


def test_mh_exposes_the_checker():
    assert mh.exercises.check is exercises.check


@pytest.mark.parametrize("key", list(EXERCISES))
def test_each_chapter_ships_the_stub_and_a_check_cell_whose_output_is_not_attempted(key):
    exercise = EXERCISES[key]
    (path,) = (ROOT / "notebooks").glob(f"{exercise.chapter}_*.ipynb")
    cells = nbformat.read(path, as_version=4).cells
    stubs = [c for c in cells if c.cell_type == "code"
             and f"def {exercise.function}(" in c.source and "NotImplementedError" in c.source]
    assert stubs, f"{path.name} has no stub `{exercise.function}`"
    checks = [c for c in cells if c.cell_type == "code"
              and f'mh.exercises.check("{key}", {exercise.function})' in c.source]
    assert len(checks) == 1, f"{path.name} needs one check cell for {key}"
    output = "".join(o.get("text", "") for o in checks[0].outputs)
    assert output == "\n".join(exercises.run(key, stub, record=False).lines()) + "\n"


@pytest.mark.parametrize("key", list(EXERCISES))
def test_each_task_shows_the_registrys_difficulty_and_time_under_its_heading(key):
    exercise = EXERCISES[key]
    (path,) = (ROOT / "notebooks").glob(f"{exercise.chapter}_*.ipynb")
    text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells
                     if c.cell_type == "markdown")
    heading = re.search(rf"^### Exercise {re.escape(key)} · .*\n\n(.*)$", text, re.MULTILINE)
    assert heading, f"{path.name} has no heading for exercise {key}"
    assert heading[1] == f"**Difficulty** {exercise.effort}", (
        f"{path.name}: run `make nav` to write exercise {key}'s difficulty line")


def test_an_exercise_without_a_difficulty_time_or_hint_is_refused():
    exercise = EXERCISES["03.3"]
    for change in ({"difficulty": 4}, {"minutes": 0}, {"hint": ()}):
        with pytest.raises(ValueError, match="difficulty must be 1, 2 or 3"):
            dataclasses.replace(exercise, **change)
    assert dataclasses.replace(exercise, difficulty=3, minutes=5).effort == (
        "★★★ · about 5 minutes")


def test_the_hint_ladder_shows_one_more_hint_after_each_failed_check(private_progress):
    ladder = dataclasses.replace(EXERCISES["03.3"], hint=("first step", "second step"))

    def wrong(alpha, bandwidth, world):
        return 1.0

    def failing_hints():
        report = core.evaluate(ladder, wrong)
        report.hints_shown = progress.failed_checks("03.3") + 1  # as exercises.run does
        progress.record("03.3", report.passed)
        return [line for line in report.lines() if line.startswith(("Hint", "(the next"))]

    assert failing_hints() == ["Hint 1 of 2: first step",
                               "(the next hint shows if this check fails again)"]
    assert failing_hints() == ["Hint 1 of 2: first step", "Hint 2 of 2: second step"]
    assert failing_hints() == ["Hint 1 of 2: first step", "Hint 2 of 2: second step"]
    assert progress.failed_checks("03.3") == 3 and progress.passed() == {"03.3": False}
    progress.record("03.3", True)  # a pass keeps the count: the ladder stays climbed
    assert progress.failed_checks("03.3") == 3 and progress.passed() == {"03.3": True}


def test_a_progress_file_of_the_earlier_format_still_reads(private_progress):
    private_progress.write_text('{"03.1": true, "03.2": false}')
    assert progress.passed() == {"03.1": True, "03.2": False}
    assert progress.failed_checks("03.2") == 0
    progress.record("03.2", False)
    assert progress.failed_checks("03.2") == 1 and progress.passed()["03.1"] is True
