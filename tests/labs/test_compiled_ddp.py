"""Chapter 08's torch.compile with DDP (mgpu_helpers.labs.compiled_ddp)."""

import contextlib
import io
import logging

import pytest

from mgpu_helpers import launch
from mgpu_helpers.labs import compiled_ddp

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def as_sets(groups):
    return sorted(sorted(group) for group in groups)


def every_compiled_case():
    """Inside a rank: every case of the lab, in one world (each resets dynamo)."""
    return {"compare": compiled_ddp.compare(),
            "caps": {cap: compiled_ddp.compare(bucket_cap_mb=cap, steps=2)["runs"]
                     for cap in (None, 2)},
            "sequential": compiled_ddp.sequential_graph_count(),
            "explained": compiled_ddp.explained_graph_counts()}


@pytest.fixture(scope="module")
def compiled():
    """Every rank's results, and what the ranks printed to stderr."""
    printed = io.StringIO()  # the launcher writes the ranks' stderr to sys.stderr
    with contextlib.redirect_stderr(printed):
        ranks = launch(every_compiled_case, nprocs=2, backend="gloo", return_all=True)
    return ranks, printed.getvalue()


@pytest.mark.slow
def test_ddp_optimizer_cuts_one_graph_per_bucket_and_trains_like_eager_ddp(compiled):
    ranks = [outcome["compare"] for outcome in compiled[0]]
    result = ranks[0]
    runs = result["runs"]
    buckets = runs["eager"]["buckets"]
    parameters = sorted(name for bucket in buckets for name in bucket)
    assert len(buckets) > 1  # otherwise there is nothing to cut
    split, whole = runs["DDPOptimizer"], runs["one graph"]
    # the graphs hold exactly the parameters of DDP's buckets, one graph per bucket
    assert as_sets(split["graphs"]) == as_sets(buckets)
    assert split["buckets"] == buckets  # DDP keeps the same buckets, in the same order
    assert [sorted(graph) for graph in whole["graphs"]] == [parameters]
    # each graph's backward ends a bucket, whose all-reduce starts before the next one
    assert compiled_ddp.started_during_backward(split["events"]) == len(buckets) - 1
    assert compiled_ddp.started_during_backward(whole["events"]) == 0
    assert [kind for kind, _ in whole["events"]] == ["backward"] + ["all-reduce"] * len(buckets)
    for run in runs.values():
        assert run["max_diff"] < 1e-6 and run["moved"] > 1e-3  # same weights, not unmoved
        assert len(run["step_s"]) == 5 and run["first_s"] == run["step_s"][0]
    for other in ranks[1:]:  # every rank cut the same graphs
        assert [other["runs"][m]["graphs"] for m in compiled_ddp.MODES] == [
            runs[m]["graphs"] for m in compiled_ddp.MODES]
    # torch's warnings were collected in the ranks, not printed with a timestamp
    assert all(isinstance(message, str) for message in result["torch_warnings"])
    assert "torch/" not in compiled[1]
    assert result["warm_up_s"] > 0


@pytest.mark.slow
def test_the_cuts_follow_ddp_buckets_at_the_default_cap_and_miss_them_at_2_mib(compiled):
    # DDPOptimizer's first bucket is 1 MiB, as DDP's at its default; a given cap is DDP's
    # first bucket's cap too
    runs = compiled[0][0]["caps"]
    default, two = runs[None], runs[2]
    assert as_sets(default["DDPOptimizer"]["graphs"]) == as_sets(default["eager"]["buckets"])
    assert len(default["eager"]["buckets"]) == 2  # 1 MiB first, then the rest (< 25 MiB)
    assert compiled_ddp.started_during_backward(default["DDPOptimizer"]["events"]) == 1
    assert as_sets(two["DDPOptimizer"]["graphs"]) != as_sets(two["eager"]["buckets"])
    assert compiled_ddp.started_during_backward(two["DDPOptimizer"]["events"]) == 0
    assert all(run["max_diff"] < 1e-6 for caps in runs.values() for run in caps.values())


@pytest.mark.slow
def test_ddp_around_torch_nn_sequential_is_not_compiled_at_all(compiled):
    assert compiled[0][0]["sequential"] == 0


@pytest.mark.slow
def test_explain_finds_no_graph_in_a_sequential_unless_it_has_hooks(compiled):
    counts = compiled[0][0]["explained"]
    assert counts["nn.Sequential"] == 0
    assert counts["BiasFreeMLP"] > 0 and counts["nn.Sequential with a hook"] > 0


def test_started_during_backward_counts_all_reduces_with_a_backward_after_them():
    layer = [[f"layers.{k}.weight"] for k in range(3)]
    events = [("backward", layer[2]), ("all-reduce", layer[2]), ("backward", layer[1]),
              ("all-reduce", layer[1]), ("backward", layer[0]), ("all-reduce", layer[0])]
    assert compiled_ddp.started_during_backward(events) == 2
    assert compiled_ddp.timeline(events[:3]) == "backward(2) -> all-reduce(2) -> backward(1)"
    one_graph = [("backward", layer[0] + layer[1]), ("all-reduce", layer[0]),
                 ("all-reduce", layer[1])]
    assert compiled_ddp.started_during_backward(one_graph) == 0
    assert compiled_ddp.timeline(one_graph) == "backward(0+1) -> all-reduce(0) -> all-reduce(1)"
    assert compiled_ddp.started_during_backward([]) == 0


@pytest.mark.parametrize("arguments, message", [
    ({"backend": "eager"}, "AOTAutograd"),
    ({"steps": 1}, "steps must be 2 or more"),
    ({}, "2 or more ranks"),  # a plain process: world size 1
])
def test_compare_says_what_is_wrong(arguments, message):
    with pytest.raises(ValueError, match=message):
        compiled_ddp.compare(**arguments)


def test_torch_warnings_are_collected_instead_of_printed(capsys):
    logger = logging.getLogger("torch._dynamo.variables.ctx_manager")
    with compiled_ddp.torch_warnings_collected() as collected:
        logger.warning("profiler label %s ignored", "x")
    assert collected == ["profiler label x ignored"]
    assert "profiler label" not in capsys.readouterr().err
    logger.warning("after the block")
    assert "after the block" in capsys.readouterr().err
