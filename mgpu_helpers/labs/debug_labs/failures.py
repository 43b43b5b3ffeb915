"""Reading a failed lab: the debug level its ranks run under, and its report condensed.

:func:`distributed_debug` sets ``TORCH_DISTRIBUTED_DEBUG`` for the ranks launched inside a
``with`` block. :func:`failure_summary` condenses a failed lab's report to the phrases that
carry its lesson, identical on every run and machine (the full report varies: which rank
reported first, gloo's source paths, timestamps).
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def distributed_debug(level: str = "DETAIL"):
    """Set ``TORCH_DISTRIBUTED_DEBUG`` for ranks launched inside the block.

    PyTorch reads the variable when ``torch.distributed`` is imported; forked ranks
    inherit the parent's reading, so setting ``os.environ`` alone in a notebook does
    nothing. This sets the variable and re-reads it, and restores both afterwards.
    """
    if level not in ("OFF", "INFO", "DETAIL"):
        raise ValueError(f"level must be OFF, INFO or DETAIL, got {level!r}")
    before = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = level
    dist.set_debug_level_from_env()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        else:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = before
        dist.set_debug_level_from_env()


#: Phrases that carry a lab's lesson, as they appear in the launcher's report or in
#: what the ranks printed before dying; :func:`failure_summary` quotes those it finds.
LESSON_PHRASES = (
    r"Ranks? \d+(?:, \d+)* failed to pass monitoredBarrier in \d+ ms",
    r"Timed out waiting \d+ms for \w+ operation",
    r"Expected to have finished reduction in the prior iteration",
    r"find_unused_parameters=True",
    r"Received data size doesn't match expected size",
)
_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\("
                          r"SequenceNumber=\d+, OpType=(\w+), TensorShape=\[([^\]]*)\]")
# "rank 1 killed by signal SIGKILL" (the root cause) or "  rank 1: killed by ..." (another
# rank); SIGTERM is the launcher stopping the others, not a cause.
_KILLED = re.compile(r"rank (\d+):? killed by signal (SIG(?!TERM\b)\w+)")
_ROOT_ERROR = re.compile(r"rank \d+ failed: (\w+): ")


def failure_summary(report: str, rank_output: str = "") -> str:
    """One line that says what went wrong, the same on every run and every machine.

    ``report`` is a ``LaunchError``'s text, ``rank_output`` what the ranks printed (gloo
    prints its last words there before aborting). The line names a rank killed by a
    signal, else the first failing rank's exception type; then the collectives each rank
    was running (from ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s report, in rank order) and the
    :data:`LESSON_PHRASES` found. Left out on purpose: which rank reported first (two
    ranks that time out together race for it), gloo's source paths, timestamps.
    """
    killed = sorted(set(_KILLED.findall(report)), key=lambda found: int(found[0]))
    if killed:
        head = ", ".join(f"rank {index} killed by signal {name}" for index, name in killed)
    else:
        root = _ROOT_ERROR.match(report)
        head = root.group(1) if root else "failed"
    details = []
    fingerprints = sorted(set(_FINGERPRINT.findall(report)), key=lambda f: int(f[0]))
    if fingerprints:
        details.append("Detected mismatch between collectives: " + ", ".join(
            f"rank {index} {op} of shape [{shape}]" for index, op, shape in fingerprints))
    text = f"{report}\n{rank_output}"
    phrases = [found.group(0) for pattern in LESSON_PHRASES
               if (found := re.search(pattern, text))]
    if any("monitoredBarrier" in phrase for phrase in phrases):
        # the barrier quotes its own wait's timeout as the cause, in the time it had left
        # (2000 ms, or 1999): the barrier's message, naming who is missing, says it all
        phrases = [phrase for phrase in phrases if not phrase.startswith("Timed out")]
    details += phrases
    if not details and not killed:  # an unexpected error: the launcher's first line
        details.append(_ROOT_ERROR.sub("", report.splitlines()[0]) if report else "no report")
    return ": ".join([head, " ... ".join(details)] if details else [head])
