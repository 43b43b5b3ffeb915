"""Exercises the reader solves in the chapters, checked on real ranks.

Each chapter ends with exercises: a task, a stub to fill in, and a check cell,
``mh.exercises.check("03.1", ring_all_reduce)``. The check runs hidden cases against the
reader's function (on gloo ranks where the exercise is distributed) and prints one line
per case; never the solution. The exercises of chapter NN live in ``chNN.py``; the
reference solutions, used only by the tests, in ``solutions/`` at the top of the clone.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

from . import progress
from .core import Case, Exercise, Report, evaluate, is_stub


def registry() -> dict[str, Exercise]:
    """Every exercise, by key ("03.1"), from the ``chNN`` modules of this package."""
    found: dict[str, Exercise] = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name.startswith("ch"):
            imported = importlib.import_module(f"{__name__}.{module.name}")
            for exercise in imported.EXERCISES:
                found[exercise.key] = exercise
    return dict(sorted(found.items()))


def get(key: str) -> Exercise:
    """The exercise ``key``; an unknown key is named with the ones that exist."""
    exercises = registry()
    if key not in exercises:
        raise KeyError(f"no exercise {key!r}; the exercises are {', '.join(exercises)}")
    return exercises[key]


def run(key: str, fn: Callable, record: bool = True) -> Report:
    """Check ``fn`` against exercise ``key`` and return the report (printed by
    :func:`check`); an attempted check is recorded in the reader's progress."""
    report = evaluate(get(key), fn)
    if record and report.attempted:
        # the hint ladder: one more hint for each check of this exercise that failed
        report.hints_shown = progress.failed_checks(key) + 1
        progress.record(key, report.passed)
    return report


def check(key: str, fn: Callable) -> None:
    """The chapters' check cells: run every case of exercise ``key`` against ``fn``
    and print one line per case."""
    print("\n".join(run(key, fn).lines()))


def chapter_progress() -> dict[str, tuple[int, int]]:
    """Chapter ("03") -> (exercises passed on this machine, exercises)."""
    done = progress.passed()
    table: dict[str, tuple[int, int]] = {}
    for key, exercise in registry().items():
        passed, total = table.get(exercise.chapter, (0, 0))
        table[exercise.chapter] = (passed + done.get(key, False), total + 1)
    return table


__all__ = ["Case", "Exercise", "Report", "chapter_progress", "check", "evaluate", "get",
           "is_stub", "registry", "run"]
