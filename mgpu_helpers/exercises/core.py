"""How an exercise is checked: hidden cases, run in this process or on real ranks.

An :class:`Exercise` is a task with cases. For each case, its ``trial`` calls the
reader's function, in this process (``Case.world == 0``) or inside each of
``Case.world`` gloo ranks started by :func:`mgpu_helpers.launch`, and returns
``(got, expected)``; its ``judge`` returns ``None`` when they agree, else what differs
(a judge that raises, on a result of a kind it did not foresee, fails the case with
"could not compare your result").
A distributed case runs under a timeout, counted in each rank from when every rank is
ready (a barrier after the group is made: starting the ranks is not the case's time): a
hang is a failed case, reported as a hang with where each rank waited in the reader's
code, and every rank is stopped. An exception raised by the reader's code is shown as
a traceback of the reader's frames, without the launcher's. A rank that dies in native
code (gloo's abort on a send and a receive of different sizes) is reported first, with
its last message in the reader's terms, before what the other ranks then did.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import linecache
import numbers
import re
import sys
import sysconfig
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_PACKAGE = str(Path(__file__).resolve().parents[1])  # frames from here are the harness's
# Seconds the ranks of a distributed case may take to start and meet, on top of the case's
# own time, which each rank counts from then (spawn takes seconds, more on a busy machine).
STARTUP_ALLOWANCE_S = 30.0
# After a case's deadline, how long a rank waits for the others to say where they waited.
_STACK_GRACE_S = 3.0


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
    hint: str | tuple[str, ...]  # a ladder: one more hint after each failed check
    difficulty: int             # 1 to 3 stars
    minutes: int                # about how long a reader of the chapter takes
    timeout: float = 15.0       # seconds a distributed case may take, once its ranks are ready

    def __post_init__(self):
        if self.difficulty not in (1, 2, 3) or self.minutes <= 0 or not self.hints:
            raise ValueError(f"exercise {self.key}: difficulty must be 1, 2 or 3 "
                             f"(got {self.difficulty}), minutes positive (got "
                             f"{self.minutes}), and it needs a hint")

    @property
    def chapter(self) -> str:
        return self.key.split(".")[0]

    @property
    def hints(self) -> tuple[str, ...]:
        return (self.hint,) if isinstance(self.hint, str) else tuple(self.hint)

    @property
    def effort(self) -> str:
        """The line under the task's heading in the chapter: "★★☆ · about 30 minutes"."""
        return ("★" * self.difficulty + "☆" * (3 - self.difficulty)
                + f" · about {self.minutes} minutes")


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
    hints_shown: int = 1  # how far up the hint ladder a failure shows

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
            hints = self.exercise.hints
            shown = max(1, min(self.hints_shown, len(hints)))
            if len(hints) == 1:
                lines.append(f"{passed} of {count(total, 'case')} passed. Hint: {hints[0]}")
            else:
                lines.append(f"{passed} of {count(total, 'case')} passed.")
                lines.extend(f"Hint {k + 1} of {len(hints)}: {hints[k]}" for k in range(shown))
                if shown < len(hints):
                    lines.append("(the next hint shows if this check fails again)")
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
                 returned_from: list | None = None, **kwargs) -> tuple[Any, list[str]]:
    """``fn(*args, **kwargs)``, and which of the ``watched`` functions ran during the call (their
    shown names, in the order first seen): how a task refuses a helper that would do the
    work for the reader. Functions are recognised by their code, so an alias, a
    module-level import or a call from another helper is seen too. ``returned_from``,
    where given, receives ``(file, line, function)`` of the line ``fn`` returned from."""
    codes = {function.__code__: name for function, name in watched.items()}
    seen: list[str] = []
    here = sys._getframe()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in codes and codes[frame.f_code] not in seen:
            seen.append(codes[frame.f_code])
        elif event == "return" and returned_from is not None and frame.f_back is here:
            code = frame.f_code
            returned_from.append((code.co_filename, frame.f_lineno, code.co_name))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = fn(*args, **kwargs)
    finally:
        sys.setprofile(previous)
    return result, seen


def shared_fresh_seed() -> int:
    """Inside the ranks of a case: a seed rank 0 draws from ``os.urandom`` (through
    ``random.SystemRandom``) and broadcasts, so that every rank draws the same inputs
    from it and no code can know them in advance. Call it before the reader's function
    runs: a collective of the checker's, outside what the reader's code is counted by."""
    import random

    import torch
    import torch.distributed as dist

    drawn = random.SystemRandom().getrandbits(63) if dist.get_rank() == 0 else 0
    seed = torch.tensor([drawn], dtype=torch.int64)
    dist.broadcast(seed, src=0)
    return int(seed.item())


def reader_traceback(error: BaseException) -> str:
    """The traceback of ``error`` without the frames of this package (the harness, the
    launcher): what the reader's own code did."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if not frame.filename.startswith(_PACKAGE)]
    text = "".join(traceback.format_list(frames))
    last = "".join(traceback.format_exception_only(type(error), error)).strip()
    return ("Traceback (most recent call last):\n" + text if frames else "") + last


def _in_rank(trial: Callable, fn: Callable, args: tuple, folder: str, timeout: float):
    """Runs in each rank: the trial, under the case's deadline, with what the reader's
    code did written down for the checker (the launcher's own report would show its
    frames): an exception's traceback (``rankK.txt``), the stacks at a fatal signal
    (``rankK.fatal``), where the rank waited when the deadline passed (``rankK.stack``).

    The case's time starts after a barrier, once every rank has started and joined the
    group: starting ranks (seconds under spawn, on a loaded machine) is not the case's."""
    import faulthandler
    import os
    import threading

    import torch.distributed as dist

    from ..launcher.streams import flush_all_streams

    rank, world = dist.get_rank(), dist.get_world_size()
    files = {kind: Path(folder, f"rank{rank}.{kind}") for kind in ("fatal", "stack", "done")}
    dist.barrier()  # every rank is ready: the case's time starts now
    fatal = files["fatal"].open("w")
    was_enabled = faulthandler.is_enabled()
    faulthandler.enable(file=fatal, all_threads=True)  # a native crash: where the rank was
    finished = threading.Event()

    def deadline():
        if finished.wait(timeout):
            return
        with files["stack"].open("w") as stack:
            faulthandler.dump_traceback(file=stack, all_threads=True)
        others = [(Path(folder, f"rank{k}.stack"), Path(folder, f"rank{k}.done"))
                  for k in range(world)]
        end = time.monotonic() + _STACK_GRACE_S  # each rank writes where it waits
        while time.monotonic() < end and not all(
                done.exists() or (stack.exists() and stack.stat().st_size)
                for stack, done in others):
            time.sleep(0.05)
        flush_all_streams()  # what the reader's code printed
        os._exit(1)  # every rank was stopped; the checker reports the hang

    threading.Thread(target=deadline, name="exercise-deadline", daemon=True).start()
    try:
        return trial(fn, *args)
    except BaseException as error:
        Path(folder, f"rank{rank}.txt").write_text(reader_traceback(error))
        raise
    finally:
        finished.set()
        files["done"].touch()
        if was_enabled:
            faulthandler.enable(file=sys.stderr, all_threads=True)
        else:
            faulthandler.disable()


def _distributed(exercise: Exercise, fn: Callable, case: Case) -> list[tuple]:
    from ..launcher import LaunchError, launch

    # The group's collectives and the launcher's join may wait for the ranks' start too;
    # the case's own time (exercise.timeout) starts in each rank once all are ready.
    limit = exercise.timeout + STARTUP_ALLOWANCE_S
    with tempfile.TemporaryDirectory(prefix="exercise-") as folder, \
            _stderr_recorded() as recorded:
        try:
            # CPU check: gloo ranks on every machine, so a case behaves the same anywhere
            return launch(_in_rank, exercise.trial, fn, case.args, folder, exercise.timeout,
                          nprocs=case.world, backend="gloo", timeout=limit,
                          join_timeout=limit, return_all=True)
        except TimeoutError as error:  # the launcher's backstop: ranks that never ended
            raise _Hang(_hang_message(limit, stacks_in_timeout(str(error)),
                                      started=False)) from None
        except LaunchError as error:
            stacks = _read_all(folder, "stack")
            if stacks:  # the case's deadline passed: each rank wrote where it waited
                raise _Hang(_hang_message(exercise.timeout, stacks, started=True)) from None
            raise _ReaderError(diagnose(
                str(error), errors=_read_all(folder, "txt"), fatal=_read_all(folder, "fatal"),
                stderr=_rank_lines("".join(recorded)))) from None


def _read_all(folder: str, kind: str) -> dict[int, str]:
    """What each rank wrote into ``rankK.<kind>``, by rank, where it wrote something."""
    found = {}
    for path in Path(folder).glob(f"rank*.{kind}"):
        text = path.read_text(errors="replace")
        if text.strip():
            found[int(path.stem.removeprefix("rank"))] = text
    return dict(sorted(found.items()))


class _Recorder(io.TextIOBase):
    """A stream that passes everything on to ``stream`` and keeps a copy in ``text``."""

    def __init__(self, stream):
        self.stream, self.text = stream, []

    def write(self, text):
        self.text.append(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def _stderr_recorded():
    """What the launcher prints on stderr meanwhile (each rank's, as ``[rank k] ...``),
    still shown, and kept: a rank that dies in native code says why only there."""
    recorder = _Recorder(sys.stderr)
    with contextlib.redirect_stderr(recorder):
        yield recorder.text


def _rank_lines(text: str) -> dict[int, list[str]]:
    lines: dict[int, list[str]] = {}
    for match in re.finditer(r"^\[rank (\d+)\] (.*)$", text, flags=re.MULTILINE):
        lines.setdefault(int(match[1]), []).append(match[2])
    return lines


# ------------------------------------------------------------------ the real cause first

_COLLATERAL = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
_SIZE_MISMATCH = re.compile(r"(\d+) vs (\d+)\. Received data size doesn't match expected size")


def explain(message: str, rank: int) -> str | None:
    """A native or gloo error message in the reader's terms, where it is recognised."""
    mismatch = _SIZE_MISMATCH.search(message)
    if mismatch:
        arrived, expected = int(mismatch[1]), int(mismatch[2])
        if arrived % 4 == 0 and expected % 4 == 0:  # float32, the tensors the tasks use
            sizes = (f"{count(arrived // 4, 'element')} where its recv expected "
                     f"{expected // 4}")
        else:
            sizes = f"{count(arrived, 'byte')} where its recv expected {expected}"
        return (f"rank {rank} received {sizes}: the two ranks' chunk sizes disagree (a send "
                "and the recv that takes it must hold as many elements, of one dtype; gloo "
                f"said {arrived} bytes arrived for a buffer of {expected})")
    return None


def _last_message(lines: list[str]) -> str:
    """A dying rank's last words on stderr: C++'s ``what():`` line, else its last lines."""
    for line in reversed(lines):
        if "what():" in line:
            return line.split("what():", 1)[1].strip()
    kept = [line.strip() for line in lines if line.strip()]
    return "\n".join(kept[-3:])


def diagnose(launch_error: str, errors: dict[int, str], fatal: dict[int, str],
             stderr: dict[int, list[str]]) -> str:
    """The verdict on a failed distributed case, the real cause first: a rank that died
    in native code (its last message, explained where recognised, and where its code
    was), else an error the reader's code raised, else what the launcher saw; then what
    the other ranks did, which is often only an echo (a peer that went away)."""
    lines: list[str] = []
    if fatal:
        rank = min(fatal)  # several crashes: one is enough to lead
        text = fatal[rank]
        kind = re.search(r"Fatal Python error: (.+)", text)
        kind_name = kind[1].strip() if kind else "a fatal signal"
        said = _last_message(stderr.get(rank, []))
        where = where_ranks_waited({rank: text}, prefix=False)
        meaning = explain(said, rank)
        if meaning:
            lines.append(meaning)
            lines.append(f"  rank {rank} was {where[0]}" if where else f"  rank {rank}")
            lines[-1] += f", when its process ended ({kind_name})"
        else:
            lines.append(f"rank {rank} crashed in native code ({kind_name})"
                         + (f" {where[0]}" if where else "")
                         + (f"; its last message:\n  {said}" if said else ""))
        others = {k: v for k, v in errors.items() if k != rank}
    else:
        genuine = [k for k, text in errors.items()
                   if not any(c in text for c in _COLLATERAL)]
        head = launch_error.splitlines()[0] if launch_error.strip() else ""
        if not genuine and head and not any(c in head for c in _COLLATERAL):
            # only echoes were raised: the launcher saw the cause (a rank that exited)
            lines.append(head)
            others = errors
        elif errors:
            rank = (genuine or list(errors))[0]
            text = errors[rank]
            meaning = explain(text, rank)
            lines.append((meaning + "\n" if meaning else "") + f"rank {rank} raised:\n{text}")
            others = {k: v for k, v in errors.items() if k != rank}
        else:
            lines.append(head)
            others = {}
    for rank, text in others.items():
        last = text.strip().splitlines()[-1]
        echo = any(c in last for c in _COLLATERAL)
        lines.append(f"then rank {rank} raised {last}"
                     + (" (a consequence: a peer it talked to had ended)" if echo else ""))
    return "\n".join(lines)


# ------------------------------------------------------------------ where each rank waited

_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (.+)$')
_LIBRARY = tuple(sorted({sysconfig.get_paths()[name] for name in
                         ("stdlib", "platstdlib", "purelib", "platlib")}))


def stacks_in_timeout(text: str) -> dict[int, str]:
    """The stack of each rank in the launcher's TimeoutError, by rank."""
    parts = re.split(r"^rank (\d+) stack:$", text, flags=re.MULTILINE)
    return {int(rank): stack for rank, stack in zip(parts[1::2], parts[2::2], strict=True)}


def _frames(dump: str) -> list[tuple[str, int, str]]:
    """The frames (file, line, function), innermost first, of the thread that ran the
    case in a faulthandler dump; only the frames inside the case (the reader's, and the
    libraries' they called)."""
    threads = re.split(r"^(?:Current thread|Thread) 0x[0-9a-f]+.*$", dump, flags=re.MULTILINE)
    for thread in threads:
        frames = [(m[1], int(m[2]), m[3].strip()) for m in map(_FRAME.match,
                  thread.splitlines()) if m]
        for index, (path, _, function) in enumerate(frames):
            if function == "_in_rank" and path.startswith(_PACKAGE):
                return [f for f in frames[:index] if not f[0].startswith(_PACKAGE)] or [
                    ("", 0, "")]
    return []


def _place(frames: list[tuple[str, int, str]]) -> str:
    """Where a rank was, in the reader's terms: "in recv, at line 12 of ring (cell.py):
    `dist.recv(incoming, left)`"."""
    readers = [i for i, (path, _, _) in enumerate(frames)
               if path and not path.startswith(_LIBRARY) and not path.startswith("<")]
    if not readers:
        return "outside your code (in the checker's)" if frames else ""
    innermost = readers[0]
    called = [function for path, _, function in frames[:innermost]
              if function not in ("wrapper", "<lambda>")]
    path, line, function = frames[innermost]
    text = (f"in {called[-1]}, " if called else "") + f"at line {line} of {function} ({path})"
    source = linecache.getline(path, line).strip()
    return text + (f": `{source}`" if source else "")


def where_ranks_waited(stacks: dict[int, str], prefix: bool = True) -> list[str]:
    """One line per rank: where its code was when it was stopped."""
    found = []
    for rank, dump in sorted(stacks.items()):
        frames = _frames(dump)
        place = _place(frames) if frames else ""
        if place:
            found.append(f"rank {rank}: {place}" if prefix else place)
    return found


def _hang_message(seconds: float, stacks: dict[int, str], started: bool) -> str:
    since = "after every rank was ready" if started else "after the ranks were started"
    text = (f"no result {seconds:g} s {since}: a rank waits for a message or a collective "
            "that never comes (every rank was stopped)")
    where = where_ranks_waited(stacks)
    return text + (". Where each rank waited:\n" + "\n".join("  " + w for w in where)
                   if where else "")


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
