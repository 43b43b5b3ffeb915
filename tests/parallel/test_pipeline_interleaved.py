"""1F1B and interleaved 1F1B from scratch, the timeline analyses (idle share, instant
transfers, the theory) and chapter 06's measurements built on them."""

import sys

import matplotlib
import pytest
import torch
import torch.nn.functional as F
from test_pipeline import batch, mlp  # the same small model and batch
from torch import nn

from mgpu_helpers import LaunchError, launch, rank, world_size
from mgpu_helpers.labs import gpipe
from mgpu_helpers.parallel import pipeline as pp
from mgpu_helpers.viz.plots import plot_timeline

matplotlib.use("Agg")
pytestmark = pytest.mark.usefixtures("no_leftover_processes")


# ------------------------------------------------------------------ the order


def test_interleaved_order_of_two_ranks_with_two_pieces_each():
    F_, B_ = "forward", "backward"
    assert pp.interleaved_order(0, 2, 2, 4) == [
        (F_, 0, 0), (F_, 0, 1), (F_, 1, 0), (F_, 1, 1),          # warm-up: 2(K-r-1) + (v-1)K
        (F_, 0, 2), (B_, 1, 0), (F_, 0, 3), (B_, 1, 1),          # one forward, one backward
        (F_, 1, 2), (B_, 0, 0), (F_, 1, 3), (B_, 0, 1),
        (B_, 1, 2), (B_, 1, 3), (B_, 0, 2), (B_, 0, 3)]          # the remaining backwards
    assert pp.interleaved_order(1, 2, 2, 4) == [
        (F_, 0, 0), (F_, 0, 1),
        (F_, 1, 0), (B_, 1, 0), (F_, 1, 1), (B_, 1, 1), (F_, 0, 2), (B_, 0, 0),
        (F_, 0, 3), (B_, 0, 1), (F_, 1, 2), (B_, 1, 2), (F_, 1, 3), (B_, 1, 3),
        (B_, 0, 2), (B_, 0, 3)]


def test_one_piece_per_rank_is_plain_1f1b():
    assert pp.interleaved_order(0, 3, 1, 4) == [
        ("forward", 0, 0), ("forward", 0, 1), ("forward", 0, 2), ("backward", 0, 0),
        ("forward", 0, 3), ("backward", 0, 1), ("backward", 0, 2), ("backward", 0, 3)]
    assert pp.interleaved_order(2, 3, 1, 2) == [
        ("forward", 0, 0), ("backward", 0, 0), ("forward", 0, 1), ("backward", 0, 1)]


def unit_timeline(orders, forward=1.0, backward=2.0):
    """Events in each rank's order, at made-up times: instant_transfers re-times them."""
    ranks = len(orders)
    events = []
    for r, order in enumerate(orders):
        for position, (kind, chunk, m) in enumerate(order):
            start = 10.0 * position
            events.append(pp.Event(r, kind, m, start,
                                   start + (forward if kind == "forward" else backward),
                                   chunk * ranks + r))
    return events


@pytest.mark.parametrize(("ranks", "virtual", "micro_batches"), [
    (2, 1, 1), (2, 1, 8), (4, 1, 8), (2, 2, 2), (2, 2, 8), (2, 2, 16), (3, 2, 6), (4, 2, 8),
    (4, 3, 8)])
def test_the_orders_run_without_deadlock_and_idle_as_the_theory_says(ranks, virtual,
                                                                     micro_batches):
    orders = [pp.interleaved_order(r, ranks, virtual, micro_batches) for r in range(ranks)]
    wanted = sorted((kind, chunk, m) for kind in ("forward", "backward")
                    for chunk in range(virtual) for m in range(micro_batches))
    assert all(sorted(order) == wanted for order in orders)    # every pass, once
    for backward in (2.0, 3.0, 0.5):  # any ratio of backward to forward time
        replayed = pp.instant_transfers(unit_timeline(orders, backward=backward))
        assert pp.bubble_fraction(replayed) == pytest.approx(
            pp.theoretical_bubble(ranks, micro_batches, virtual))


@pytest.mark.parametrize(("args", "message"), [
    ((0, 2, 2, 5), "5 micro-batches is not a multiple of 2; use 4 or 6"),
    ((2, 2, 1, 4), "rank 2 is not one of the 2 ranks 0..1"),
    ((0, 2, 0, 4), "virtual_stages must be a whole number >= 1, got 0"),
    ((0, 2, 1, 0), "micro_batches must be a whole number >= 1, got 0"),
])
def test_bad_orders_are_refused_with_the_reason(args, message):
    with pytest.raises(ValueError, match=message):
        pp.interleaved_order(*args)


# ------------------------------------------------------------- the theory


def test_theory_as_a_share_of_the_step_and_over_the_ideal_compute():
    assert pp.theoretical_bubble(2, 8) == pytest.approx(1 / 9)         # (K-1)/(M+K-1)
    assert pp.theoretical_bubble(2, 8, 2) == pytest.approx(1 / 17)     # (K-1)/(vM+K-1)
    assert pp.bubble_to_compute(2, 8) == pytest.approx(1 / 8)          # (K-1)/M
    assert pp.bubble_to_compute(2, 8, 2) == pytest.approx(1 / 16)      # (K-1)/(vM)
    share = pp.theoretical_bubble(4, 8, 3)
    assert share / (1 - share) == pytest.approx(pp.bubble_to_compute(4, 8, 3))
    with pytest.raises(ValueError, match="ranks must be a whole number >= 1, got 0"):
        pp.theoretical_bubble(0, 8)


# --------------------------------------------------------- timeline analyses


def test_idle_share_counts_ranks_not_pieces():
    # rank 0 runs pieces 0 and 2, rank 1 piece 1; over 4 s, 5 s of 8 are busy
    events = [pp.Event(0, "forward", 0, 0.0, 1.0, 0), pp.Event(1, "forward", 0, 1.0, 3.0, 1),
              pp.Event(0, "forward", 0, 3.0, 4.0, 2), pp.Event(0, "backward", 0, 2.0, 3.0, 0)]
    assert pp.bubble_fraction(events) == pytest.approx(1 - 5 / 8)


def test_instant_transfers_close_the_gaps_that_messages_left():
    # GPipe, 2 ranks, 1 micro-batch; every message took 0.5 s
    events = [pp.Event(0, "forward", 0, 0.0, 1.0), pp.Event(1, "forward", 0, 1.5, 2.5),
              pp.Event(1, "backward", 0, 2.5, 4.5), pp.Event(0, "backward", 0, 5.0, 7.0)]
    replayed = {(e.rank, e.kind): (e.start, e.end) for e in pp.instant_transfers(events)}
    assert replayed == {(0, "forward"): (0.0, 1.0), (1, "forward"): (1.0, 2.0),
                        (1, "backward"): (2.0, 4.0), (0, "backward"): (4.0, 6.0)}
    assert pp.bubble_fraction(events) == pytest.approx(1 - 6 / 14)
    assert pp.bubble_fraction(pp.instant_transfers(events)) == pytest.approx(0.5)


def test_instant_transfers_refuse_events_that_are_not_one_step():
    events = [pp.Event(0, "backward", 0, 0.0, 1.0), pp.Event(1, "backward", 0, 1.0, 2.0),
              pp.Event(1, "forward", 0, 2.0, 3.0)]  # rank 1's backward before its forward
    with pytest.raises(ValueError, match="not a pipeline step"):
        pp.instant_transfers(events)
    with pytest.raises(ValueError, match="no events recorded"):
        pp.instant_transfers([])


def test_input_waits_read_each_pass_against_the_pass_it_needs():
    # rank 0 holds pieces 0 and 2, rank 1 piece 1 and 3; micro-batch 0 only
    events = [pp.Event(0, "forward", 0, 0.0, 1.0, 0), pp.Event(1, "forward", 0, 1.5, 2.0, 1),
              pp.Event(0, "forward", 0, 2.25, 3.0, 2), pp.Event(1, "forward", 0, 3.0, 4.0, 3),
              pp.Event(1, "backward", 0, 4.0, 5.0, 3), pp.Event(0, "backward", 0, 5.5, 6.0, 2),
              pp.Event(1, "backward", 0, 6.125, 7.0, 1), pp.Event(0, "backward", 0, 7.5, 8.0, 0)]
    assert sorted(pp.input_waits(events)) == [0.0, 0.125, 0.25, 0.5, 0.5, 0.5]
    # GPipe on 2 ranks (no virtual stages): rank 1's forward started before its input existed
    early = [pp.Event(0, "forward", 0, 0.0, 1.0), pp.Event(1, "forward", 0, 0.5, 2.0),
             pp.Event(1, "backward", 0, 2.0, 3.0), pp.Event(0, "backward", 0, 3.5, 4.0)]
    assert sorted(pp.input_waits(early)) == [-0.5, 0.5]


def test_input_waits_refuse_events_that_are_not_one_step():
    one = [pp.Event(0, "forward", 0, 0.0, 1.0), pp.Event(1, "forward", 0, 1.5, 2.0),
           pp.Event(1, "backward", 0, 2.0, 3.0), pp.Event(0, "backward", 0, 3.5, 4.0)]
    with pytest.raises(ValueError, match="needs \\('forward', 0, 0\\), which is not among"):
        pp.input_waits(one[1:])
    with pytest.raises(ValueError, match="appears twice"):
        pp.input_waits(one + one[:1])
    with pytest.raises(ValueError, match="no events recorded"):
        pp.input_waits([])


def test_gantt_chart_shades_each_virtual_stage():
    orders = [pp.interleaved_order(r, 2, 2, 2) for r in range(2)]
    ax = plot_timeline(pp.instant_transfers(unit_timeline(orders)))
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels == [f"{kind} stage {piece}" for kind in "FB" for piece in range(4)]
    colours = {tuple(c.get_facecolor()[0]) for c in ax.collections}
    assert len(colours) == 8  # forward and backward of 4 pieces, each its own shade


# ------------------------------------------------------------------ the step


def unsplit_reference():
    model = mlp()
    x, y = batch()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def interleaved(micro_batches, cuts, virtual):
    model = mlp()
    pieces = pp.split_sequential(model, cuts)
    mine = [pieces[chunk * world_size() + rank()] for chunk in range(virtual)]
    x, y = batch()
    timeline = pp.Timeline(rank())
    loss = pp.interleaved_1f1b_step(mine, micro_batches,
                                    inputs=x if rank() == 0 else None,
                                    targets=y if rank() == world_size() - 1 else None,
                                    timeline=timeline)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()
             if p.grad is not None}
    return loss, grads, timeline.events


@pytest.mark.parametrize(("micro_batches", "cuts", "virtual", "ranks"), [
    (4, [3, 7, 9], 2, 2), (6, [3, 7, 9], 2, 2), (3, [7], 1, 2), (3, [2, 4, 6, 8, 10], 2, 3)])
def test_interleaved_step_gives_the_unsplit_gradients_and_times_every_piece(
        micro_batches, cuts, virtual, ranks):
    expected_loss, expected_grads = unsplit_reference()
    results = launch(interleaved, micro_batches, cuts, virtual, nprocs=ranks,
                     backend="gloo", return_all=True, timeout=30, join_timeout=120)
    grads = {}
    for r, (loss, rank_grads, events) in enumerate(results):
        assert loss == pytest.approx(expected_loss, rel=1e-6)   # every rank gets the loss
        assert sorted((e.virtual_stage, e.kind, e.micro_batch) for e in events) == sorted(
            (chunk * ranks + r, kind, m) for chunk in range(virtual)
            for kind in ("forward", "backward") for m in range(micro_batches))
        assert {e.rank for e in events} == {r}
        grads.update(rank_grads)
    assert sorted(grads) == sorted(expected_grads)              # every parameter, once
    for name, expected in expected_grads.items():
        torch.testing.assert_close(grads[name], expected, rtol=1e-5, atol=1e-7)


def test_interleaved_step_names_what_is_missing():
    def without_inputs():
        return pp.interleaved_1f1b_step([nn.Identity()], 2, targets=torch.zeros(4).long())

    with pytest.raises(LaunchError, match="rank 0 runs the first piece: pass inputs"):
        launch(without_inputs, nprocs=2, backend="gloo", timeout=10, join_timeout=60)

    def two_pieces_on_one_rank():
        return pp.interleaved_1f1b_step([nn.Identity(), nn.Identity()], 2,
                                        inputs=torch.zeros(4, 2), targets=torch.zeros(4))

    with pytest.raises(LaunchError, match="interleaving needs at least 2 ranks"):
        launch(two_pieces_on_one_rank, nprocs=1, backend="gloo", timeout=10, join_timeout=60)


# ----------------------------------------------------------- the measurements

SMALL = {"batch_size": 8, "channels": 8, "depth": 4, "image_size": 8}


def test_compare_schedules_times_every_piece_and_reports_the_theory():
    result = gpipe.compare_schedules((2, 4), ranks=2, steps=2, **SMALL)
    assert len(result["settings"]["cuts"]["interleaved"]) == 3   # 4 pieces on 2 ranks
    assert len(result["settings"]["cuts"]["1f1b"]) == len(result["settings"]["cuts"]["gpipe"]) == 1
    for name, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for m in (2, 4):
            row = result[name][m]
            assert len(row["runs"]) == len(row["bubbles"]) == 2 and row["seconds"] > 0
            assert row["bubble"] in row["bubbles"]
            pieces = range(2 * virtual)
            assert sorted((e.virtual_stage if virtual > 1 else e.rank, e.kind, e.micro_batch)
                          for e in row["events"]) == sorted(
                (piece, kind, i) for piece in pieces for kind in ("forward", "backward")
                for i in range(m))
            assert min(pp.input_waits(row["events"])) > 0  # each pass after its input
            assert len(row["bubbles_instant_transfers"]) == 2
            assert all(0 <= bubble < 1 for bubble in row["bubbles_instant_transfers"])
            assert row["theoretical_bubble"] == pytest.approx(1 / (virtual * m + 1))
            assert row["theoretical_bubble_to_compute"] == pytest.approx(1 / (virtual * m))
            assert row["bubble_to_compute"] == pytest.approx(row["bubble"] / (1 - row["bubble"]))


def test_compare_schedules_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="3 micro-batches is not a multiple of 2"):
        gpipe.compare_schedules((3,), **{**SMALL, "batch_size": 12})
    with pytest.raises(ValueError, match=r"unknown schedules \['zero-bubble'\]"):
        gpipe.compare_schedules((2,), schedules=("gpipe", "zero-bubble"), **SMALL)


def test_measure_overlap_rounds_stores_every_round_of_both_transfers():
    result = gpipe.measure_overlap_rounds((2, 4), rounds=2, steps=1, **SMALL)
    assert result["settings"]["rounds"] == 2 and len(result["rounds"]) == 2
    for row in result["rounds"]:
        for m in (2, 4):
            assert len(row[m]["overlapped_runs"]) == len(row[m]["blocking_runs"]) == 1
            assert row[m]["overlapped"] > 0 and row[m]["blocking"] > 0
    for m in (2, 4):
        slower = sum(row[m]["blocking"] > row[m]["overlapped"] for row in result["rounds"])
        assert result["summary"][m]["blocking_slower_in"] == slower
        ratios = sorted(row[m]["blocking"] / row[m]["overlapped"] for row in result["rounds"])
        assert result["summary"][m]["median_ratio"] == pytest.approx(sum(ratios) / 2)
    with pytest.raises(ValueError, match="rounds must be a whole number >= 1, got 0"):
        gpipe.measure_overlap_rounds(rounds=0)


def test_profiled_timeline_notes_cpu_time_and_page_faults_per_event():
    timeline = gpipe.ProfiledTimeline(rank=0)
    with timeline.record("forward", 0):
        torch.ones(1 << 20).sum()  # 4 MiB, touched
    with timeline.record("backward", 0, virtual_stage=2):
        pass
    assert [(e.kind, e.virtual_stage) for e in timeline.events] == [("forward", None),
                                                                    ("backward", 2)]
    (cpu, faults), _ = timeline.profile
    assert cpu > 0 and faults >= 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("keep_memory", [False, True])
def test_first_backward_costs_compare_the_first_backward_with_the_others(keep_memory):
    result = gpipe.first_backward_costs(4, steps=2, keep_memory=keep_memory, **SMALL)
    assert result["settings"]["keep_memory"] is keep_memory
    assert len(result["ranks"]) == 2
    assert 0 < result["gradient_gap_min_ms"] <= result["gradient_gap_ms"]
    for costs in result["ranks"]:
        for key in ("first_backward", "other_backwards", "forwards", "process_first_backward"):
            assert set(costs[key]) == {"wall_ms", "cpu_ms", "page_faults"}
            assert costs[key]["wall_ms"] > 0 and costs[key]["page_faults"] >= 0
        assert costs["first_to_other"] == pytest.approx(
            costs["first_backward"]["wall_ms"] / costs["other_backwards"]["wall_ms"])
    with pytest.raises(ValueError, match="use at least 2 micro-batches"):
        gpipe.first_backward_costs(1, **SMALL)
