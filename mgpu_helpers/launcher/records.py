"""The records both sides of the fork share: the group a rank joins, and what a rank sends
back to the launcher over its result pipe (its pickled value, or the report of its error).

Module-level frozen dataclasses, so that they pickle under fork and spawn alike.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupSpec:
    """The process group every rank of one launch attempt joins."""

    world_size: int
    backend: str
    master_addr: str
    master_port: int
    timeout_s: float
    cpu_threads: int
    restart: int = 0  # how many times the ranks were restarted before this attempt


@dataclass(frozen=True)
class ErrorReport:
    """What a rank's work raised, and where: ``phase`` is "unpickle", "rendezvous", "run"
    or "return"; ``failed_at`` is the rank's own clock (``time.time()``)."""

    rank: int
    phase: str
    failed_at: float
    type_name: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, exc: BaseException, rank: int, phase: str) -> ErrorReport:
        return cls(rank=rank, phase=phase, failed_at=time.time(),
                   type_name=type(exc).__name__, message=str(exc).strip(),
                   traceback="".join(traceback.format_exception(exc)))

    def summary(self) -> str:
        """``Type: first line of the message``."""
        first_line = self.message.splitlines()[0] if self.message else ""
        return f"{self.type_name}: {first_line}"


@dataclass(frozen=True)
class Returned:
    """The rank's work returned: its value, pickled with every tensor on the CPU."""

    payload: bytes


@dataclass(frozen=True)
class Raised:
    """The rank's work raised: the launcher re-raises it as a :class:`LaunchError`."""

    report: ErrorReport


# What a rank sends back over its result pipe, once.
Outcome = Returned | Raised
