"""Pipeline pieces: splitting, costs and balanced cuts, the messages' tags, the GPipe step,
the timeline; and the old module that still re-exports them."""

import matplotlib
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mgpu_helpers import LaunchError, launch, rank, world_size
from mgpu_helpers.labs import gpipe
from mgpu_helpers.measure.memory import ActivationMeter
from mgpu_helpers.parallel import pipeline as pp
from mgpu_helpers.viz.plots import plot_timeline

matplotlib.use("Agg")
pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def mlp(depth=6, width=16, classes=4):
    torch.manual_seed(0)
    layers = [nn.Linear(8, width), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def batch(n=24):
    generator = torch.Generator().manual_seed(3)
    return torch.randn(n, 8, generator=generator), torch.randint(0, 4, (n,), generator=generator)


# ----------------------------------------------------------------- splitting


def test_split_sequential_cuts_before_the_given_layers_and_shares_them():
    model = mlp()
    first, second, third = pp.split_sequential(model, [3, 7])
    assert (len(first), len(second), len(third)) == (3, 4, len(model) - 7)
    assert first[0] is model[0] and third[-1] is model[-1]
    x, _ = batch()
    torch.testing.assert_close(third(second(first(x))), model(x))


@pytest.mark.parametrize(("cuts", "message"), [
    ([0], "split point 0 is out of range: a model of 13 layers can be cut before layer 1 to 12"),
    ([13], "split point 13 is out of range"),
    ([2.5], "split point 2.5 is out of range"),
    ([5, 3], "must be increasing and distinct"),
    ([3, 3], "must be increasing and distinct"),
])
def test_bad_split_points_are_named(cuts, message):
    with pytest.raises(ValueError, match=message):
        pp.split_sequential(mlp(), cuts)


def test_only_sequential_models_are_split():
    with pytest.raises(TypeError, match="needs an nn.Sequential, got Linear"):
        pp.split_sequential(nn.Linear(2, 2), [1])


def test_micro_batch_count_must_divide_the_batch():
    assert pp.micro_batch_size(24, 4) == 6
    with pytest.raises(ValueError, match=r"5 micro-batches do not divide the batch of 24 "
                                         r"samples: use one of \[1, 2, 3, 4, 6, 8, 12, 24\]"):
        pp.micro_batch_size(24, 5)
    with pytest.raises(ValueError, match="whole number >= 1"):
        pp.micro_batch_size(24, 0)


def test_split_batch_gives_each_rank_the_micro_batches_it_uses():
    x, y = batch()
    inputs, targets = pp.split_batch(x, y, 4, rank=0, ranks=2)
    assert targets is None and [len(chunk) for chunk in inputs] == [6] * 4
    torch.testing.assert_close(torch.cat(inputs), x)
    inputs, targets = pp.split_batch(None, y, 4, rank=1, ranks=2)
    assert inputs is None and [len(chunk) for chunk in targets] == [6] * 4
    assert pp.split_batch(None, None, 4, rank=1, ranks=3) == (None, None)  # a middle rank
    inputs, targets = pp.split_batch(x, y, 3, rank=0, ranks=1)  # one rank: both
    assert len(inputs) == len(targets) == 3


@pytest.mark.parametrize(("args", "message"), [
    ((None, None, 4, 0, 2), "rank 0 runs the first piece: pass inputs"),
    ((None, None, 4, 2, 3), "rank 2 runs the last piece: pass targets"),
    ((batch()[0], None, 5, 0, 2), "5 micro-batches do not divide the batch of 24 samples"),
    ((None, batch()[1], 0, 1, 2), "micro-batch count must be a whole number >= 1, got 0"),
])
def test_split_batch_names_what_is_missing_or_wrong(args, message):
    with pytest.raises(ValueError, match=message):
        pp.split_batch(*args)


# ----------------------------------------------------------------- messages


def test_message_tags_are_distinct_per_cut_and_kind_and_keep_their_numbers():
    kinds = ("header", "activation", "gradient")
    tags = {(cut, kind): pp.message_tag(cut, kind) for cut in range(5) for kind in kinds}
    assert len(set(tags.values())) == len(tags)
    # the numbers on the wire: three per cut, in this order
    assert all(tag == 3 * cut + kinds.index(kind) for (cut, kind), tag in tags.items())
    with pytest.raises(ValueError, match="message kind must be one of"):
        pp.message_tag(0, "loss")
    with pytest.raises(ValueError, match="cut must be a whole number >= 0"):
        pp.message_tag(-1, "header")


# --------------------------------------------------------- costs and cuts


def test_layer_costs_count_parameters_flops_and_activations():
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    costs = pp.layer_costs(model, torch.randn(10, 8), repeats=1)
    assert [c.parameters for c in costs] == [8 * 32 + 32, 0, 32 * 4 + 4]
    assert [c.flops for c in costs] == [2 * 10 * 8 * 32, 0, 2 * 10 * 32 * 4]
    assert [c.activation_bytes for c in costs] == [10 * 32 * 4, 10 * 32 * 4, 10 * 4 * 4]
    assert all(c.seconds > 0 for c in costs)


@pytest.mark.parametrize(("weights", "stages", "cuts"), [
    ([1, 1, 1, 1], 2, [2]),
    ([4, 1, 1, 1, 1], 2, [1]),
    ([1, 1, 1, 1, 1, 1], 3, [2, 4]),
    ([1, 5, 1, 1, 1, 1, 1], 3, [1, 2]),
    ([3, 3], 1, []),
])
def test_balanced_cuts_minimise_the_heaviest_stage(weights, stages, cuts):
    assert pp.balanced_cuts(weights, stages) == cuts


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 stages"):
        pp.balanced_cuts([1, 1], 3)


# --------------------------------------------------------------- the step


def unsplit_reference():
    model = mlp()
    x, y = batch()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def pipelined(micro_batches, cuts, overlap=True):
    model = mlp()
    stage_module = pp.split_sequential(model, cuts)[rank()]
    x, y = batch()
    timeline = pp.Timeline(rank())
    loss = pp.gpipe_step(stage_module, micro_batches, inputs=x if rank() == 0 else None,
                         targets=y if rank() == world_size() - 1 else None,
                         timeline=timeline, overlap=overlap)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()
             if p.grad is not None}
    return loss, grads, timeline.events


@pytest.mark.parametrize(("micro_batches", "cuts", "overlap"), [
    (1, [7], True), (4, [7], True), (3, [4, 9], True), (4, [7], False), (2, [4, 9], False)])
def test_pipelined_gradients_equal_the_unsplit_models(micro_batches, cuts, overlap):
    expected_loss, expected_grads = unsplit_reference()
    names = [name for name, _ in mlp().named_parameters()]
    ranks = launch(pipelined, micro_batches, cuts, overlap, nprocs=len(cuts) + 1,
                   return_all=True, join_timeout=120)
    grads = {}
    for loss, rank_grads, events in ranks:
        assert loss == pytest.approx(expected_loss, rel=1e-6)   # every rank gets the loss
        assert sorted((e.kind, e.micro_batch) for e in events) == sorted(
            (kind, m) for kind in ("forward", "backward") for m in range(micro_batches))
        grads.update(rank_grads)
    assert sorted(grads) == sorted(names)                      # every parameter, once
    for name, expected in zip(names, expected_grads, strict=True):
        torch.testing.assert_close(grads[name], expected, rtol=1e-5, atol=1e-7)


def test_a_micro_batch_count_that_does_not_divide_the_batch_fails_clearly():
    with pytest.raises(LaunchError, match="5 micro-batches do not divide the batch of 24"):
        launch(pipelined, 5, [7], nprocs=2, timeout=10, join_timeout=60)


def test_measure_gpipe_reports_speedups_bubbles_and_a_balanced_cut():
    result = gpipe.measure_gpipe((2, 4), batch_size=8, channels=8, depth=3, image_size=8,
                              steps=1)
    assert sorted(key for key in result if key != "settings") == [1, 2, 4]  # M = 1 added
    assert result["settings"]["cuts"] == [4]  # conv1 (3->8) is light: 2 convs | 1 conv + head
    assert result[1]["speedup"] == 1.0
    for m in (1, 2, 4):
        assert result[m]["seconds"] > 0 and 0 <= result[m]["bubble"] < 1
        assert result[m]["ideal_speedup"] == pytest.approx(pp.ideal_speedup(2, m))
        assert len(result[m]["events"]) == 2 * 2 * m  # 2 ranks x forward/backward x M
        assert min(pp.input_waits(result[m]["events"])) > 0  # each pass after its input
        assert len(result[m]["bubbles"]) == 1 and result[m]["bubble"] == result[m]["bubbles"][0]
        assert 0 <= result[m]["bubble_instant_transfers"] < 1


# --------------------------------------------------------------- timeline


def test_bubble_fraction_and_theory():
    events = [pp.Event(0, "forward", 0, 0.0, 1.0), pp.Event(1, "forward", 0, 1.0, 2.0)]
    assert pp.bubble_fraction(events) == pytest.approx(0.5)   # each rank idle half the time
    assert pp.theoretical_bubble(2, 1) == pytest.approx(0.5)
    assert pp.theoretical_bubble(4, 13) == pytest.approx(3 / 16)
    assert pp.ideal_speedup(2, 8) == pytest.approx(16 / 9)
    with pytest.raises(ValueError, match="no events recorded"):
        pp.bubble_fraction([])


def test_timeline_records_and_plots():
    timeline = pp.Timeline(rank=1)
    with timeline.record("forward", 3):
        sum(range(1000))
    (event,) = timeline.events
    assert (event.rank, event.kind, event.micro_batch) == (1, "forward", 3)
    assert event.end >= event.start
    ax = plot_timeline(timeline.events + [pp.Event(0, "backward", 3, event.end,
                                                   event.end + 0.001)])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1"]


# ------------------------------------------------------ torch.distributed.pipelining


def library_pipeline(schedule_name, micro_batches):
    from torch.distributed import pipelining

    model = mlp()
    stage_module = pp.split_sequential(model, [7])[rank()]
    stage = pipelining.PipelineStage(stage_module, rank(), world_size(), torch.device("cpu"))
    schedule_type = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}
    schedule = schedule_type[schedule_name](stage, n_microbatches=micro_batches,
                                            loss_fn=F.cross_entropy)
    x, y = batch()
    losses = []
    if rank() == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()
             if p.grad is not None}
    return [loss.item() for loss in losses], grads


def every_library_schedule(images, labels):
    """In one group, each of torch.distributed.pipelining's schedules in turn: GPipe and
    1F1B on the MLP (one stage per rank), then the three with two virtual stages per rank
    on the tutorial CNN."""
    plain = {name: library_pipeline(name, 4) for name in ("gpipe", "1f1b")}
    virtual = {name: gpipe.interleaved_step(images, labels, [2, 4, 7], 4, 0, name)
               for name in gpipe.LIBRARY_SCHEDULES}
    return plain, virtual


@pytest.fixture(scope="module")
def library_schedules():
    """One launch of 2 ranks for every library schedule (a launch each cost seconds)."""
    torch.manual_seed(0)
    images, labels = torch.rand(16, 3, 32, 32), torch.randint(0, 10, (16,))
    ranks = launch(every_library_schedule, images, labels, nprocs=2, backend="gloo",
                   return_all=True, timeout=60, join_timeout=240)
    return images, labels, ranks


@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b"])
def test_torch_pipelining_schedules_match_the_unsplit_model(library_schedules,
                                                            schedule_name):
    expected_loss, expected_grads = unsplit_reference()
    names = [name for name, _ in mlp().named_parameters()]
    ranks = [plain[schedule_name] for plain, _ in library_schedules[2]]
    losses = ranks[1][0]
    assert len(losses) == 4
    assert sum(losses) / 4 == pytest.approx(expected_loss, rel=1e-6)
    grads = {**ranks[0][1], **ranks[1][1]}
    for name, expected in zip(names, expected_grads, strict=True):
        torch.testing.assert_close(grads[name], expected, rtol=1e-5, atol=1e-7)


def test_activation_meter_counts_saved_activations_until_backward_frees_them():
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    with ActivationMeter(exclude=model.parameters()) as meter:
        first = model(torch.randn(10, 8)).sum()
        after_one = meter.current
        second = model(torch.randn(10, 8)).sum()
        assert meter.current == 2 * after_one > 0   # two micro-batches held at once
        first.backward()
        second.backward()
    assert meter.current == 0 and meter.peak == 2 * after_one
    # Linear 1 saves its input (10x8 floats), ReLU its output (10x32), which Linear 2
    # saves too (counted once); the weights are not counted
    assert after_one == 4 * (10 * 8 + 10 * 32)


@pytest.mark.parametrize("schedule", gpipe.LIBRARY_SCHEDULES)
def test_library_schedules_with_two_virtual_stages_per_rank_give_the_unsplit_gradients(
        library_schedules, schedule):
    from mgpu_helpers.models import SeedCNN

    images, labels, launched = library_schedules
    ranks = [virtual[schedule] for _, virtual in launched]
    torch.manual_seed(0)
    model = SeedCNN()
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    merged = {name: grad for _, grads in ranks for name, grad in grads.items()}
    assert sorted(merged) == sorted(name for name, _ in model.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(merged[name], parameter.grad, rtol=1e-4, atol=1e-6)
    assert all(abs(rank_loss - loss.item()) < 1e-5 for rank_loss, _ in ranks)


@pytest.mark.usefixtures("no_leftover_processes")
def test_zero_bubble_cannot_split_the_backward_of_a_piece_that_returns_a_view():
    # cut right after flatten: piece 2's output is a view, which the split backward
    # (input gradient now, weight gradient later) tries to detach in place
    images, labels = torch.rand(8, 3, 32, 32), torch.randint(0, 10, (8,))
    with pytest.raises(LaunchError, match="Can't detach views in-place"):
        launch(gpipe.interleaved_step, images, labels, [2, 4, 6], 4, 0, "ZBVZeroBubble",
               nprocs=2, backend="gloo")


def test_interleaving_needs_two_stages_per_rank():
    def one_rank_three_cuts():
        return gpipe.interleaved_step(torch.rand(4, 3, 32, 32), torch.zeros(4).long(),
                                      [2, 4, 6], 4)

    with pytest.raises(LaunchError, match="1 ranks with 2 virtual stages each need 1 cuts"):
        launch(one_rank_three_cuts, nprocs=1, backend="gloo")

    def unknown_schedule():
        return gpipe.interleaved_step(torch.rand(4, 3, 32, 32), torch.zeros(4).long(), [2],
                                      4, 0, "DualPipe")

    with pytest.raises(LaunchError, match="schedule must be one of"):
        launch(unknown_schedule, nprocs=1, backend="gloo")


@pytest.mark.parametrize("step", ["gpipe_step", "interleaved_1f1b_step"])
def test_the_from_scratch_steps_refuse_a_stage_module_that_is_not_on_the_cpu(step):
    stage_module = mlp().to("meta")  # stands in for a GPU stage: any device but the CPU
    run = getattr(pp, step)
    with pytest.raises(ValueError, match=r"parameter '0.weight' is on meta; for GPU stages "
                                         r"use torch.distributed.pipelining"):
        run(stage_module if step == "gpipe_step" else [stage_module], 2, *batch())
