"""The launcher's handle on one started rank: its pipes, its output, how it ended."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
from dataclasses import dataclass, field

from .records import Outcome, Raised


@dataclass(eq=False)  # a handle is one rank: compared by identity, never by its fields
class RankHandle:
    """One started rank, seen from the launcher (the parent side of the fork)."""

    index: int
    process: mp.process.BaseProcess
    result_conn: object
    stdout_conn: object
    stderr_conn: object
    partial: dict = field(default_factory=lambda: {"stdout": b"", "stderr": b""})
    outcome: Outcome | None = None  # what the rank sent back, once it has
    exited_at: float | None = None
    stopped: bool = False  # the launcher signalled it while it still ran
    capture: list[str] | None = None  # collects stderr lines while dumping stacks

    def signal_tree(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(self.process.pid, signum)
            except ProcessLookupError:
                pass

    def kill_leftovers(self) -> None:
        """Kill what the rank started and left behind (its session outlives it)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def close_pipes(self) -> None:
        for conn in (self.result_conn, self.stdout_conn, self.stderr_conn):
            conn.close()

    def emit(self, stream: str, data: bytes) -> None:
        """Print complete lines; pass on a progress bar's carriage-return updates live.

        A ``\r`` means "overwrite the current line" (tqdm redraws its bar that way), so
        only the text after a line's last ``\r`` is kept, and an unfinished line whose
        latest update is complete is shown with ``end="\r"``, to be overwritten.
        """
        buffered = self.partial[stream] + data
        *lines, rest = buffered.split(b"\n")
        for line in lines:
            self._print(stream, line.rsplit(b"\r", 1)[-1].decode("utf-8", errors="replace"))
        if b"\r" in rest:
            updates = rest.split(b"\r")
            latest = next((u for u in reversed(updates[:-1]) if u.strip()), b"")
            if latest:
                self._print(stream, latest.decode("utf-8", errors="replace"), end="\r")
            rest = updates[-1]
        self.partial[stream] = rest

    def flush_partial(self) -> None:
        for stream, rest in self.partial.items():
            if rest.strip():
                self._print(stream, rest.decode("utf-8", errors="replace"))
            self.partial[stream] = b""

    def _print(self, stream: str, text: str, end: str = "\n") -> None:
        if self.capture is not None and stream == "stderr":
            self.capture.append(text)
            return
        print(f"[rank {self.index}] {text}", file=getattr(sys, stream), end=end, flush=True)

    def describe_end(self) -> str:
        code = self.process.exitcode
        if isinstance(self.outcome, Raised):
            return self.outcome.report.summary()
        if code is None:
            return "still running"
        killed = f"killed by signal {signal.Signals(-code).name}" if code < 0 else None
        if self.outcome is None:
            return killed or f"exited with code {code} without returning a result"
        if code != 0 and self.stopped:
            return "returned its result, then was stopped by the launcher as it ended"
        if code != 0:  # it returned its value, then its process did not end cleanly
            how = f"was {killed}" if killed else f"exited with code {code}"
            return f"returned its result, then {how} as its process ended"
        return "finished normally"
