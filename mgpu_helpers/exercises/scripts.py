"""A reader's training script, run under torchrun and watched: exercise 05.4's machinery.

The reader writes ``def main():`` in a notebook cell; :func:`script_source` turns it into
a script file, and :func:`run_under_torchrun` runs it as torchrun would on one node
(``python -m torch.distributed.run --standalone --nproc-per-node N script.py ...``), with
each worker started through this module (``-m mgpu_helpers.exercises.scripts``), which
writes down, per rank, what the script wrote into the watched folder (saves, files
opened for writing, renames) and the traceback of an exception it raised, in the
reader's frames. The run's time counts from when every worker has started (starting
torchrun and its workers, seconds each on a busy machine, is not the script's time); a run
that outlives it is stopped whole: torchrun's workers run in sessions of their own, so
each is killed by its process group, then torchrun.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Environment variables that tell a worker where to write its notes and what to watch.
_NOTES = "MGPU_EXERCISE_SCRIPT_NOTES"
_WATCHED = "MGPU_EXERCISE_SCRIPT_WATCHED"
_PACKAGE = str(Path(__file__).resolve().parents[1])
_LIBRARY = tuple(sorted({sysconfig.get_paths()[name] for name in
                         ("stdlib", "platstdlib", "purelib", "platlib")}))
# After torchrun is told to stop, how long it may take to stop its workers itself.
_STOP_GRACE_S = 10.0
# Seconds torchrun and its workers may take to start, on top of the run's own time, which
# counts from when every worker has started.
STARTUP_ALLOWANCE_S = 60.0
# How often a run is looked at: ended, every worker started, out of time.
_POLL_S = 0.1


class ScriptSourceError(ValueError):
    """The reader's function cannot be made into a script (no source to read)."""


def script_source(fn: Callable) -> str:
    """The script torchrun runs: ``fn``'s own source, then a call of it under
    ``if __name__ == "__main__":``. ``fn`` must be self-contained: its imports inside it."""
    import inspect

    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as error:
        raise ScriptSourceError(
            f"could not read the source of `{getattr(fn, '__name__', fn)}` ({error}): define "
            "it with `def` in a notebook cell or a .py file") from None
    return f'{source.rstrip()}\n\n\nif __name__ == "__main__":\n    {fn.__name__}()\n'


@dataclass
class ScriptRun:
    """What one torchrun run of the script did."""

    command: list[str]             # as the reader would type it (torchrun ... script.py ...)
    returncode: int | None         # None: stopped after its time ran out
    output: str                    # torchrun's and the workers' stdout and stderr, together
    seconds: float
    errors: dict[int, str] = field(default_factory=dict)  # rank -> the reader's traceback
    writes: list[tuple[int, str, str, str]] = field(default_factory=list)
    # (rank, what, path, to): "save" (torch.save), "open" (for writing), "rename" (path
    # renamed to `to`), "copy"; paths absolute, within or onto the watched folder
    pids: list[int] = field(default_factory=list)  # the workers' process ids

    @property
    def hung(self) -> bool:
        return self.returncode is None


def run_under_torchrun(script: Path, nprocs: int, args: list[str], watched: Path,
                       notes: Path, timeout: float, cwd: Path) -> ScriptRun:
    """Runs ``script`` with ``args`` under torchrun with ``nprocs`` workers on this CPU and
    returns what happened. ``watched`` is the folder whose writes are recorded, ``notes``
    an empty folder for the workers' notes (outside ``watched``), ``cwd`` the working
    directory. ``timeout`` seconds after every worker has started (or
    ``STARTUP_ALLOWANCE_S`` later than that after torchrun started, if some never do),
    every worker and torchrun are stopped."""
    env = {**os.environ,
           # CPU check: gloo on every machine, so the result can be compared exactly with
           # the checker's own CPU reference, and GPUs (if any) are left alone
           "CUDA_VISIBLE_DEVICES": "",
           "OMP_NUM_THREADS": "1",  # as torchrun sets for several workers, without its notice
           "PYTHONUNBUFFERED": "1",
           _NOTES: str(notes), _WATCHED: str(watched)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nprocs), "-m", __name__, str(script), *args]
    shown = ["torchrun", "--standalone", "--nproc-per-node", str(nprocs), script.name, *args]
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", start_new_session=True)
    output: list[str] = []  # read meanwhile: a full pipe would stop the workers' prints
    reader = threading.Thread(target=lambda: output.append(process.stdout.read()),
                              name="torchrun-output", daemon=True)
    reader.start()
    returncode = _wait_for_the_run(process, notes, nprocs, timeout, started)
    if returncode is None:
        _stop(process, notes)
    reader.join()
    process.stdout.close()
    process.wait()
    return ScriptRun(shown, returncode, "".join(output), time.monotonic() - started,
                     errors=_read_errors(notes), writes=_read_writes(notes),
                     pids=_read_pids(notes))


def _wait_for_the_run(process: subprocess.Popen, notes: Path, nprocs: int, timeout: float,
                      started: float) -> int | None:
    """torchrun's exit status, or None once the run is out of time: ``timeout`` seconds
    after its ``nprocs`` workers have all started (each writes its pid first), or after
    ``timeout + STARTUP_ALLOWANCE_S`` in all."""
    backstop = started + timeout + STARTUP_ALLOWANCE_S
    deadline = None
    while True:
        try:
            return process.wait(timeout=_POLL_S)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if deadline is None and len(_read_pids(notes)) >= nprocs:
            deadline = now + timeout
        if now >= backstop or (deadline is not None and now >= deadline):
            return None


def _stop(process: subprocess.Popen, notes: Path) -> None:
    """Every worker (each leads a process group of its own: torchrun starts them in new
    sessions), then torchrun and anything left in its group."""
    for pid in _read_pids(notes):
        _kill_group(pid, signal.SIGKILL)
    _kill_group(process.pid, signal.SIGTERM)  # torchrun stops the workers it still has
    try:
        process.wait(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _kill_group(process.pid, signal.SIGKILL)


def _kill_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # ended already


def _rank_files(notes: Path, suffix: str) -> dict[int, Path]:
    return {int(path.name.split(".")[0].removeprefix("rank")): path
            for path in sorted(notes.glob(f"rank*.{suffix}"))}


def _read_pids(notes: Path) -> list[int]:
    pids = []
    for path in _rank_files(notes, "pid").values():
        text = path.read_text().strip()
        if text.isdigit():
            pids.append(int(text))
    return pids


def _read_errors(notes: Path) -> dict[int, str]:
    return {rank: path.read_text(errors="replace")
            for rank, path in sorted(_rank_files(notes, "error").items())}


def _read_writes(notes: Path) -> list[tuple[int, str, str, str]]:
    found = []
    for rank, path in sorted(_rank_files(notes, "writes").items()):
        for line in path.read_text(errors="replace").splitlines():
            try:
                what, where, to = json.loads(line)
            except ValueError:  # a line cut off as the process was killed
                continue
            found.append((rank, what, where, to))
    return found


_AGENT_LINE = re.compile(r"^(?:[EWI]\d{4} \d\d:\d\d|\[[EWI] |W\d{4}|\*{10})")


def output_tail(output: str, lines: int = 15) -> str:
    """The last lines the workers printed, without torchrun's own report (its log lines,
    and the traceback of its ChildFailedError that follows them)."""
    kept = []
    for line in output.splitlines():
        if _AGENT_LINE.match(line) or "torch.distributed.elastic" in line:
            break  # torchrun's report of the failure: the rest is its own
        kept.append(line)
    return "\n".join(kept[-lines:])


# ----------------------------------------------------------- inside each torchrun worker

def _reader_traceback(error: BaseException, script: str) -> str:
    """``error``'s traceback in the frames of the script (the file ``script`` and what it
    defines): from its first frame on, without this package's, runpy's or the libraries'
    that it called (the exception's line says what they raised)."""
    frames = traceback.extract_tb(error.__traceback__)
    first = next((k for k, frame in enumerate(frames) if frame.filename == script), 0)
    frames = [frame for frame in frames[first:]
              if not frame.filename.startswith((_PACKAGE, *_LIBRARY, "<frozen"))]
    head = "Traceback (most recent call last):\n" if frames else ""
    last = "".join(traceback.format_exception_only(type(error), error)).strip()
    return head + "".join(traceback.format_list(frames)) + last


def _watch_writes(folder: str, note: Callable[[str, str, str], None]) -> None:
    """Notes what the script writes within ``folder`` (or renames onto it): files opened
    for writing, renames, copies, through Python's audit events, and torch.save's path,
    which torch opens in C++ where no audit event sees it."""
    import torch

    inside = os.path.realpath(folder) + os.sep
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def absolute(path) -> str | None:
        if isinstance(path, int) or not isinstance(path, (str, bytes, os.PathLike)):
            return None
        return os.path.realpath(os.fsdecode(path))

    def within(path: str | None) -> bool:
        return path is not None and path.startswith(inside)

    def hook(event: str, args: tuple) -> None:
        try:
            if event == "open":
                path, mode, flags = args
                if ((isinstance(mode, str) and any(c in mode for c in "wax+"))
                        or (isinstance(flags, int) and flags & writes)):
                    path = absolute(path)
                    if within(path):
                        note("open", path, "")
            elif event == "os.rename":  # os.rename, os.replace, shutil.move
                source, target = absolute(args[0]), absolute(args[1])
                if within(source) or within(target):
                    note("rename", source or "", target or "")
            elif event == "shutil.copyfile":
                target = absolute(args[1])
                if within(target):
                    note("copy", absolute(args[0]) or "", target)
        except Exception:  # an audit hook that raised would break the reader's call
            pass

    sys.addaudithook(hook)
    save = torch.serialization.save

    def watched_save(obj, f, *args, **kwargs):
        path = absolute(f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None))
        if within(path):
            note("save", path, "")
        return save(obj, f, *args, **kwargs)

    torch.save = torch.serialization.save = watched_save


def _worker(argv: list[str]) -> None:
    """A torchrun worker: runs the script ``argv[0]`` with the arguments ``argv[1:]`` as
    ``__main__``, its writes and an exception it raises written down for the checker."""
    import runpy

    script = argv[0]  # as given, relative: the reader's tracebacks name it so
    notes = Path(os.environ[_NOTES])
    rank = int(os.environ.get("RANK", "0"))
    Path(notes, f"rank{rank}.pid").write_text(str(os.getpid()))
    log = os.open(Path(notes, f"rank{rank}.writes"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def note(what: str, path: str, to: str) -> None:
        os.write(log, (json.dumps([what, path, to]) + "\n").encode())

    _watch_writes(os.environ[_WATCHED], note)
    sys.argv = [script, *argv[1:]]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise
    except BaseException as error:
        Path(notes, f"rank{rank}.error").write_text(_reader_traceback(error, script))
        raise
    # The script ended well: leave without the interpreter's finalisation. There, torch
    # 2.14's gloo worker threads may still release a finished collective, whose Python
    # state needs the GIL then, and abort the process ("terminate called without an
    # active exception"; described in pytorch/pytorch#179291): here in about 1 run in
    # 20 of 3 ranks, with or without this module, after the script's work was all done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker(sys.argv[1:])
