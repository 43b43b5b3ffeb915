"""Exercise 05.4: a reader's training script, run under torchrun by the checker.

The reference goes through tests/exercises/test_exercises.py with every case, and one mistake (a
crash) with the case that shows it; here, each other mistake of solutions/ch05.py runs
against the one case that shows it, on 2 ranks, its one torchrun run that shows it (a run
takes 6 to 10 s on 2 cores, most of it each process importing torch), a script that never
ends is stopped with every process it started, and the verdicts that need no run are
checked on crafted results."""

import dataclasses
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch

from mgpu_helpers import exercises
from mgpu_helpers.exercises import ch05, core, scripts
from solutions import ch05 as solutions

pytestmark = pytest.mark.usefixtures("no_leftover_processes")
EXERCISE = exercises.get("05.4")



@pytest.fixture(autouse=True)
def private_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("MGPU_EXERCISE_PROGRESS", str(tmp_path / "progress.json"))


@pytest.fixture
def private_tempdir(tmp_path, monkeypatch):
    """tempfile's folder, for this test only: what the check leaves there is seen."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


# Case 0 (3 ranks, 2 epochs) on 2 ranks: one process fewer to start, and each mistake of
# that case shows on 2 ranks as well (tests/exercises/test_exercises.py runs the reference on 3)
TWO_RANKS = dataclasses.replace(EXERCISE, cases=[
    core.Case("torchrun, 2 ranks, 2 epochs", (2, EXERCISE.cases[0].args[1]))])


def one_case(index):
    return dataclasses.replace(EXERCISE, cases=[EXERCISE.cases[index]])


def the_references_first_run(monkeypatch):
    """Case 1's first run (1 epoch, no checkpoint yet) made here, as the reference script's
    run leaves it: a mistake in resuming changes only the second run, the one under
    torchrun then."""
    real, calls = scripts.run_under_torchrun, []

    def first_run_made_here(script, nprocs, args, watched, notes, timeout, cwd):
        calls.append(args)
        if len(calls) > 1:
            return real(script, nprocs, args, watched, notes, timeout, cwd)
        epochs = int(args[args.index("--epochs") + 1])
        checkpoint = Path(cwd, args[args.index("--checkpoint") + 1])
        temporary = checkpoint.with_name(checkpoint.name + ".tmp")
        torch.save(ch05._train(nprocs, epochs), temporary)  # rank 0, after its one epoch
        os.replace(temporary, checkpoint)
        paths = os.path.realpath(temporary), os.path.realpath(checkpoint)
        return scripts.ScriptRun(["torchrun", "main.py", *args], 0, "", 0.0, writes=[
            (0, "save", paths[0], ""), (0, "rename", *paths)])

    monkeypatch.setattr(scripts, "run_under_torchrun", first_run_made_here)
    return calls


# every mistake end to end with MGPU_ALL_SCRIPT_MISTAKES=1 (the suite runs the first five;
# the others' verdicts are checked on crafted results below)
ALL_MISTAKES = os.environ.get("MGPU_ALL_SCRIPT_MISTAKES") == "1"
MISTAKES = solutions.SCRIPT_MISTAKES + (solutions.MORE_SCRIPT_MISTAKES if ALL_MISTAKES else [])


@pytest.mark.slow  # torchrun, once per mistake
@pytest.mark.parametrize(("wrong", "case", "phrase"), MISTAKES,
                         ids=[wrong.__qualname__ for wrong, _, _ in MISTAKES])
def test_each_mistake_of_a_script_fails_on_the_case_that_shows_it(wrong, case, phrase,
                                                                 private_tempdir,
                                                                 monkeypatch):
    if case == 1:
        runs = the_references_first_run(monkeypatch)
    report = core.evaluate(TWO_RANKS if case == 0 else one_case(case), wrong)
    text = "\n".join(report.lines())
    assert [o.status for o in report.outcomes] == ["fail"], text
    assert phrase in text and "Hint 1 of 2: " in text, text
    if case == 1:  # the first run passed: the second, the script's own, failed
        assert [args[1] for args in runs] == ["1", "3"] and "run 2 of 2" in text, text
    assert list(private_tempdir.iterdir()) == []  # the script's folder, removed


@pytest.mark.slow  # torchrun
def test_a_script_that_never_ends_is_stopped_with_every_process(private_tempdir,
                                                                monkeypatch):
    runs = []
    real = scripts.run_under_torchrun

    def recorded(*args, **kwargs):
        runs.append(real(*args, **kwargs))
        return runs[-1]

    # the time counts from when every worker has started: they all have, when it stops
    monkeypatch.setattr(ch05, "SCRIPT_TIMEOUT_S", 1.0)
    monkeypatch.setattr(scripts, "run_under_torchrun", recorded)
    report = core.evaluate(TWO_RANKS, solutions.main_that_waits_forever)
    (outcome,) = report.outcomes
    assert outcome.status == "fail"
    assert "gave no result in 1 s" in outcome.detail
    assert "(every process was stopped)" in outcome.detail
    (run,) = runs
    assert run.hung and len(run.pids) == 2  # every worker had started
    deadline = time.monotonic() + 5  # a killed process may take a moment to go
    while time.monotonic() < deadline and any(alive(pid) for pid in run.pids):
        time.sleep(0.1)
    assert not any(alive(pid) for pid in run.pids), "a torchrun worker survived"
    assert list(private_tempdir.iterdir()) == []


def test_a_runs_time_counts_from_when_every_worker_has_started(tmp_path, monkeypatch):
    def stand_in(seconds):  # for torchrun: ends by itself, with status 0, after `seconds`
        return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])

    def waited(process, timeout):
        try:
            return scripts._wait_for_the_run(process, tmp_path, 2, timeout, time.monotonic())
        finally:
            process.kill()
            process.wait()

    # no worker has started: the startup allowance stops the run (None), not its end at 30 s
    monkeypatch.setattr(scripts, "STARTUP_ALLOWANCE_S", 0.3)
    assert waited(stand_in(30), 0.1) is None
    # one worker of two has started: the run's time has not begun, and it ends by itself
    monkeypatch.setattr(scripts, "STARTUP_ALLOWANCE_S", 600.0)
    (tmp_path / "rank0.pid").write_text("101")
    assert waited(stand_in(1), 0.1) == 0
    # both have: its time runs from then
    (tmp_path / "rank1.pid").write_text("102")
    assert waited(stand_in(30), 0.1) is None
    assert waited(subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]), 60) == 3


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_function_without_source_is_an_error_that_says_so():
    namespace = {}
    exec("def main():\n    pass\n", namespace)  # no file, no linecache entry
    (outcome, *_) = core.evaluate(EXERCISE, namespace["main"]).outcomes
    assert outcome.status == "error"
    assert "could not read the source of `main`" in outcome.detail


def test_the_script_is_the_functions_source_and_a_call():
    source = scripts.script_source(solutions.main)
    assert source.startswith("def main():\n")
    assert source.endswith('\n\nif __name__ == "__main__":\n    main()\n')


def test_a_scripts_traceback_shows_its_own_frames_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("main.py").write_text('import json\n\n\ndef main():\n    return json.loads("{")\n'
                               "\n\nmain()\n")
    with pytest.raises(ValueError) as raised:
        runpy.run_path("main.py", run_name="__main__")  # as the worker runs it
    text = scripts._reader_traceback(raised.value, "main.py")
    assert text.startswith("Traceback (most recent call last):\n")
    assert 'File "main.py", line 8, in <module>' in text
    assert 'File "main.py", line 5, in main' in text and 'json.loads("{")' in text
    assert "runpy" not in text and "test_exercise_script" not in text
    assert "json/" not in text  # the library's frames: its error's line is enough
    assert text.endswith("JSONDecodeError: Expecting property name enclosed in double "
                         "quotes: line 1 column 2 (char 1)")


def test_output_tail_drops_torchruns_report():
    output = ("epoch 1 loss 0.5\nmain.py: error: unrecognized arguments: --x\n"
              "E1206 07:36:14.478000 9000 torch/distributed/elastic/multiprocessing/api.py:1002]"
              " failed (exitcode: 2)\nTraceback (most recent call last):\n  File \"run.py\"\n")
    assert scripts.output_tail(output) == ("epoch 1 loss 0.5\n"
                                           "main.py: error: unrecognized arguments: --x")


def test_the_model_and_the_data_are_the_same_at_every_call_and_leave_the_rng_alone():
    before = torch.get_rng_state()
    first, second = ch05.tiny_model(), ch05.tiny_model()
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(),
                                                 second.state_dict().values(), strict=True))
    inputs, labels = ch05.tiny_dataset().tensors
    assert inputs.shape == (96, 8) and set(labels.tolist()) == {0, 1, 2}
    assert torch.equal(inputs, ch05.tiny_dataset().tensors[0])
    assert torch.equal(torch.get_rng_state(), before)


# ------------------------------------------------------- verdicts on crafted results

PATH = "/work/run/checkpoints/checkpoint.pt"


def expected_run(world=2, last=2, start=None):
    return {**ch05._expected_run(world, last, start, Path(PATH)), "path": PATH}


def facts(state, writes=None, files=("checkpoint.pt",), returncode=0, unreadable=None):
    if writes is None:  # rank 0, an atomic save per epoch
        writes = [(0, what, where, to) for _ in range(2) for what, where, to in (
            ("save", PATH + ".tmp", ""), ("rename", PATH + ".tmp", PATH))]
    return {"command": "torchrun main.py", "returncode": returncode, "errors": {},
            "tail": "", "writes": writes, "files": list(files), "state": state,
            "unreadable": unreadable}


def verdict(facts, expected):
    return ch05._save_problem(facts, expected) or ch05._content_problem(facts, expected)


def test_the_reference_training_passes_the_judge_and_each_flaw_is_named():
    expected = expected_run()
    assert verdict(facts(expected["reference"]), expected) is None
    for flaw, state in expected["candidates"].items():
        message = verdict(facts(state), expected)
        assert message and ch05._FLAWS[flaw] in message, flaw


def test_a_resumed_runs_flaws_are_named_too():
    start = {**ch05._train(2, 1), "epoch": 1}
    generator = torch.Generator().manual_seed(0)  # another run's weights, as the check makes
    start["model"] = {key: value + 0.1 * torch.randn(value.shape, generator=generator)
                      for key, value in start["model"].items()}
    expected = expected_run(last=3, start=start)
    assert verdict(facts(expected["reference"]), expected) is None
    for flaw in ("afresh", "no optimizer state", "epoch 0"):
        message = verdict(facts(expected["candidates"][flaw]), expected)
        assert ch05._FLAWS[flaw] in message, flaw


@pytest.mark.parametrize(("change", "phrase"), [
    (lambda f: {**f, "writes": f["writes"][:2] + [(0, "rename", "/tmp/x.pt", PATH)]},
     "renamed from /tmp/x.pt, outside its folder"),
    (lambda f: {**f, "writes": f["writes"] + [(rank, "save", f"{PATH}.{rank}.tmp", "")
                                              for rank in (1, 2)]},
     "ranks 0, 1 and 2 all wrote into the checkpoint's folder"),
    (lambda f: {**f, "files": ["checkpoint.pt", "checkpoint.pt.tmp"]},
     "left checkpoint.pt.tmp in the checkpoint's folder"),
    (lambda f: {**f, "writes": [], "state": None}, "no checkpoint at checkpoint.pt"),
    (lambda f: {**f, "state": None, "unreadable": "UnpicklingError: Weights only load failed"},
     "could not read the checkpoint (UnpicklingError"),
    (lambda f: {**f, "writes": [(0, "copy", PATH + ".tmp", PATH)] * 2},
     "written straight into checkpoint.pt"),
    (lambda f: {**f, "state": {"model": f["state"]["model"]}},
     "the checkpoint holds ['model'], expected a dict with 'model', 'optimizer' and 'epoch'"),
    (lambda f: {**f, "state": {**f["state"], "model": {"weight": torch.zeros(1)}}},
     "the checkpoint's model holds ['weight'], expected tiny_model()'s state_dict"),
    (lambda f: {**f, "state": {**f["state"], "epoch": 1}},
     "the checkpoint says epoch 1 after 2 epochs"),
    (lambda f: {**f, "state": {**f["state"], "model": {
        "module." + key: value for key, value in f["state"]["model"].items()}}},
     "model keys start with `module.`"),
    (lambda f: {**f, "writes": f["writes"][len(f["writes"]) // 2:]},
     "saved 1 time in 2 epochs"),
    (lambda f: {**f, "state": {**f["state"], "optimizer": {"state": {}, "param_groups": []}}},
     "the checkpoint's optimizer state is not SGD's"),
])
def test_each_defect_of_a_checkpoint_is_named(change, phrase):
    expected = expected_run()
    right = facts(expected["reference"])
    assert verdict(right, expected) is None
    assert phrase in verdict(change(right), expected)


def test_a_failed_run_shows_the_readers_error_or_its_output():
    expected = expected_run()
    hung = {**facts(None), "returncode": None, "tail": "epoch 0"}
    assert ch05._failed_run(hung, expected).endswith(
        f"gave no result in {ch05.SCRIPT_TIMEOUT_S:g} s: a rank waits for a collective that "
        "never comes, or the script never ends (every process was stopped), after "
        "printing:\nepoch 0")
    raised = {**facts(None), "returncode": 1, "errors": {1: "Traceback ...\nKeyError: 'x'"}}
    assert "exited with status 1; rank 1 raised (line numbers count from `def main():`):\n" \
           "Traceback ...\nKeyError: 'x'" in ch05._failed_run(raised, expected)
    usage = {**facts(None), "returncode": 2, "tail": "main.py: error: the following "
             "arguments are required: --epochs"}
    assert ch05._failed_run(usage, expected).endswith("required: --epochs")
    assert ch05._failed_run(facts(None), expected) is None
    assert os.sep == "/"  # the crafted paths above are POSIX paths
