"""The error a failed launch raises: the root cause first, other ranks after, advice."""

from __future__ import annotations

import re
import signal

from .rank_handle import RankHandle
from .records import ErrorReport, Raised, Returned


class LaunchError(RuntimeError):
    """A rank failed, or the launch could not start. The message starts with the cause."""


_COLLATERAL_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def is_collateral(report: ErrorReport) -> bool:
    """A peer that gave up (a timeout, a crash) closes its connections: the others then
    fail with "Connection closed by peer", often a moment before the peer's own report.
    Such an error is never taken for the root cause while another exists."""
    return any(text in report.message for text in _COLLATERAL_ERRORS)


# Advice is matched on what failed, not on words anywhere in a traceback: a TimeoutError
# raised by the user's own code, or torch.load's unpickler failing on a bad file, gets none.
_CUDA_FORK = ("Cannot re-initialize CUDA in forked subprocess", "poisoned fork")
# torch.distributed's errors (gloo raises RuntimeError; NCCL and the store, subclasses)
_DISTRIBUTED_TYPES = {"RuntimeError", "DistError", "DistBackendError", "DistNetworkError",
                      "DistStoreError"}
_COLLECTIVE_TIMEOUT = re.compile(
    r"Timed out waiting \d+ ?ms|failed to pass monitoredBarrier|Watchdog caught collective "
    r"operation timeout|wait timeout after \d+ ?ms|[Tt]imed out after \d+ seconds")
_PICKLE_TYPES = {"PicklingError", "UnpicklingError", "TypeError", "AttributeError"}


def advice_for(report: ErrorReport) -> str:
    """Advice for a rank's error report (its phase, exception type and message)."""
    kind, message, phase = report.type_name, report.message, report.phase
    if kind == "RuntimeError" and any(text in message for text in _CUDA_FORK):
        return ("CUDA was initialised in the launching process before it forked. Restart "
                "the kernel and avoid torch.cuda calls before launch(), or pass "
                "start_method='spawn'.")
    if phase == "return" and kind in _PICKLE_TYPES:
        return ("A rank's return value travels back to the launcher pickled: return plain "
                "data (numbers, tensors, dicts, lists), not open files, locks, generators "
                "or lambdas.")
    if phase == "unpickle":
        return ("Under spawn, the function and its arguments are rebuilt in each rank: "
                "everything they refer to must be importable or picklable there.")
    if kind in _DISTRIBUTED_TYPES and _COLLECTIVE_TIMEOUT.search(message):
        return ("A collective waited longer than `timeout`: usually one rank skipped a "
                "collective the others entered, or a rank is far slower. "
                "TORCH_DISTRIBUTED_DEBUG=DETAIL names the collective each rank is in.")
    return ""


def failure_message(ranks: list[RankHandle]) -> str:
    """The launch error text: the root cause first, then the other ranks, then advice."""
    def failed_at(rank: RankHandle) -> float:
        if isinstance(rank.outcome, Raised):
            return rank.outcome.report.failed_at
        return rank.exited_at or float("inf")

    # The root cause, in this order: the earliest error a rank raised itself; else the
    # first rank that died without a report (a crash, os._exit, a signal from outside)
    # and was not stopped by the launcher; else an error that only says a peer went away
    # (the echo of another rank's death); else a rank that returned its value and then
    # failed as its process ended (after a peer's death its group cannot end cleanly);
    # else whatever failed first. Ranks' clocks are compared with ranks' clocks, exits
    # noticed by the launcher with each other.
    returned = [r for r in ranks if isinstance(r.outcome, Returned)]
    failures = [r for r in ranks if r not in returned or r.process.exitcode != 0]
    errors = [r for r in failures if isinstance(r.outcome, Raised)]
    genuine = [r for r in errors if not is_collateral(r.outcome.report)]
    died = [r for r in failures if r.outcome is None and not r.stopped]
    ended_badly = [r for r in failures if r in returned and not r.stopped]
    # Each group is ordered by one clock: errors by the ranks' stamps, deaths by when the
    # launcher noticed them. The groups themselves are ranked, never their times.
    root = min(genuine or died or errors or ended_badly or failures, key=failed_at)
    if isinstance(root.outcome, Raised):
        report = root.outcome.report
        head = f"rank {root.index} failed: {report.summary()}"
        if report.phase == "return":
            head += " (while sending its return value back)"
        body = f"\n\nTraceback from rank {root.index}:\n{report.traceback}"
        advice = advice_for(report)
    else:
        head = f"rank {root.index} {root.describe_end()}"
        code = root.process.exitcode
        if root.outcome is not None and code is not None and code > 0:  # returned, then
            head += " (an error while its process ended: its output above shows it)"
        elif root.outcome is not None and code is not None and -code == signal.SIGABRT:
            head += " (a crash in native code as its process ended)"
        elif code is not None and code > 0:
            head += " (os._exit, sys.exit or a crash in native code)"
        elif code is not None and -code == signal.SIGKILL:
            head += " (killed from outside: often the out-of-memory killer)"
        body, advice = "", ""
    others = "\n".join(f"  rank {r.index}: {r.describe_end()}"
                       for r in ranks if r is not root)
    text = f"{head}{body}\nOther ranks (stopped by the launcher after the failure):\n{others}"
    if advice:
        text += f"\n\nAdvice: {advice}"
    return text
