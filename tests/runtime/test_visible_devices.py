"""CUDA_VISIBLE_DEVICES is read the way CUDA reads it, malformed values included."""

import pytest

from mgpu_helpers.runtime.visible_devices import parse_cuda_visible_devices


@pytest.mark.parametrize(
    ("raw", "entries"),
    [
        (None, None),
        ("", ()),
        ("   ", ()),
        ("0", (0,)),
        ("1,0", (1, 0)),
        (" 2 , 3 ", (2, 3)),
        ("0,,1", (0,)),
        ("abc", ()),
        ("-1", ()),
        ("0,-1,2", (0,)),
        ("0,0", ()),
        ("1,2,1", ()),
        ("1gpu,2", (1, 2)),
        ("+1", (1,)),
        ("GPU-aaaa,GPU-bbbb", ("GPU-aaaa", "GPU-bbbb")),
        ("GPU-aaaa,1", ("GPU-aaaa",)),
        ("MIG-x,MIG-x", ()),
    ],
)
def test_entries_follow_cuda_rules(raw, entries):
    assert parse_cuda_visible_devices(raw).entries == entries


def test_unset_means_every_gpu():
    visible = parse_cuda_visible_devices(None)
    assert visible.meaning == "every GPU is visible"
    assert visible.problem is None
    assert visible.visible_count(4) == 4


def test_empty_entry_stops_parsing_and_says_what_is_ignored():
    visible = parse_cuda_visible_devices("0,,1")
    assert "GPU 0 visible, as cuda:0" in visible.meaning
    assert "entry 2 is empty" in visible.meaning
    assert "'1' is ignored" in visible.meaning
    assert visible.problem == "entry 2 is empty"


def test_garbage_hides_every_gpu_and_names_the_entry():
    visible = parse_cuda_visible_devices("abc")
    assert visible.hides_all
    assert "no GPU is visible" in visible.meaning
    assert "'abc'" in visible.meaning
    assert visible.problem is not None


def test_minus_one_is_the_idiom_for_hiding_gpus_not_a_problem():
    visible = parse_cuda_visible_devices("-1")
    assert visible.hides_all
    assert "'-1' is the usual way to hide every GPU" in visible.meaning
    assert visible.problem is None


def test_repeated_device_hides_everything():
    visible = parse_cuda_visible_devices("1,2,1")
    assert visible.hides_all
    assert "GPU 1 is listed twice" in visible.meaning


def test_leading_digits_are_read_and_flagged():
    visible = parse_cuda_visible_devices("1gpu")
    assert visible.entries == (1,)
    assert "read as 1" in visible.problem


def test_renumbering_is_explained():
    assert parse_cuda_visible_devices("2,3").meaning == "GPUs 2, 3 visible, as cuda:0, cuda:1"


@pytest.mark.parametrize(
    ("raw", "physical", "count"),
    [(None, 0, 0), (None, 8, 8), ("0,1", 0, 0), ("0,1", 1, 1), ("0,5,1", 2, 1),
     ("3", 2, 0), ("-1", 4, 0), ("GPU-a,GPU-b", 1, 1)],
)
def test_visible_count_stops_at_missing_device(raw, physical, count):
    assert parse_cuda_visible_devices(raw).visible_count(physical) == count


def test_negative_physical_count_is_rejected():
    with pytest.raises(ValueError, match="physical GPU count"):
        parse_cuda_visible_devices("0").visible_count(-1)


def test_reads_current_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert parse_cuda_visible_devices(from_env=True).entries == (3,)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert parse_cuda_visible_devices(from_env=True).entries is None
