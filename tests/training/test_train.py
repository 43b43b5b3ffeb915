"""Train/evaluate loops with global metrics; atomic, exactly-resumable checkpoints."""

import multiprocessing
import os
import signal

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from mgpu_helpers import launch
from mgpu_helpers.training.train import (
    Metrics,
    evaluate,
    load_checkpoint,
    save_checkpoint,
    train_one_epoch,
)


def toy_data(n=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    y = (x[:, 0] + x[:, 1] > 0).long()
    return TensorDataset(x, y)


def toy_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))


def run_epochs(model, optimizer, dataset, first, last):
    for epoch in range(first, last):
        loader = DataLoader(dataset, batch_size=8, shuffle=True,
                            generator=torch.Generator().manual_seed(100 + epoch))
        train_one_epoch(model, loader, optimizer, device="cpu", epoch=epoch, progress=False)


# ---------------------------------------------------------------------- loops


def test_training_learns_and_counts_every_sample():
    dataset, model = toy_data(), toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(dataset, batch_size=8, shuffle=True)
    first = train_one_epoch(model, loader, optimizer, device="cpu", progress=False)
    for _ in range(8):
        last = train_one_epoch(model, loader, optimizer, device="cpu", progress=False)
    assert first.samples == last.samples == 64
    assert last.loss < first.loss and last.accuracy > 0.85


def train_on_uneven_shards():
    dataset = toy_data(17)
    shard = torch.utils.data.Subset(dataset, range(10) if dist.get_rank() == 0 else range(10, 17))
    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return train_one_epoch(model, DataLoader(shard, batch_size=4), optimizer, progress=False)


def test_training_metrics_are_global_on_every_rank():
    metrics = launch(train_on_uneven_shards, nprocs=2, return_all=True)
    assert metrics[0] == metrics[1]
    assert metrics[0].samples == 17


def evaluate_toy(dataset):
    return evaluate(toy_model(), dataset, batch_size=4)


@pytest.mark.parametrize("size", [10, 11])
def test_evaluation_counts_each_sample_exactly_once_across_ranks(size):
    dataset = toy_data(size)
    alone = evaluate(toy_model(), dataset, batch_size=4, device="cpu")
    together = launch(evaluate_toy, dataset, nprocs=2, return_all=True)
    assert together[0] == together[1]
    assert together[0].samples == alone.samples == size
    assert together[0].accuracy == alone.accuracy
    assert together[0].loss == pytest.approx(alone.loss, rel=1e-6)  # float32 sums, other order


def test_empty_loader_is_an_error():
    with pytest.raises(ValueError, match="no samples were seen"):
        train_one_epoch(toy_model(), [], torch.optim.SGD(toy_model().parameters(), lr=0.1),
                        device="cpu", progress=False)


def test_metrics_print_readably():
    assert str(Metrics(0.12345, 0.5, 10)) == "loss 0.1235, accuracy 50.00% over 10 samples"


# ---------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("restore_rng", [True, False])
def test_resume_gives_bitwise_the_same_weights(tmp_path, restore_rng):
    """With the saved RNG state the resumed run is exact; without it, dropout diverges."""
    dataset = toy_data()
    straight = toy_model(seed=1)
    optimizer = torch.optim.SGD(straight.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(7)
    run_epochs(straight, optimizer, dataset, 0, 3)

    first_half = toy_model(seed=1)
    optimizer = torch.optim.SGD(first_half.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(7)
    run_epochs(first_half, optimizer, dataset, 0, 1)
    save_checkpoint(tmp_path / "ckpt.pt", first_half, optimizer, epoch=1)
    torch.manual_seed(12345)  # a fresh process would start from another RNG state

    resumed = toy_model(seed=2)  # different initial weights: all must come from the file
    optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    meta = load_checkpoint(tmp_path / "ckpt.pt", resumed, optimizer, restore_rng=restore_rng)
    run_epochs(resumed, optimizer, dataset, meta["epoch"], 3)
    same = all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(),
                                                 resumed.state_dict().values(), strict=True))
    assert same == restore_rng


def test_checkpoint_is_plain_weights_only_data_without_module_prefix(tmp_path):
    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(tmp_path / "c.pt", nn.DataParallel(model), optimizer, epoch=3,
                    extra={"accuracy": 0.9})
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    assert not any(key.startswith("module.") for key in state["model"])
    assert (state["epoch"], state["sampler_epoch"], state["extra"]) == (3, 3, {"accuracy": 0.9})
    assert sorted(os.listdir(tmp_path)) == ["c.pt"], "no temporary file left"


def test_old_module_prefixed_weights_still_load(tmp_path):
    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(tmp_path / "c.pt", model, optimizer, epoch=1)
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    state["model"] = {f"module.{k}": v for k, v in state["model"].items()}
    torch.save(state, tmp_path / "c.pt")
    fresh = toy_model(seed=3)
    load_checkpoint(tmp_path / "c.pt", fresh)
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_missing_foreign_and_truncated_checkpoints_are_named(tmp_path):
    model = toy_model()
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "none.pt", model)
    torch.save({"weights": torch.ones(1)}, tmp_path / "foreign.pt")
    with pytest.raises(RuntimeError, match="not a checkpoint written by save_checkpoint"):
        load_checkpoint(tmp_path / "foreign.pt", model)
    save_checkpoint(tmp_path / "cut.pt", model, torch.optim.SGD(model.parameters(), lr=1), 1)
    data = (tmp_path / "cut.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(RuntimeError, match="cut.pt is unreadable"):
        load_checkpoint(tmp_path / "cut.pt", model)


def save_killed_mid_write(path):
    """In a forked process: a save that dies (SIGKILL) in the middle of writing."""
    def dies_mid_write(obj, handle):
        handle.write(b"half a checkpoint")
        handle.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = dies_mid_write  # this process's torch only
    model = nn.Linear(4, 2)
    save_checkpoint(path, model, torch.optim.SGD(model.parameters(), lr=0.1), epoch=2)


@pytest.mark.slow
def test_save_killed_mid_write_leaves_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "ckpt.pt"
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(path, model, optimizer, epoch=1)
    killed = multiprocessing.get_context("fork").Process(target=save_killed_mid_write,
                                                         args=(path,))
    killed.start()
    killed.join(timeout=120)
    assert killed.exitcode == -signal.SIGKILL
    assert list(tmp_path.glob(".ckpt.pt.tmp-*")), "the killed save left its temporary file"
    assert load_checkpoint(path, nn.Linear(4, 2))["epoch"] == 1
    save_checkpoint(path, model, optimizer, epoch=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"], "stale file cleaned"


def ddp_train_save_and_reload(path):
    dataset = toy_data()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    model = DDP(toy_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler.set_epoch(0)
    train_one_epoch(model, loader, optimizer, progress=False)
    save_checkpoint(path, model, optimizer, epoch=1)
    fresh = toy_model(seed=5)
    meta = load_checkpoint(path, fresh, restore_rng=False)
    return meta["world_size"], [p.detach() for p in fresh.parameters()], sorted(
        os.listdir(os.path.dirname(path)))


@pytest.mark.usefixtures("no_leftover_processes")
def test_ddp_ranks_share_one_checkpoint_written_by_rank0(tmp_path):
    results = launch(ddp_train_save_and_reload, str(tmp_path / "ddp.pt"), nprocs=2,
                     return_all=True)
    (world0, weights0, files0), (world1, weights1, files1) = results
    assert world0 == world1 == 2
    assert files0 == files1 == ["ddp.pt"]
    for a, b in zip(weights0, weights1, strict=True):
        assert torch.equal(a, b)


def augmentation_draws(path, resume):
    """Each rank draws its epoch-2 "augmentations" (torch, numpy and Python RNGs) after
    epoch 1, either straight on or after a resume from the epoch-1 checkpoint."""
    import random

    import numpy as np

    from mgpu_helpers import rank

    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if resume:
        torch.manual_seed(999)  # a restarted process starts from other states
        np.random.seed(999)
        random.seed(999)
        load_checkpoint(path, model, optimizer, restore_rng=True)
    else:
        torch.manual_seed(100 + rank())  # ranks augment differently (chapter 02)
        np.random.seed(100 + rank())
        random.seed(100 + rank())
        torch.rand(8)  # epoch 1's draws
        save_checkpoint(path, model, optimizer, epoch=1)
    return torch.cat([torch.rand(4), torch.from_numpy(np.random.rand(2)).float(),
                      torch.tensor([random.random()])])


@pytest.mark.usefixtures("no_leftover_processes")
def test_resume_gives_every_rank_back_its_own_random_state(tmp_path):
    """Chapter 02's identical-augmentation bug, at resume: each rank must get its own
    RNG states back, not rank 0's."""
    path = str(tmp_path / "rng.pt")
    straight = launch(augmentation_draws, path, False, nprocs=2, backend="gloo",
                      return_all=True)
    resumed = launch(augmentation_draws, path, True, nprocs=2, backend="gloo",
                     return_all=True)
    assert not torch.equal(straight[0], straight[1])  # the ranks draw differently
    for before, after in zip(straight, resumed, strict=True):
        assert torch.equal(before, after)  # and each continues its own sequence

    with pytest.raises(ValueError, match=r"RNG states of 2 rank\(s\), but this run has 1"):
        load_checkpoint(path, toy_model(), restore_rng=True)
    assert load_checkpoint(path, toy_model(), restore_rng=False)["world_size"] == 2
