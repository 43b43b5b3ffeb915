"""Chapter 05's scaling-rule demonstration (mgpu_helpers.labs.scaling_rule)."""

import pytest
import torch

from mgpu_helpers.labs import scaling_rule
from mgpu_helpers.labs.scaling_rule import Rule


@pytest.fixture(scope="module")
def data():
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(128, 3, 32, 32, generator=generator)
    labels = (images[:, 0].mean((1, 2)) > 0).long()  # learnable: the first channel's sign
    return images, labels, images[:32], labels[:32]


def test_a_curve_has_one_point_per_evaluation_and_is_repeatable(data):
    curve = scaling_rule.train_curve(data, Rule(2), per_rank_batch=8, epochs=2,
                                     evaluations_per_epoch=4)
    assert curve["batch"] == 16 and len(curve["accuracy"]) == 8
    assert curve["steps"] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert curve["epochs"][-1] == pytest.approx(2.0)
    assert curve == scaling_rule.train_curve(data, Rule(2), per_rank_batch=8, epochs=2,
                                             evaluations_per_epoch=4)


def test_the_linear_rule_warms_up_to_n_times_the_rate(data):
    warm = scaling_rule.train_curve(data, Rule(4, True, 1.0), per_rank_batch=4, epochs=2,
                                    base_lr=0.01, evaluations_per_epoch=4)
    assert warm["lr"][0] < 0.04 and warm["lr"][-1] == pytest.approx(0.04)
    assert warm["lr"] == sorted(warm["lr"])
    same = scaling_rule.train_curve(data, Rule(4), per_rank_batch=4, epochs=1,
                                    base_lr=0.01, evaluations_per_epoch=4)
    assert set(same["lr"]) == {0.01}


def test_labels_say_what_changed():
    assert Rule(1).label == "1 rank"
    assert Rule(4).label == "4 ranks, same learning rate"
    assert Rule(4, True, 0.25).label == "4 ranks, 4x learning rate, 0.25-epoch warm-up"
    assert Rule(2, True).label == "2 ranks, 2x learning rate, no warm-up"


def test_mean_curve_averages_seeds_and_steps_to_reach(data):
    runs = [scaling_rule.train_curve(data, Rule(1), per_rank_batch=16, epochs=1, seed=s)
            for s in (0, 1)]
    mean = scaling_rule.mean_curve(data, Rule(1), seeds=(0, 1), per_rank_batch=16, epochs=1)
    assert mean["accuracy"] == pytest.approx(
        [(a + b) / 2 for a, b in zip(runs[0]["accuracy"], runs[1]["accuracy"], strict=True)])
    assert scaling_rule.steps_to_reach(mean, 0.0) == mean["steps"][0]
    assert scaling_rule.steps_to_reach(mean, 1.01) is None


def test_bad_settings_are_refused(data):
    with pytest.raises(ValueError, match="at least 1"):
        scaling_rule.train_curve(data, Rule(0))
    with pytest.raises(ValueError, match="fewer than 4 evaluations"):
        scaling_rule.train_curve(data, Rule(4), per_rank_batch=16)  # 2 steps per epoch
    with pytest.raises(ValueError, match="at least one seed"):
        scaling_rule.mean_curve(data, Rule(1), seeds=())
