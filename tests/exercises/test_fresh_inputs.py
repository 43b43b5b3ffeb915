"""Exercise inputs drawn afresh on every check (DESIGN.md §5b): an answer copied from one
check fails the next. Each "copied answer" below records what the trial expected on one
check (what a failure message shows, or what running the checker's own trial reveals),
recognises the case by its inputs the way a copier would, and replays it: it would pass
if the inputs were the same on every run. The replays are module-level functions (bound
to their table with functools.partial) so that the ranks of a distributed case get them
however they are started."""

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist

from mgpu_helpers import exercises
from mgpu_helpers.exercises import core
from solutions import ch01, ch02, ch04, ch07, ch08, ch09

pytestmark = pytest.mark.usefixtures("no_leftover_processes")



@pytest.fixture(autouse=True)
def private_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("MGPU_EXERCISE_PROGRESS", str(tmp_path / "progress.json"))


def only(key, keep=lambda case: True):
    exercise = exercises.get(key)
    return dataclasses.replace(exercise, cases=[c for c in exercise.cases if keep(c)])


def expected_by_case(exercise, right):
    """One check of ``right`` (the reference), with a judge that records what the trial
    expected: {case label: [expected, one per rank (one in this process)]}."""
    found = {}
    for case in exercise.cases:
        seen = []
        single = dataclasses.replace(exercise, cases=[case],
                                     judge=lambda got, expected, seen=seen: seen.append(expected))
        assert core.evaluate(single, right).passed
        found[case.label] = seen
    return found


def statuses(report):
    return {o.case.label: o.status for o in report.outcomes}


def drawn(case):
    return "drawn afresh" in case.label


# ---------------------------------------------------------------- in this process

def test_01_1_copied_statistics_fail_the_next_check():
    exercise = only("01.1")
    recorded = expected_by_case(exercise, ch01.channel_stats)
    table = {(len(sizes), channels): recorded[case.label][0]
             for case in exercise.cases for sizes, channels in [case.args]}

    def copied(dataset):
        return table[len(dataset), dataset[0][0].shape[0]]

    report = core.evaluate(exercise, copied)
    assert set(statuses(report).values()) == {"fail"}, "\n".join(report.lines())
    assert "channel 0: expected mean" in report.outcomes[0].detail


def test_02_1_copied_shuffled_indices_fail_the_next_check():
    # the shuffled cases: their seed is drawn afresh (unshuffled, the order is the
    # dataset's, a closed form of n and world_size); of 10 samples or more, since 3
    # samples have 6 orders, and a copied one matches the next draw 1 time in 6
    exercise = only("02.1", lambda case: case.args[4] and case.args[0] >= 10)
    recorded = expected_by_case(exercise, ch02.sampler_indices)
    table = {(n, world, shuffle, drop_last): recorded[case.label][0]
             for case in exercise.cases
             for n, world, _, _, shuffle, drop_last in [case.args]}

    def copied(n, world_size, rank, epoch, seed, shuffle, drop_last):
        return table[n, world_size, shuffle, drop_last][epoch, rank]

    report = core.evaluate(exercise, copied)
    assert len(exercise.cases) >= 3
    assert set(statuses(report).values()) == {"fail"}, "\n".join(report.lines())


def test_04_1_copied_gradients_fail_the_next_check():
    exercise = only("04.1")

    def recognised(model, replicas):  # what a copier can tell the cases by
        return (type(model).__name__, hasattr(model, "frozen"), len(replicas),
                any(p.grad is not None for p in model.parameters()))

    keys = []  # one per case, in the cases' order

    def recording(model, replicas):
        keys.append(recognised(model, replicas))
        ch04.add_replica_grads(model, replicas)

    recorded = expected_by_case(exercise, recording)
    table = {key: recorded[case.label][0]["grads"]
             for key, case in zip(keys, exercise.cases, strict=True)}

    def copied(model, replicas):
        grads = table[recognised(model, replicas)]
        for name, param in model.named_parameters():
            param.grad = None if grads[name] is None else grads[name].clone()

    report = core.evaluate(exercise, copied)
    assert set(statuses(report).values()) == {"fail"}, "\n".join(report.lines())
    assert "values differ" in report.outcomes[0].detail


@pytest.mark.parametrize(("key", "right"), [("04.2", ch04.chunk_sizes),
                                            ("07.2", ch07.largest_models),
                                            ("08.2", ch08.batch_plan)])
def test_closed_forms_have_a_case_drawn_afresh_that_a_table_of_copied_answers_fails(
        key, right, monkeypatch):
    """A table of every fixed case's answer passes those; the case whose sizes are drawn
    afresh on each check is not in it."""
    import random

    # two checks, two known draws (os.urandom's would differ, but might coincide)
    seeds = iter(range(1, 100))
    monkeypatch.setattr(random, "SystemRandom", lambda: random.Random(next(seeds)))
    exercise = only(key)
    table = {}

    def recording(*args):  # what each case's failure message shows
        try:
            table[args] = right(*args)
        except ValueError as error:  # 08.2's global batches the ranks cannot share
            table[args] = error
            raise
        return table[args]

    assert core.evaluate(exercise, recording).passed
    last = table[next(reversed(table))]

    def copied(*args):
        answer = table.get(args, last)
        if isinstance(answer, ValueError):
            raise answer
        return answer

    report = core.evaluate(exercise, copied)
    assert [drawn(case) for case in exercise.cases].count(True) == 1
    assert {label: status for label, status in statuses(report).items()} == {
        case.label: "fail" if drawn(case) else "pass" for case in exercise.cases}, (
        "\n".join(report.lines()))


def test_08_1_a_copied_state_fails_the_next_check():
    exercise = only("08.1")
    (expected,) = expected_by_case(only("08.1", lambda c: c.args == ("first save",)),
                                   ch08.save_atomically)["first save"]

    def copied(state, path):  # saves atomically, but the state it saw on the first check
        ch08.save_atomically(state if "broken" in state else expected["state"], path)

    report = core.evaluate(exercise, copied)
    assert statuses(report) == {"first save": "fail", "replacing a checkpoint": "fail",
                                "a save that fails": "pass"}, "\n".join(report.lines())
    assert "checkpoint.pt holds step" in report.outcomes[0].detail


# ---------------------------------------------------------------- on ranks

def accuracy_copied(table, correct_shard, dataset_size):
    return table[dist.get_world_size(), dataset_size]


def mean_loss_copied(table, local_losses):
    return table[dist.get_world_size(), len(local_losses)]


def metrics_copied(table, metrics):
    return dict(table[dist.get_world_size()])


def uneven_copied(table, model, optimizer, batches):
    with torch.no_grad():
        weights = table[dist.get_world_size(), dist.get_rank(), len(batches)]
        for param, weight in zip(model.module.parameters(), weights, strict=True):
            param.copy_(weight)


class _Zero1Copied:
    """ZeRO-1's memory (Adam's state for one rank's share, kept on copies of those
    parameters), and no communication: after each step, the weights of a recorded run."""

    def __init__(self, params, lr, weights):
        self.params, self.weights = list(params), weights
        rank, world = dist.get_rank(), dist.get_world_size()
        self.mine = [p for k, p in enumerate(self.params) if k % world == rank]
        self.copies = [p.detach().clone().requires_grad_() for p in self.mine]
        self.adam = torch.optim.Adam(self.copies, lr=lr)

    def step(self):
        for copy, param in zip(self.copies, self.mine, strict=True):
            copy.grad = param.grad
        self.adam.step()
        with torch.no_grad():
            for param, weight in zip(self.params, self.weights, strict=True):
                param.copy_(weight)


def zero1_copied(table, params, lr):
    return _Zero1Copied(params, lr, table[dist.get_world_size()])


class _Replayed(torch.autograd.Function):
    """The recorded output, and in backward the recorded gradients, with the one
    all-reduce the check counts in each direction."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, recorded):
        dist.all_reduce(torch.zeros_like(recorded["out"]))
        ctx.recorded = recorded
        return recorded["out"].clone()

    @staticmethod
    def backward(ctx, grad):
        recorded = ctx.recorded
        dist.all_reduce(torch.zeros_like(recorded["x"]))
        return (recorded["x"].clone(), *(g.clone() for g in recorded["gradients"]), None)


def tp_copied(table, x, w1, b1, w2, b2):
    return _Replayed.apply(x, w1, b1, w2, b2, table[dist.get_world_size(), dist.get_rank()])


def two_ranks(case):
    return case.world == 2


def replayed_on_ranks(key, right, keep, build, replay):
    """The report of a check of ``key``'s cases that ``keep`` accepts by ``replay``, bound
    to the table ``build(table, case, expected per rank)`` filled from one check of
    ``right``."""
    exercise = only(key, keep)
    recorded = expected_by_case(exercise, right)
    table = {}
    for case in exercise.cases:
        build(table, case, recorded[case.label])
    return core.evaluate(exercise, functools.partial(replay, table))


@pytest.mark.slow  # checks on launched ranks, twice: out of `make check`
def test_02_3_a_copied_accuracy_fails_the_next_check():
    # an accuracy of n samples takes one of n + 1 values, so a copied one is right again
    # by chance in about 1 case of 6 (binomial draws of 7 to 12 samples): over all 5 cases
    # the copy fails the check, but for about 1 run in 5,000
    def build(table, case, per_rank):
        right, n = per_rank[0]
        table[case.world, n] = right / n

    report = replayed_on_ranks("02.3", ch02.exact_accuracy, lambda c: True, build,
                               accuracy_copied)
    assert not report.passed, "\n".join(report.lines())
    assert any("samples correct), got" in o.detail for o in report.outcomes)


@pytest.mark.slow  # checks on launched ranks, twice: out of `make check`
def test_07_1_weights_copied_from_an_earlier_run_fail_the_next_check():
    def build(table, case, per_rank):
        table[case.world] = per_rank[0]["weights"]

    report = replayed_on_ranks("07.1", ch07.zero1_adam, two_ranks, build, zero1_copied)
    assert set(statuses(report).values()) == {"fail"}, "\n".join(report.lines())
    assert "differ from plain Adam's" in report.outcomes[0].detail


@pytest.mark.slow  # checks on launched ranks, twice: out of `make check`
def test_07_3_a_copied_output_and_gradients_fail_the_next_check():
    def build(table, case, per_rank):
        for rank, expected in enumerate(per_rank):
            table[case.world, rank] = expected

    report = replayed_on_ranks("07.3", ch07.tp_feed_forward,
                               lambda c: two_ranks(c) and c.args == (True,), build, tp_copied)
    assert set(statuses(report).values()) == {"fail"}, "\n".join(report.lines())
    assert "the output differs" in report.outcomes[0].detail


@pytest.mark.slow  # checks on launched ranks, twice: out of `make check`
def test_09_2_copied_averages_fail_the_next_check():
    def build(table, case, per_rank):
        table[case.world] = per_rank[0]

    report = replayed_on_ranks("09.2", ch09.average_metrics,
                               lambda c: two_ranks(c) and not c.args[0], build, metrics_copied)
    assert set(statuses(report).values()) == {"fail"}, "\n".join(report.lines())
    assert "averages over the ranks" in report.outcomes[0].detail


@pytest.mark.slow  # checks on launched ranks, twice: out of `make check`
def test_09_3_copied_weights_fail_the_next_check():
    def build(table, case, per_rank):
        (counts,) = case.args
        for rank, expected in enumerate(per_rank):
            table[case.world, rank, counts[rank]] = expected["weights"]

    report = replayed_on_ranks("09.3", ch09.train_on_uneven_batches, two_ranks, build,
                               uneven_copied)
    assert set(statuses(report).values()) == {"fail"}, "\n".join(report.lines())
    assert "the weights differ" in report.outcomes[0].detail


@pytest.mark.slow  # checks on launched ranks, twice: out of `make check`
def test_09_1_two_checks_draw_different_losses_that_the_ranks_agree_on():
    """A copied mean fails the next check: that check drew other losses, and every rank
    drew the same ones (each rank's expected mean is over all ranks' losses)."""
    exercise = only("09.1", two_ranks)
    (case,) = exercise.cases
    first = expected_by_case(exercise, ch09.epoch_mean_loss)[case.label]
    seen = []

    def judge(got, expected):
        seen.append(expected)
        return exercise.judge(got, expected)

    (counts,) = case.args
    table = {(case.world, count): mean for count, mean in zip(counts, first, strict=True)}
    report = core.evaluate(dataclasses.replace(exercise, judge=judge),
                           functools.partial(mean_loss_copied, table))
    assert set(statuses(report).values()) == {"fail"}, "\n".join(report.lines())
    assert "expected the mean loss" in report.outcomes[0].detail
    assert len(set(first)) == 1 and len(set(seen)) == 1  # the ranks agreed
    assert first[0] != seen[0]  # the two checks did not

