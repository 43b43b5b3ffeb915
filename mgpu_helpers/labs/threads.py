"""Chapter 04's GIL measurement: does a second Python thread speed up a forward pass?

``DataParallel`` runs its replicas on Python threads of one process. A thread holds the
GIL while it runs Python (module calls, hooks) and each PyTorch operation releases it
while it computes, so a second thread helps in proportion to the time spent inside the
operations: a lot for big convolutions, nothing (or less than nothing) for many tiny layers.

:func:`measure` times both kinds of network with 1 and 2 threads, taking turns round
after round so that a drifting machine slows every case alike, and reports each case's
median speed-up. ``benchmarks/gil_threads.py`` stores its result, which chapter 04 prints
and ``tests/labs/test_threads.py`` checks; the chapter's own live timings depend on what
else the machine runs at that moment.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

from ..models import SeedCNN


def tiny_mlp() -> nn.Sequential:
    """Twenty 32x32 linear layers: each kernel takes microseconds, Python dominates."""
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(20)])


def cases(batch_size: int = 64) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    """The two networks chapter 04 compares, with their inputs (CPU; the values do not
    matter for the timing, so the weights keep their default random initialisation)."""
    generator = torch.Generator().manual_seed(0)
    return {
        f"tutorial CNN, batch {batch_size}": (
            SeedCNN().eval(),
            torch.randn(batch_size, 3, 32, 32, generator=generator),
        ),
        f"tiny MLP, batch {batch_size}": (
            tiny_mlp().eval(),
            torch.randn(batch_size, 32, generator=generator),
        ),
    }


def threaded_forward(net: nn.Module, inputs: torch.Tensor, n_threads: int) -> torch.Tensor:
    """The batch split into ``n_threads`` chunks, each run through ``net`` on its own
    thread (DataParallel's scatter and parallel apply, on the CPU), outputs concatenated.
    The threads run in the caller's grad mode; an exception in one is raised here."""
    if n_threads < 1:
        raise ValueError(f"n_threads must be at least 1, got {n_threads}")
    chunks = inputs.chunk(n_threads)
    outputs: list[torch.Tensor | None] = [None] * len(chunks)
    errors: list[BaseException | None] = [None] * len(chunks)
    # Grad mode is per thread (a new thread starts with it on), so a torch.no_grad()
    # around this call would not reach the threads: each takes the caller's, as
    # torch.nn.parallel.parallel_apply does.
    grad_enabled = torch.is_grad_enabled()

    def apply(k: int) -> None:
        try:
            with torch.set_grad_enabled(grad_enabled):
                outputs[k] = net(chunks[k])
        except Exception as error:  # raised in the caller below, not lost with the thread
            errors[k] = error

    threads = [threading.Thread(target=apply, args=(k,)) for k in range(len(chunks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error
    return torch.cat(outputs)


def forward_seconds(
    net: nn.Module, inputs: torch.Tensor, n_threads: int, repeats: int = 7
) -> float:
    """Median wall time of one threaded forward pass (no autograd: every thread runs under
    the caller's ``torch.no_grad()``), after one warm-up."""
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            threaded_forward(net, inputs, n_threads)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure(
    rounds: int = 5,
    repeats: int = 7,
    batch_size: int = 64,
    progress: Callable[[int, str, float], None] | None = None,
) -> dict:
    """Each case's 1-thread and 2-thread forward times, ``rounds`` times in turn; per case
    the median over the rounds of (1-thread time / 2-thread time), and every round's."""
    if min(rounds, repeats, batch_size) < 1:
        raise ValueError("rounds, repeats and batch_size must be at least 1")
    networks = cases(batch_size)
    speedups: dict[str, list[float]] = {name: [] for name in networks}
    seconds: dict[str, dict[int, list[float]]] = {name: {1: [], 2: []} for name in networks}
    for round_index in range(rounds):
        for name, (net, inputs) in networks.items():
            one, two = (forward_seconds(net, inputs, n, repeats) for n in (1, 2))
            seconds[name][1].append(one)
            seconds[name][2].append(two)
            speedups[name].append(one / two)
            if progress is not None:
                progress(round_index, name, one / two)
    return {
        "rounds": rounds,
        "repeats": repeats,
        "batch_size": batch_size,
        "cases": [
            {
                "case": name,
                "one_thread_s": statistics.median(seconds[name][1]),
                "two_threads_s": statistics.median(seconds[name][2]),
                "speedups": speedups[name],
                "speedup": statistics.median(speedups[name]),
            }
            for name in networks
        ],
    }
