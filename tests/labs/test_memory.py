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


# ------------------------------------------- chapter 07's meters (labs.fsdp_meters)


def _metered(kind):
    """Chapter 07's section 1 training (its appendix's for ZeRO-1 and bucket views), on a
    small model, under the step meter."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mgpu_helpers.labs.fsdp_meters import StepMeter

    model = memory.feed_forward_blocks(16, 2)
    if kind == "FSDP":
        mesh = init_device_mesh("cpu", (2,))
        for block in model:
            fully_shard(block, mesh=mesh)
        model = fully_shard(model, mesh=mesh)
    else:
        model = DDP(model, gradient_as_bucket_view=kind == "DDP, bucket views")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    meter = StepMeter(model, optimizer, activations=kind == "DDP")
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(8, 16, generator=generator)
        with meter.step():
            optimizer.zero_grad()
            F.mse_loss(model(x), x).backward()
            optimizer.step()
    return meter.report()


@pytest.mark.parametrize("kind", ["DDP", "DDP, bucket views", "FSDP"])
def test_the_step_meter_counts_what_each_kind_of_state_holds(kind):
    result = launch(_metered, kind, nprocs=2, backend="gloo")
    held, parameters = result["memory"], 4 * (2 * (16 * 64 + 64 + 64 * 16 + 16))
    assert len(result["weights"]) == result["gradients"] == 8 and result["seconds"] > 0
    share = 2 if kind == "FSDP" else 1  # FSDP2 keeps half of everything on 2 ranks
    assert held["parameters"] == held["gradients"] == parameters // share
    assert held["optimizer state"] == 2 * parameters // share  # Adam's two moments
    if kind == "DDP":  # buckets: a second copy, and activations measured
        assert held["bucket buffers"] == parameters and result["gradients in a bucket"] == 0
        assert held["activations (peak)"] >= 8 * 64 * 4  # at least one hidden activation
    else:
        assert held["bucket buffers"] == 0 and held["activations (peak)"] == 0
        assert result["gradients in a bucket"] == (8 if kind == "DDP, bucket views" else 0)
    assert [tuple(w.shape) for w in result["weights"]][:2] == [(64, 16), (64,)]  # full


def test_the_step_meter_refuses_a_report_before_any_step():
    from mgpu_helpers.labs.fsdp_meters import StepMeter

    model = memory.feed_forward_blocks(4, 1)
    with pytest.raises(RuntimeError, match="found no step"):
        StepMeter(model, torch.optim.Adam(model.parameters())).report()


def _collectives_of_a_gather():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from mgpu_helpers.labs.fsdp_meters import CollectivesSeen

    mesh = init_device_mesh("cpu", (2,))
    sharded = distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
    unseen = sharded.full_tensor()  # outside the mode: not recorded
    with CollectivesSeen() as seen:
        full = sharded.full_tensor()
    return seen.calls, torch.equal(full, unseen)


def test_collectives_seen_records_what_dtensor_runs_inside_it_only():
    calls, same = launch(_collectives_of_a_gather, nprocs=2, backend="gloo")
    assert same
    # one all-gather of this rank's (3, 2) float32 shard: 24 bytes in
    assert calls == [("all_gather_into_tensor", 24)]
