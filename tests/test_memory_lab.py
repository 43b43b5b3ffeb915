"""Chapter 07's memory anatomy and traffic per strategy (mgpu_helpers.labs.memory)."""

import pytest
import torch

from mgpu_helpers import launch
from mgpu_helpers.labs import memory

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def test_formula_follows_the_zero_paper():
    psi, ranks = 1000, 4
    ddp = memory.formula("DDP", psi, ranks)
    assert ddp == {"parameters": 4000, "gradients": 4000, "optimizer state": 8000,
                   "bucket buffers": 4000}
    assert memory.formula("DDP, bucket views", psi, ranks)["bucket buffers"] == 0
    zero1 = memory.formula("ZeRO-1", psi, ranks)
    assert zero1["optimizer state"] == 2000 and zero1["gradients"] == 4000
    for strategy in ("FSDP2", "FSDP2, keep after forward"):
        assert memory.formula(strategy, psi, ranks) == {
            "parameters": 1000, "gradients": 1000, "optimizer state": 2000,
            "bucket buffers": 0}


def test_an_unknown_strategy_is_named_in_the_error():
    with pytest.raises(ValueError, match="ZeRO-2"):
        memory.formula("ZeRO-2", 10, 2)


def test_collectives_volume_counts_an_all_reduce_twice():
    entries = [
        {"profiling_name": "gloo:all_reduce", "input_sizes": [[10, 3]], "output_sizes": [[10, 3]]},
        {"profiling_name": "gloo:all_gather", "input_sizes": [[5]], "output_sizes": [[2, 5]]},
        {"profiling_name": "gloo:all_gather", "input_sizes": [[5]], "output_sizes": [[2, 5]]},
        {"profiling_name": "nccl:broadcast", "input_sizes": [[7]], "output_sizes": [[7]]},
    ]
    assert memory.collectives_volume(entries) == {
        "all_reduce": {"calls": 1, "elements": 60},
        "all_gather": {"calls": 2, "elements": 20},
        "broadcast": {"calls": 1, "elements": 7}}


def test_storages_count_a_shared_buffer_once_and_whole():
    flat = torch.zeros(10)
    found = memory.storages([flat[:5], flat[5:], torch.zeros(3, dtype=torch.float64), None])
    assert sorted(found.values()) == [24, 40]  # the views: their whole buffer, once


def test_step_calls_lists_each_collective_with_its_bytes():
    entries = [
        {"profiling_name": "gloo:all_reduce", "input_sizes": [[10, 3]], "output_sizes": [[10, 3]]},
        {"profiling_name": "gloo:all_gather", "input_sizes": [[5]], "output_sizes": [[2, 5]]},
    ]
    assert memory.step_calls(entries) == [("all_reduce", 120), ("all_gather", 40)]


def _buckets_and_gradients(views):
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(memory.feed_forward_blocks(16, 2), gradient_as_bucket_view=views)
    buckets = memory.record_bucket_buffers(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    seen = []
    for _ in range(3):  # DDP rebuilds its buckets after the first step
        optimizer.zero_grad()
        x = torch.randn(4, 16)
        F.mse_loss(model(x), x).backward()
        optimizer.step()
        seen.append(memory.storages(buckets.values()))
    params = list(model.parameters())
    in_buckets = memory.storages(buckets.values())
    return {"held": memory.held_by_kind(params, optimizer, buckets),
            "same buffers in steps 2 and 3": seen[1] == seen[2],
            "in a bucket": sum(not in_buckets.keys().isdisjoint(memory.storages([p.grad]))
                               for p in params),
            "parameters": len(params)}


@pytest.mark.parametrize("views", [False, True])
def test_bucket_buffers_copy_the_gradients_unless_they_are_views(views):
    result = launch(_buckets_and_gradients, views, nprocs=2, backend="gloo")
    held = result["held"]
    assert result["same buffers in steps 2 and 3"]  # DDP keeps them: not a step's temporary
    if views:  # every gradient lives in a bucket: no second copy
        assert result["in a bucket"] == result["parameters"]
        assert held["bucket buffers"] == 0
    else:  # separate storage, as many bytes as the gradients
        assert result["in a bucket"] == 0
        assert held["bucket buffers"] == held["gradients"] == held["parameters"]


def run(strategy, checkpointing=False):
    return launch(memory.rank_memory, strategy, checkpointing, 3, 64, 2, 32, nprocs=2,
                  backend="gloo", return_all=True)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", memory.STRATEGIES)
def test_each_rank_holds_what_the_formula_says_and_trains_like_ddp(strategy):
    ranks = run(strategy)
    reference = run("DDP")[0]["weights"]
    expected = memory.formula(strategy, ranks[0]["parameter count"], 2)
    for rank_result in ranks:
        for kind, value in expected.items():
            assert rank_result["stored"][kind] == pytest.approx(value, rel=0.05), kind
    assert max((a - b).abs().max().item()
               for a, b in zip(ranks[0]["weights"], reference, strict=True)) < 1e-6


@pytest.mark.slow
def test_traffic_per_step_in_units_of_the_parameter_count():
    volume = {}
    for strategy in ("DDP", "ZeRO-1", "FSDP2, keep after forward", "FSDP2"):
        result = run(strategy)[0]
        volume[strategy] = {kind: row["elements"] / result["parameter count"]
                            for kind, row in result["collectives"].items()}
    assert volume["DDP"] == {"all_reduce": 2.0}
    assert volume["ZeRO-1"] == {"all_reduce": 2.0, "broadcast": 1.0}
    # gloo carries out FSDP2's gradient reduce-scatter as an all-reduce of the whole
    # gradient: 2 parameter counts where NCCL's reduce-scatter moves 1
    assert volume["FSDP2, keep after forward"] == {"all_gather": 1.0, "all_reduce": 2.0}
    assert volume["FSDP2"] == {"all_gather": 2.0, "all_reduce": 2.0}


@pytest.mark.slow
def test_keeping_weights_after_forward_and_checkpointing_move_the_forward_peak():
    def forward_extra(strategy, checkpointing=False):
        return run(strategy, checkpointing)[0]["extra at peak"]["forward"]

    result = run("FSDP2, keep after forward")[0]
    blocks_in_full = 2 * result["block bytes"]  # both blocks gathered at the end
    assert result["extra at peak"]["forward"] >= blocks_in_full
    assert forward_extra("FSDP2") < result["extra at peak"]["forward"]
    assert forward_extra("DDP", checkpointing=True) < forward_extra("DDP")



@pytest.mark.slow
def test_the_step_collectives_timed_alone_and_the_cost_model_fitted():
    result = launch(memory.rank_memory, "FSDP2", False, 2, 64, 2, 32, True, nprocs=2,
                    backend="gloo")
    assert [kind for kind, _ in result["calls"]].count("all_gather") == 4  # 2 per unit
    assert result["traffic seconds"] > 0 and result["step seconds"] > 0
    alpha, bandwidth = result["alpha, bandwidth"]
    assert alpha > 0 and bandwidth > 0
