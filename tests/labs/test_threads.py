"""Chapter 04's GIL measurement (mgpu_helpers.labs.threads, benchmarks/gil_threads.py)."""

import json
import statistics
import threading
from pathlib import Path

import pytest
import torch

from mgpu_helpers.labs import threads


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_threaded_forward_computes_what_the_whole_batch_does(n_threads):
    net, inputs = threads.cases(batch_size=7)["tiny MLP, batch 7"]
    with torch.no_grad():
        torch.testing.assert_close(threads.threaded_forward(net, inputs, n_threads), net(inputs))


def test_threaded_forward_runs_each_chunk_on_its_own_thread():
    seen = []

    class Recorder(torch.nn.Module):
        def forward(self, x):
            seen.append((threading.get_ident(), len(x)))
            return x

    threads.threaded_forward(Recorder(), torch.zeros(6, 2), 3)
    assert sorted(size for _, size in seen) == [2, 2, 2]
    assert threading.get_ident() not in {ident for ident, _ in seen}


def test_measure_reports_every_round_and_the_median():
    calls = []
    result = threads.measure(
        rounds=2, repeats=1, batch_size=4, progress=lambda r, name, s: calls.append((r, name))
    )
    names = [row["case"] for row in result["cases"]]
    assert names == ["tutorial CNN, batch 4", "tiny MLP, batch 4"]
    assert calls == [(0, names[0]), (0, names[1]), (1, names[0]), (1, names[1])]
    for row in result["cases"]:
        assert len(row["speedups"]) == 2
        assert row["speedup"] == pytest.approx(sum(row["speedups"]) / 2)  # median of 2


@pytest.mark.parametrize("bad", [{"rounds": 0}, {"repeats": 0}, {"batch_size": 0}])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="at least 1"):
        threads.measure(**bad)
    with pytest.raises(ValueError, match="n_threads must be at least 1, got 0"):
        threads.threaded_forward(torch.nn.Identity(), torch.zeros(2), 0)


@pytest.mark.parametrize("grad_enabled", [True, False])
def test_threads_run_in_the_callers_grad_mode(grad_enabled):
    seen = []

    class Recorder(torch.nn.Module):
        def forward(self, x):
            seen.append(torch.is_grad_enabled())
            return x * 2

    inputs = torch.zeros(4, 2, requires_grad=True)
    with torch.set_grad_enabled(grad_enabled):
        output = threads.threaded_forward(Recorder(), inputs, 2)
    assert seen == [grad_enabled] * 2
    assert output.requires_grad is grad_enabled


def test_forward_seconds_runs_without_autograd():
    seen = []

    class Recorder(torch.nn.Module):
        def forward(self, x):
            seen.append(torch.is_grad_enabled())
            return x

    threads.forward_seconds(Recorder(), torch.zeros(4, 2), 2, repeats=1)
    assert seen and not any(seen)


def test_an_exception_in_a_thread_reaches_the_caller():
    class Fails(torch.nn.Module):
        def forward(self, x):
            if len(x) == 1:
                raise ValueError("chunk of one")
            return x

    with pytest.raises(ValueError, match="chunk of one"):
        threads.threaded_forward(Fails(), torch.zeros(3, 2), 2)  # chunks of 2 and 1


def test_the_stored_reference_run_shows_what_chapter_04_says():
    # Chapter 04 prints the speed-ups of this stored run (recorded on an idle 2-core CPU
    # machine) and checks their cause live; the speed-ups themselves are checked here, on
    # the stored file, because a live timing mostly measures how busy the machine is.
    path = Path(__file__).parents[2] / "benchmarks" / "results" / "gil_threads.json"
    run = json.loads(path.read_text())
    assert run["cpus"] >= 2 and run["intra_op_threads"] == 1, run  # a free second core
    cases = {row["case"]: row for row in run["cases"]}
    assert set(cases) == {"tutorial CNN, batch 64", "tiny MLP, batch 64"}
    for row in cases.values():
        assert len(row["speedups"]) == run["rounds"]
        assert row["speedup"] == statistics.median(row["speedups"])
    cnn, mlp = cases["tutorial CNN, batch 64"], cases["tiny MLP, batch 64"]
    # the convolutions: faster with a second thread in every round, by over 1.5x in the median
    assert all(s > 1.0 for s in cnn["speedups"]) and cnn["speedup"] > 1.5, cnn
    # the tiny layers: no faster in any round
    assert all(s <= 1.0 for s in mlp["speedups"]), mlp
