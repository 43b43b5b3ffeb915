"""The weak-scaling measurement behind chapter 05's plot and benchmarks/ddp_scaling.py."""

import matplotlib
import pytest

from mgpu_helpers.labs import scaling

matplotlib.use("Agg")
pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def row(ranks, threads, value, hook=None, accumulate=1):
    return {"label": scaling.Setup(ranks, threads, hook, accumulate).label, "ranks": ranks,
            "threads": threads, "comm_hook": hook, "accumulate": accumulate,
            "runs": [value], "samples_per_s": value}


def test_efficiency_compares_like_with_like():
    rows = [row(1, 1, 100), row(1, 2, 150), row(2, 1, 180), row(1, 1, 120, accumulate=4),
            row(2, 1, 228, accumulate=4), row(2, 1, 240, hook="fp16", accumulate=8)]
    scaling.add_efficiency(rows)
    assert [r["efficiency"] for r in rows] == [None, None, 0.9, None, 0.95, None]


def test_efficiency_is_the_median_of_per_round_ratios():
    # The machine slowed down in round 2; each round's ratio still says 0.95 and 1.0.
    base = {**row(1, 1, 100), "runs": [100, 50, 100]}
    ddp = {**row(2, 1, 190), "runs": [190, 100, 200]}
    scaling.add_efficiency([base, ddp])
    assert ddp["efficiency_runs"] == [0.95, 1.0, 1.0]
    assert ddp["efficiency"] == 1.0


def test_labels_say_what_runs():
    assert scaling.Setup(1, 1).label == "1 rank, 1 thread"
    assert scaling.Setup(2, 1, "fp16", 4).label == (
        "2 DDP ranks, 1 thread each, fp16 gradients, no_sync x4")


@pytest.mark.parametrize(("args", "message"), [
    ((0, 1), "ranks, threads and accumulate must be >= 1"),
    ((2, 1, "int8"), "comm_hook must be None or one of"),
])
def test_bad_setups_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        scaling.Setup(*args)


def test_measure_runs_each_setup_and_plots():
    seen = []
    result = scaling.measure(setups=(scaling.Setup(1, 1), scaling.Setup(2, 1, "none")),
                             per_rank_samples=32, batch_size=16, repeats=1,
                             warmup_batches=1, progress=lambda *a: seen.append(a))
    assert len(seen) == 2
    single, double = result["setups"]
    assert single["samples_per_s"] > 0 and double["samples_per_s"] > 0
    assert double["efficiency"] == pytest.approx(
        double["samples_per_s"] / (2 * single["samples_per_s"]))
    ax = scaling.plot(result)
    ticks = dict(zip(ax.get_yticks(), [t.get_text() for t in ax.get_yticklabels()],
                     strict=True))
    assert [ticks[y] for y in sorted(ticks, reverse=True)] == [  # first setup on top
        "1 rank, 1 thread", "2 DDP ranks, 1 thread each, no gradient exchange"]


def test_asking_for_more_samples_than_exist_is_an_error():
    from mgpu_helpers import LaunchError
    with pytest.raises(LaunchError, match="more than the 1442 training images"):
        scaling.measure(setups=(scaling.Setup(2, 1),), per_rank_samples=1000, repeats=1)
