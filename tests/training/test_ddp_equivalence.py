"""DDP computes what one process computes on the global batch; no_sync accumulation too;
mixed precision and gradient accumulation in train_one_epoch."""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from mgpu_helpers import launch
from mgpu_helpers.training.train import train_one_epoch

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def dataset(n=64):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=generator)
    return TensorDataset(x, (x[:, 0] - x[:, 2] > 0).long())


def fresh_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 2))


def ddp_weights(batch_size, accumulate=1, count_messages=False):
    """Inside a rank: one epoch of DDP; every rank reads every other sample."""
    data = dataset()
    sampler = DistributedSampler(data, shuffle=False)  # rank r: samples r, r+2, r+4...
    model = DDP(fresh_model())
    messages = []
    if count_messages:
        def counting_allreduce(state, bucket):
            messages.append(bucket.index())
            return torch.distributed.all_reduce(
                bucket.buffer().div_(torch.distributed.get_world_size()),
                async_op=True).get_future().then(lambda fut: fut.value()[0])
        model.register_comm_hook(None, counting_allreduce)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    train_one_epoch(model, DataLoader(data, batch_size=batch_size, sampler=sampler),
                    optimizer, device="cpu", progress=False, accumulate=accumulate)
    return {"weights": [p.detach() for p in model.module.parameters()],
            "messages": len(messages)}


def single_process_weights(batch_size):
    model = fresh_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    train_one_epoch(model, DataLoader(dataset(), batch_size=batch_size), optimizer,
                    device="cpu", progress=False)
    return [p.detach() for p in model.parameters()]


def assert_same(weights_a, weights_b):
    for a, b in zip(weights_a, weights_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_ddp_on_two_ranks_with_batch_b_equals_one_process_with_batch_2b():
    ranks = launch(ddp_weights, 4, nprocs=2, return_all=True)
    assert_same(ranks[0]["weights"], single_process_weights(8))   # 8 steps of 8 samples
    assert_same(ranks[0]["weights"], ranks[1]["weights"])          # replicas stay in step
    with pytest.raises(AssertionError):                            # the check can fail:
        assert_same(ranks[0]["weights"], single_process_weights(4))


def test_no_sync_accumulation_equals_the_big_batch_and_communicates_once_per_step():
    ranks = launch(ddp_weights, 4, 2, True, nprocs=2, return_all=True)
    assert_same(ranks[0]["weights"], single_process_weights(16))  # 2 ranks x 2 x 4 samples
    plain = launch(ddp_weights, 4, 1, True, nprocs=2)
    assert plain["messages"] == 8                        # one bucket, 8 batches per rank
    assert ranks[0]["messages"] == 4                     # one all-reduce per 2 batches


def test_accumulation_divides_a_short_last_group_by_its_own_size():
    data = dataset(40)  # batches of 8: 5 batches, groups of 2 -> 2, 2, 1
    model = fresh_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    train_one_epoch(model, DataLoader(data, batch_size=8), optimizer, device="cpu",
                    progress=False, accumulate=2)
    reference = fresh_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    train_one_epoch(reference, DataLoader(data, batch_size=16), optimizer, device="cpu",
                    progress=False)
    assert_same(list(model.parameters()), list(reference.parameters()))


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_accumulate_must_be_a_positive_whole_number(bad):
    model = fresh_model()
    with pytest.raises(ValueError, match="accumulate must be a whole number >= 1"):
        train_one_epoch(model, DataLoader(dataset(), batch_size=8),
                        torch.optim.SGD(model.parameters(), lr=0.1), device="cpu",
                        progress=False, accumulate=bad)


def test_bfloat16_autocast_trains_close_to_float32():
    results = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        model = fresh_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        loader = DataLoader(dataset(), batch_size=8)
        first = train_one_epoch(model, loader, optimizer, device="cpu", progress=False,
                                amp_dtype=dtype)
        for _ in range(3):
            last = train_one_epoch(model, loader, optimizer, device="cpu", progress=False,
                                   amp_dtype=dtype)
        results[name] = (first, last)
    assert abs(results["bf16"][0].loss - results["fp32"][0].loss) < 0.02
    assert results["bf16"][1].loss < results["bf16"][0].loss
    assert results["bf16"][1].accuracy > 0.8


def test_float16_with_a_grad_scaler_skips_overflowing_steps():
    model = fresh_model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)  # guaranteed inf gradients
    train_one_epoch(model, DataLoader(dataset(16), batch_size=16), optimizer, device="cpu",
                    progress=False, amp_dtype=torch.float16, scaler=scaler)
    assert_same(list(model.parameters()), before)  # the step was skipped...
    assert scaler.get_scale() < 2.0**100           # ...and the scale lowered
