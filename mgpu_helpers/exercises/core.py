"""How an exercise is checked: hidden cases, run in this process or on real ranks.

An :class:`Exercise` is a task with cases. For each case, its ``trial`` calls the
reader's function, in this process (``Case.world == 0``) or inside each of
``Case.world`` gloo ranks started by :func:`mgpu_helpers.launch`, and returns
``(got, expected)``; its ``judge`` returns ``None`` when they agree, else what differs
(a judge that raises, on a result of a kind it did not foresee, fails the case with
"could not compare your result").
A distributed case runs under a timeout: a hang is a failed case, reported as a hang,
and the launcher stops every rank. An exception raised by the reader's code is shown as
a traceback of the reader's frames, without the launcher's.
"""

from __future__ import annotations

import ast
import inspect
import numbers
import sys
import tempfile
import textwrap
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_PACKAGE = str(Path(__file__).resolve().parents[1])  # frames from here are the harness's


@dataclass(frozen=True)
class Case:
    """One hidden test case: ``label`` is what the reader sees, ``args`` what the trial
    gets, ``world`` the number of ranks (0: run in this process)."""

    label: str
    args: tuple = ()
    world: int = 0


@dataclass(frozen=True)
class Exercise:
    """A task the reader solves by writing ``function``; see the module's docstring."""

    key: str                    # "03.1": chapter 03, first exercise
    title: str
    function: str               # the name of the stub the reader fills in
    cases: Sequence[Case]
    trial: Callable[..., tuple]  # (reader_fn, *case.args) -> (got, expected)
    judge: Callable[[Any, Any], str | None]
    hint: str
    timeout: float = 15.0       # seconds a distributed case may take

    @property
    def chapter(self) -> str:
        return self.key.split(".")[0]


@dataclass
class Outcome:
    """What happened in one case: ``status`` is "pass", "fail", "error", "hang" or
    "skip" (not run after a hang)."""

    case: Case
    status: str
    detail: str = ""


@dataclass
class Report:
    """The result of checking a reader's function against every case of an exercise."""

    exercise: Exercise
    attempted: bool
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.attempted and all(o.status == "pass" for o in self.outcomes)

    def lines(self) -> list[str]:
        head = f"Exercise {self.exercise.key} · {self.exercise.title}"
        if not self.attempted:
            return [f"{head}: not attempted yet (replace the NotImplementedError in "
                    f"`{self.exercise.function}`, then run this cell again)"]
        lines, previous = [head], None
        for outcome in self.outcomes:
            lines.append(f"  {outcome.status:<5} {outcome.case.label}")
            if outcome.detail and outcome.detail == previous:
                lines.append("        (as above)")
            elif outcome.detail:
                lines.extend("        " + line for line in outcome.detail.splitlines())
            previous = outcome.detail
        passed, total = sum(o.status == "pass" for o in self.outcomes), len(self.outcomes)
        if self.passed:
            lines.append(f"all {total} cases passed" if total > 1 else "the case passed")
        else:
            lines.append(f"{passed} of {count(total, 'case')} passed. "
                         f"Hint: {self.exercise.hint}")
        return lines


def count(n: int, word: str, plural: str | None = None) -> str:
    """``n`` and ``word``, in the plural unless ``n`` is 1: "1 rank", "3 ranks"."""
    return f"{n} {word if n == 1 else plural or word + 's'}"


def largest_abs(tensor) -> float:
    """The largest absolute entry of a tensor: how far apart two results are (nan when
    either has a nan)."""
    return tensor.abs().max().item()


def beyond(difference: float, tolerance: float) -> bool:
    """True when ``difference`` is more than ``tolerance``, or nan: ``difference >
    tolerance`` alone is False for nan, and a result of nan would pass."""
    return not difference <= tolerance


def as_number(value) -> float | None:
    """A real number the reader returned, as a float: a Python int or float, one of
    NumPy's scalars, or a tensor of one element; None for anything else (a bool too)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):  # NumPy's scalars register as numbers.Real
        return float(value)
    import torch

    if (isinstance(value, torch.Tensor) and value.numel() == 1
            and value.dtype != torch.bool and not value.is_complex()):
        return float(value.item())
    return None


def is_stub(fn: Callable) -> bool:
    """True while ``fn``'s body (its docstring aside) is only
    ``raise NotImplementedError(...)``: the stub as the chapter ships it."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return False
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a lambda inside a longer expression, for instance
        return False
    function = next((node for node in ast.walk(tree)
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if function is None:
        return False
    body = [node for node in function.body
            if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    raised = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(raised, ast.Name) and raised.id == "NotImplementedError"


def calls_during(watched: dict[Callable, str], fn: Callable, *args,
                 **kwargs) -> tuple[Any, list[str]]:
    """``fn(*args, **kwargs)``, and which of the ``watched`` functions ran during the call (their
    shown names, in the order first seen): how a task refuses a helper that would do the
    work for the reader. Functions are recognised by their code, so an alias, a
    module-level import or a call from another helper is seen too."""
    codes = {function.__code__: name for function, name in watched.items()}
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in codes and codes[frame.f_code] not in seen:
            seen.append(codes[frame.f_code])

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = fn(*args, **kwargs)
    finally:
        sys.setprofile(previous)
    return result, seen


def reader_traceback(error: BaseException) -> str:
    """The traceback of ``error`` without the frames of this package (the harness, the
    launcher): what the reader's own code did."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if not frame.filename.startswith(_PACKAGE)]
    text = "".join(traceback.format_list(frames))
    last = "".join(traceback.format_exception_only(type(error), error)).strip()
    return ("Traceback (most recent call last):\n" + text if frames else "") + last


def _in_rank(trial: Callable, fn: Callable, args: tuple, errors: str):
    """Runs in each rank: the trial, with the reader's exception written down for the
    checker (the launcher's own report would show its frames)."""
    from ..ranks import rank

    try:
        return trial(fn, *args)
    except BaseException as error:
        Path(errors, f"rank{rank()}.txt").write_text(reader_traceback(error))
        raise


def _distributed(exercise: Exercise, fn: Callable, case: Case) -> list[tuple]:
    from ..launcher import LaunchError, launch

    with tempfile.TemporaryDirectory(prefix="exercise-") as errors:
        try:
            # CPU check: gloo ranks on every machine, so a case behaves the same anywhere
            return launch(_in_rank, exercise.trial, fn, case.args, errors, nprocs=case.world,
                          backend="gloo", timeout=exercise.timeout,
                          join_timeout=exercise.timeout, return_all=True)
        except TimeoutError:
            raise _Hang(f"no result after {exercise.timeout:.0f} s: a rank waits for a "
                        "message or a collective that never comes (every rank was "
                        "stopped)") from None
        except LaunchError as error:
            written = sorted(Path(errors).glob("rank*.txt"))
            if written:
                first = written[0]
                raise _ReaderError(f"{first.stem.replace('rank', 'rank ')} raised:\n"
                                   + first.read_text()) from None
            raise _ReaderError(str(error).splitlines()[0]) from None


class _Hang(Exception):
    pass


class _ReaderError(Exception):
    pass


def run_case(exercise: Exercise, fn: Callable, case: Case) -> Outcome:
    """One case: ``pass``, ``fail`` (with what differs), ``error`` (with the reader's
    traceback) or ``hang``."""
    try:
        if case.world:
            results = _distributed(exercise, fn, case)
        else:
            try:
                results = [exercise.trial(fn, *case.args)]
            except Exception as error:  # the reader's code, in this process
                raise _ReaderError(reader_traceback(error)) from None
    except _Hang as hang:
        return Outcome(case, "hang", str(hang))
    except _ReaderError as error:
        return Outcome(case, "error", str(error))
    for index, (got, expected) in enumerate(results):
        where = f"rank {index}: " if case.world else ""
        try:
            difference = exercise.judge(got, expected)
        except Exception as error:  # a result of a kind the judge did not foresee
            error_text = "".join(traceback.format_exception_only(type(error), error)).strip()
            return Outcome(case, "fail", f"{where}could not compare your result: {error_text}")
        if difference is not None:
            return Outcome(case, "fail", where + difference)
    return Outcome(case, "pass")


def evaluate(exercise: Exercise, fn: Callable) -> Report:
    """Every case of ``exercise`` against ``fn``; a stub is not run at all."""
    if not callable(fn):
        raise TypeError(f"exercise {exercise.key} checks a function (`{exercise.function}`),"
                        f" got {type(fn).__name__}")
    if is_stub(fn):
        return Report(exercise, attempted=False)
    outcomes: list[Outcome] = []
    for case in exercise.cases:
        if any(o.status == "hang" for o in outcomes):  # each would wait the full timeout
            outcomes.append(Outcome(case, "skip", "not run after the hang above"))
        else:
            outcomes.append(run_case(exercise, fn, case))
    return Report(exercise, attempted=True, outcomes=outcomes)
