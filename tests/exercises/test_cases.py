"""Wrong or cheating solutions that an exercise's cases once let pass (issue 32): each must
fail now, with a message that names what is wrong. The solutions are module-level
functions, so that the spawned ranks of a distributed case can import them."""

import dataclasses
import math
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mgpu_helpers import exercises
from mgpu_helpers.exercises import core

pytestmark = pytest.mark.usefixtures("no_leftover_processes")



@pytest.fixture(autouse=True)
def private_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("MGPU_EXERCISE_PROGRESS", str(tmp_path / "progress.json"))


def only(key, keep):
    """Exercise ``key`` with the cases ``keep(case)`` accepts: the edge a test is about."""
    exercise = exercises.get(key)
    return dataclasses.replace(exercise, cases=[c for c in exercise.cases if keep(c)])


def first_case(key):
    return dataclasses.replace(exercises.get(key), cases=exercises.get(key).cases[:1])


def failed(report, phrase):
    text = "\n".join(report.lines())
    assert report.attempted and not report.passed, text
    assert phrase in text, text
    return text


# ---------------------------------------------------------------- 01.2

def keyed_augment_resetting_the_global_seed(transform, image, seed, epoch, index):
    """Seeds the global generator per key, then reseeds it with a constant instead of
    putting its state back: right only while the state before was that constant's."""
    torch.default_generator.manual_seed(hash((seed, epoch, index)) % 2**63)
    out = transform(image)
    torch.default_generator.manual_seed(1000)
    return out


def keyed_augment_with_torch_manual_seed(transform, image, seed, epoch, index):
    """fork_rng puts the CPU generator back, but torch.manual_seed reseeds (or queues a
    seed for) every GPU's generator too, and that stays."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(hash((seed, epoch, index)) % 2**63)
        return transform(image)


def test_01_2_a_global_state_reset_to_a_constant_is_seen():
    failed(core.evaluate(first_case("01.2"), keyed_augment_resetting_the_global_seed),
           "torch's global random state changed")


def test_01_2_torch_manual_seed_is_refused_even_when_the_cpu_state_is_restored():
    failed(core.evaluate(first_case("01.2"), keyed_augment_with_torch_manual_seed),
           "your function calls torch.manual_seed")


# ---------------------------------------------------------------- 02.1

_Sampler = torch.utils.data.DistributedSampler  # an alias, taken when the module loads


class _MySampler(_Sampler):
    """A one-line subclass."""


def sampler_indices_through_an_alias(n, world_size, rank, epoch, seed, shuffle, drop_last):
    sampler = _Sampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle,
                       seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def sampler_indices_through_a_subclass(n, world_size, rank, epoch, seed, shuffle, drop_last):
    sampler = _MySampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("cheat", [sampler_indices_through_an_alias,
                                   sampler_indices_through_a_subclass])
def test_02_1_distributed_sampler_is_refused_however_it_is_reached(cheat):
    failed(core.evaluate(first_case("02.1"), cheat),
           "ran torch's DistributedSampler")


# ---------------------------------------------------------------- 02.3

def exact_accuracy_with_a_share_off_by_one(correct_shard, dataset_size):
    """Each rank's real share as ceil(n/N) - (rank >= n % N): one short on every rank when
    N divides n (n % N is 0)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    share = math.ceil(dataset_size / world) - (rank >= dataset_size % world)
    totals = torch.stack([correct_shard[:share].sum(), torch.tensor(float(share))])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def test_02_3_has_cases_where_the_ranks_divide_the_samples():
    exercise = only("02.3", lambda case: case.args[0] % case.world == 0)
    failed(core.evaluate(exercise, exact_accuracy_with_a_share_off_by_one),
           "samples correct")


# ---------------------------------------------------------------- 05.1

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (  # noqa: E402
    _compress_hook as _squeeze,
)


def fp16_hook_through_torchs_private_compress(state, bucket):
    """torch's own _compress_hook, imported under another name when the module loads."""
    return _squeeze(torch.float16, dist.group.WORLD, bucket)


def fp16_hook_returning_float16(state, bucket):
    """Averages in float16 right, but hands DDP the float16 tensor, not float32."""
    compressed = bucket.buffer().to(torch.float16).div_(dist.get_world_size())
    work = dist.all_reduce(compressed, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def test_05_1_torchs_compress_hook_under_another_name_is_refused():
    exercise = only("05.1", lambda case: case.world == 3)
    failed(core.evaluate(exercise, fp16_hook_through_torchs_private_compress), "torch's")


def test_05_1_the_hooks_result_must_be_float32():
    exercise = only("05.1", lambda case: case.world == 3)
    failed(core.evaluate(exercise, fp16_hook_returning_float16), "float16")


# ---------------------------------------------------------------- 06.2
# The uncapped warm-up (K - 1 > M) is a plausible mistake in solutions/ch06.py, run by
# tests/exercises/test_exercises.py like the others; here, only that such cases exist.

def test_06_2_has_cases_with_more_stages_than_micro_batches_plus_one():
    cases = exercises.get("06.2").cases
    assert any(stages - 1 > micro for stages, micro in (case.args for case in cases))


# ---------------------------------------------------------------- 07.1

from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402


class _MyZero(ZeroRedundancyOptimizer):
    """A one-line subclass: torch's ZeRO-1 under the reader's name."""


def zero1_adam_as_a_subclass(params, lr):
    return _MyZero(list(params), optimizer_class=torch.optim.Adam, lr=lr)


def test_07_1_a_subclass_of_zero_redundancy_optimizer_is_refused():
    exercise = only("07.1", lambda case: case.world == 2)
    failed(core.evaluate(exercise, zero1_adam_as_a_subclass), "ZeroRedundancyOptimizer")


# ---------------------------------------------------------------- 08.1

def save_atomically_through_the_working_directory(state, path):
    """Writes the temporary file into the working directory (the notebooks' folder), then
    moves it: another folder, maybe another file system, and a failed save leaves it."""
    temporary = Path(f"checkpoint-{os.getpid()}.tmp")
    try:
        torch.save(state, temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def save_atomically_through_the_temp_folder(state, path):
    """The temporary file in the system's temporary folder: another file system."""
    handle, name = tempfile.mkstemp(suffix=".pt")
    os.close(handle)
    try:
        torch.save(state, name)
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def save_atomically_beside_the_folder(state, path):
    """The temporary file one folder up, written by torch.save from a path (torch's own
    C++ writes it, no Python open), then moved onto the checkpoint."""
    temporary = Path(path).parent.parent / f"checkpoint-{os.getpid()}.tmp"
    try:
        torch.save(state, str(temporary))
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


@pytest.mark.parametrize("cheat", [save_atomically_through_the_working_directory,
                                   save_atomically_through_the_temp_folder,
                                   save_atomically_beside_the_folder])
def test_08_1_a_temporary_file_outside_the_checkpoints_folder_is_refused(cheat):
    cwd, here, temp = os.getcwd(), sorted(Path.cwd().iterdir()), tempfile.tempdir
    failed(exercises.run("08.1", cheat, record=False), "outside the checkpoint's folder")
    # the harness put everything back, and left nothing behind
    assert (os.getcwd(), sorted(Path.cwd().iterdir()), tempfile.tempdir) == (cwd, here, temp)


# ---------------------------------------------------------------- 09.2

def average_metrics_sorted_by_value(metrics):
    """The same order on every rank only while every rank's values sort alike."""
    names = sorted(metrics, key=metrics.get)
    values = torch.tensor([metrics[name] for name in names], dtype=torch.float64)
    dist.all_reduce(values)
    return dict(zip(names, (values / dist.get_world_size()).tolist(), strict=True))


def test_09_2_ranks_whose_values_sort_differently_catch_a_sort_by_value():
    exercise = only("09.2", lambda case: case.world == 3)
    failed(core.evaluate(exercise, average_metrics_sorted_by_value), "averages over the ranks")
