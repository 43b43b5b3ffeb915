"""Chapter 08's exercises: a checkpoint that a crash cannot destroy, and a batch plan.
The checkpoints' contents, and one batch plan's sizes, are drawn afresh on every check,
so that a state or a plan copied from an earlier check fails."""

from __future__ import annotations

import os
import random
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from .core import Case, Exercise, as_number, count


class _FailsWhileSaving:
    """Pickling it raises, as a full disk or a killed process would stop a save half-way."""

    def __reduce__(self):
        raise OSError("No space left on device (simulated, half-way through the save)")


class _Writes:
    """Which files the reader's code opens for writing, renames or copies, seen through
    Python's audit events (an alias, a helper or a module-level import calls the same
    `open`, `os.open`, `os.replace`): recorded only while :meth:`watching` runs, and on
    its thread only. Python offers no way to remove an audit hook, so one hook is added
    on first use and does nothing outside that block."""

    _WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def __init__(self):
        self.paths: list[str] | None = None
        self.thread: int | None = None
        self.added = False

    def _hook(self, event: str, args: tuple) -> None:
        if self.paths is None or threading.get_ident() != self.thread:
            return
        try:
            if event == "open":
                path, mode, flags = args
                writes = ((isinstance(mode, str) and any(c in mode for c in "wax+"))
                          or (isinstance(flags, int) and flags & self._WRITE_FLAGS))
                written = [path] if writes else []
            elif event == "os.rename":  # os.rename, os.replace, shutil.move
                written = list(args[:2])
            elif event == "shutil.copyfile":
                written = [args[1]]
            else:
                return
            for path in written:
                if isinstance(path, (str, bytes, os.PathLike)):
                    name = os.path.abspath(os.fsdecode(path))
                    if "__pycache__" not in name:  # an import compiling a module
                        self.paths.append(name)
        except Exception:  # an audit hook that raises would stop the reader's call
            pass

    @contextmanager
    def watching(self):
        if not self.added:
            sys.addaudithook(self._hook)
            self.added = True
        self.paths, self.thread = [], threading.get_ident()
        try:
            yield self.paths
        finally:
            self.paths, self.thread = None, None


_WRITES = _Writes()


@contextmanager
def _elsewhere():
    """The checkpoint's folder, and a working directory and a tempfile folder of the
    trial's own while the block runs (so that nothing lands in the reader's folder, and
    a file left there is seen): yields the three; afterwards the working directory and
    tempfile's folder are put back and all three removed."""
    previous_cwd, previous_tempdir = os.getcwd(), tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="exercise-") as folder, \
            tempfile.TemporaryDirectory(prefix="exercise-cwd-") as cwd, \
            tempfile.TemporaryDirectory(prefix="exercise-tmp-") as temp:
        os.chdir(cwd)
        tempfile.tempdir = temp
        try:
            yield Path(folder), Path(cwd), Path(temp)
        finally:
            tempfile.tempdir = previous_tempdir
            os.chdir(previous_cwd)


def _outside(folder: Path, written: list[str], places: tuple[Path, ...]) -> list[str]:
    """The files written outside ``folder``: paths the audit saw, and any file left in
    ``places`` (the trial's own working directory and tempfile folder)."""
    inside = folder.resolve()
    found = [name for name in written if not Path(name).resolve().is_relative_to(inside)]
    found += [str(p) for place in places for p in sorted(place.rglob("*")) if p.is_file()]
    return list(dict.fromkeys(found))


def _checkpoint_trial(fn, scenario: str):
    draw = random.SystemRandom()  # what the checkpoints hold, drawn afresh on every check
    generator = torch.Generator().manual_seed(draw.getrandbits(63))
    old = {"step": draw.randint(1, 10**6), "weights": torch.randn(6, generator=generator)}
    new = {"step": old["step"] + draw.randint(1, 1000),
           "weights": torch.randn(6, generator=generator)}
    with _elsewhere() as (folder, cwd, temp):
        path = folder / "checkpoint.pt"
        if scenario != "first save":
            torch.save(old, path)
        raised, rewritten = None, False
        with _WRITES.watching() as written:
            if scenario == "a save that fails":
                try:
                    fn({**new, "broken": _FailsWhileSaving()}, path)
                except Exception as error:  # the failure must reach the caller
                    raised = type(error).__name__
            elif scenario == "replacing a checkpoint" and os.name == "posix":
                # an open handle keeps the old file alive, so its inode number cannot be
                # reused: a new file renamed onto the path has another one, a file written
                # in place keeps it (on Windows, renaming onto an open file fails: not
                # checked)
                with open(path, "rb") as held:
                    inode = os.fstat(held.fileno()).st_ino
                    fn(new, path)
                    rewritten = path.exists() and os.stat(path).st_ino == inode
            else:
                fn(new, path)
            written = list(written)
        try:
            kept = torch.load(path, weights_only=False) if path.exists() else None
        except Exception:  # a save cut off half-way leaves a file torch cannot read
            kept = "unreadable"
        files = sorted(p.name for p in folder.iterdir())
        elsewhere = [_shown_path(name, cwd, temp)
                     for name in _outside(folder, written, (cwd, temp))]
    expected_state = old if scenario == "a save that fails" else new
    got = {"state": kept, "files": files, "raised": raised, "rewritten": rewritten,
           "elsewhere": elsewhere}
    return got, {"state": expected_state, "files": ["checkpoint.pt"],
                 "raised": "OSError" if scenario == "a save that fails" else None,
                 "scenario": scenario}


def _shown_path(name: str, cwd: Path, temp: Path) -> str:
    """A path as the reader would recognise it: in the working directory, in the
    temporary folder, or as it is."""
    path = Path(name).resolve()
    for place, words in ((cwd.resolve(), "the working directory"),
                         (temp.resolve(), "the temporary folder")):
        if path.is_relative_to(place):
            return f"{path.relative_to(place)} in {words}"
    return str(path)


def _same_state(a, b) -> bool:
    return (isinstance(a, dict) and a.keys() == b.keys()
            and all(torch.equal(a[k], b[k]) if isinstance(b[k], torch.Tensor) else a[k] == b[k]
                    for k in b))


def _checkpoint_judge(got, expected) -> str | None:
    if expected["raised"] and got["raised"] is None:
        return "the save failed half-way, but no exception reached the caller"
    if got["state"] is None:
        return "checkpoint.pt does not exist afterwards"
    if got["state"] == "unreadable":
        return ("checkpoint.pt no longer loads afterwards: the save wrote over it and "
                "stopped half-way, so the previous checkpoint is lost")
    if not _same_state(got["state"], expected["state"]):
        if expected["scenario"] == "a save that fails":
            return ("the previous checkpoint was lost: after the failed save, checkpoint.pt "
                    f"holds step {got['state'].get('step', '?')}, expected step "
                    f"{expected['state']['step']}")
        step, want = got["state"].get("step", "?"), expected["state"]["step"]
        if step == want:
            return (f"checkpoint.pt holds step {step}, but not the state that was passed "
                    "in: save the state you are given, as it is")
        return f"checkpoint.pt holds step {step}, expected step {want}"
    if got["elsewhere"]:
        return (f"the save wrote {got['elsewhere'][0]}, outside the checkpoint's folder: "
                "a temporary file elsewhere may sit on another file system (where "
                "os.replace is no longer atomic, or fails), and it is left behind when the "
                "save fails")
    if got["files"] != expected["files"]:
        return (f"the folder holds {got['files']} afterwards, expected only "
                f"{expected['files']}: remove what the save leaves behind")
    if got["rewritten"]:
        return ("checkpoint.pt holds the new state, but it was rewritten in place (the same "
                "file, not a new one put where it was): a crash or a full disk during that "
                "write leaves it half-written, and the previous checkpoint is gone")
    return None


def _plan_trial(fn, global_batch: int | None, world: int | None, limit: int | None):
    drawn = global_batch is None
    if drawn:  # drawn afresh: no table of copied answers holds it
        draw = random.SystemRandom()
        # always shares the ranks can split (the fixed cases hold those they cannot): a
        # drawn ValueError would be passed by code that raises whenever it does not know
        world, limit = draw.randint(1, 16), draw.randint(1, 128)
        global_batch = world * draw.randint(1, 256)
    try:
        got = fn(global_batch, world, limit)
    except ValueError as error:
        got = ("ValueError", str(error))
    task = {"global_batch": global_batch, "world": world, "limit": limit, "drawn": drawn}
    if global_batch % world:
        return got, {**task, "plan": "ValueError"}
    per_rank = global_batch // world
    # the fewest accumulation steps whose micro-batch fits: the largest divisor <= limit
    micro = max(d for d in range(1, min(per_rank, limit) + 1) if per_rank % d == 0)
    return got, {**task, "plan": (micro, per_rank // micro)}


def _plan_judge(got, expected) -> str | None:
    plan = expected["plan"]
    where = (f"for global batch {expected['global_batch']}, "
             f"{count(expected['world'], 'rank')}, at most {expected['limit']} samples per "
             "pass: " if expected["drawn"] else "")
    if plan == "ValueError":
        if isinstance(got, tuple) and got[:1] == ("ValueError",):
            return None
        return (f"{where}expected a ValueError (the global batch cannot be split evenly "
                f"between the ranks), got {got!r}")
    if isinstance(got, tuple) and got[:1] == ("ValueError",):
        return f"{where}expected {plan}, got ValueError: {got[1]}"
    normalised = tuple(got) if isinstance(got, (tuple, list)) else got
    if normalised == plan:
        return None
    difference = (f"{where}expected (micro-batch per rank, accumulation steps) = {plan}, "
                  f"got {got!r}")
    numbers = [as_number(v) for v in normalised] if isinstance(normalised, tuple) else []
    if len(numbers) != 2 or None in numbers:
        return difference
    (micro, steps), world = numbers, expected["world"]
    if world * micro * steps != expected["global_batch"]:
        return (f"{difference}: world x micro-batch x steps = {world} x {micro:g} x "
                f"{steps:g} = {world * micro * steps:g}, not {expected['global_batch']}")
    if micro > expected["limit"]:
        return (f"{difference}: a micro-batch of {micro:g} is more than the limit, "
                f"{expected['limit']}")
    return f"{difference}: more accumulation steps than needed"


EXERCISES = [
    Exercise(
        key="08.1", difficulty=2, minutes=25,
        title="a checkpoint a crash cannot destroy", function="save_atomically",
        cases=[Case(scenario, (scenario,)) for scenario in
               ("first save", "replacing a checkpoint", "a save that fails")],
        trial=_checkpoint_trial, judge=_checkpoint_judge,
        hint="write to a temporary file next to the checkpoint (same folder, so the same "
             "file system), then os.replace it onto the checkpoint; if the save raises, "
             "remove the temporary file and let the exception go on",
    ),
    Exercise(
        key="08.2", difficulty=1, minutes=20,
        title="micro-batches and accumulation for a global batch",
        function="batch_plan",
        cases=[Case(f"global batch {g}, {count(w, 'rank')}, at most {m} samples per pass",
                    (g, w, m))
               for g, w, m in ((256, 2, 64), (256, 8, 32), (96, 4, 8), (120, 8, 7),
                               (100, 3, 64), (64, 1, 64), (28, 2, 6), (26, 2, 6))]
        + [Case("a global batch, a number of ranks and a limit drawn afresh",
                (None, None, None))],
        trial=_plan_trial, judge=_plan_judge,
        hint="each rank gets global batch / world samples per step, split into equal "
             "micro-batches of at most the limit; raise ValueError when the ranks cannot "
             "get equal shares",
    ),
]
