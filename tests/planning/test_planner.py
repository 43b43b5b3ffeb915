"""The planner's formulas: each against a case computed by hand, against chapter 10's and
the strategy map's formulas for the workbook's GPT, and against what a real step holds."""

import math

import pytest
import torch

from mgpu_helpers.measure.memory import ActivationMeter
from mgpu_helpers.models.gpt import GPT, GPTConfig
from mgpu_helpers.parallel.pipeline import theoretical_bubble
from mgpu_helpers.planning import costs, planner, strategy
from mgpu_helpers.planning.planner import Cluster, Model, Plan

GPT_SIZES = GPTConfig(vocab_size=48, context=16, dim=32, layers=4, heads=4)
FLOAT32 = costs.Precision("float32", 4, 4, 8)
# a toy model whose numbers are easy by hand: h = 8, four heads of 2, two kv heads, ffn 16
TOY = Model("toy", layers=4, dim=8, heads=4, ffn=16, vocab=10, kv_heads=2, gated=True,
            norm_parameters=1)
SLOW = Cluster("toy cluster", gpus_per_node=4, memory_bytes=1e9, peak_flops=1e12,
               intra_bandwidth=1e9, inter_bandwidth=1e8, intra_latency=1e-6,
               inter_latency=1e-5)


def test_the_gpt_counts_match_chapter_10_and_the_module():
    model = Model.from_gpt(GPT_SIZES)
    assert model.total_parameters() == sum(costs.parameter_counts(GPT_SIZES).values())
    assert model.total_parameters() == sum(p.numel() for p in GPT(GPT_SIZES).parameters())
    assert model.active_matmul_parameters() == costs.matmul_parameters(GPT_SIZES)
    assert model.flops_per_token(16) == costs.training_flops_per_token(GPT_SIZES, 16)


def test_the_toy_counted_by_hand():
    # attention: q, o 8x8 each, k, v 8x4 each = 192; gated MLP 3 x 8 x 16 = 384
    assert TOY.attention_parameters() == 192 and TOY.expert_parameters() == 384
    counts = TOY.parameters()
    assert counts["norms"] == (2 * 4 + 1) * 8 and counts["embeddings"] == 80
    assert TOY.total_parameters() == 80 + 4 * 192 + 4 * 384 + 72 + 80
    # per token: 6 x (4 x (192 + 384) + 80) + 12 x 4 x s x 8
    assert TOY.flops_per_token(32) == 6 * (4 * 576 + 80) + 12 * 4 * 32 * 8


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_activations_match_the_strategy_map_for_the_gpt(tp):
    model = Model.from_gpt(GPT_SIZES)
    expected = strategy.tp_block_activation_bytes(GPT_SIZES, 2, 16, tp)
    got = model.layer_activation_elements(2 * 16, tp) * planner.ACTIVATION_BYTES
    assert math.isclose(got, expected, rel_tol=1e-12, abs_tol=tp)  # theirs rounds up


def test_activations_of_a_real_block_measured():
    # what autograd keeps for one block of the workbook's GPT, float32 on this CPU
    torch.manual_seed(0)
    block = GPT(GPT_SIZES).blocks[0]
    x = torch.randn(2, 16, GPT_SIZES.dim, requires_grad=True)
    with ActivationMeter(exclude=block.parameters()) as meter:
        block(x)
    predicted = Model.from_gpt(GPT_SIZES).layer_activation_elements(32, element_bytes=4) * 4
    assert meter.peak == predicted


def test_training_state_of_a_real_adamw_step_measured():
    torch.manual_seed(0)
    gpt = GPT(GPT_SIZES)
    optimizer = torch.optim.AdamW(gpt.parameters())
    gpt(torch.zeros(1, 16, dtype=torch.long)).sum().backward()
    optimizer.step()
    held = {"weights": sum(p.numel() * p.element_size() for p in gpt.parameters()),
            "gradients": sum(p.grad.numel() * p.grad.element_size() for p in gpt.parameters()),
            "optimizer": sum(t.numel() * t.element_size() for state in optimizer.state.values()
                             for name, t in state.items() if name != "step")}
    memory = planner.stage_memory(Model.from_gpt(GPT_SIZES), Plan(zero=0), 16, 0, FLOAT32)
    assert {k: memory[k] for k in held} == held


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stages_shard_what_they_say_by_hand(zero):
    plan = Plan(dp=4, tp=2, pp=2, zero=zero)
    first = planner.stage_parameters(TOY, plan, 0)
    # stage 0 of 2: 2 layers; per layer attention/2 + two norms whole + MLP/2; the
    # embedding's vocabulary split by tp (no positions)
    layer = 192 / 2 + 2 * 8 + 384 / 2
    assert first["layer"] == layer and first["edges"] == 10 * 8 / 2
    held = 2 * layer + 40
    memory = planner.stage_memory(TOY, plan, 8, 0)
    sharded = {"weights": zero >= 3, "gradients": zero >= 2, "optimizer": zero >= 1}
    per_parameter = {"weights": 2, "gradients": 2, "optimizer": 12}
    for name, is_sharded in sharded.items():
        assert memory[name] == held / (4 if is_sharded else 1) * per_parameter[name], name


def test_pipeline_activations_in_flight():
    plan = Plan(pp=4, micro_batches=8)
    assert [planner.layers_in_flight(TOY, plan, s) for s in range(4)] == [4, 3, 2, 1]
    assert planner.layers_in_flight(TOY, Plan(pp=4, micro_batches=8, schedule="gpipe"), 0) == 8
    # interleaved, v = 2 chunks of ceil(4 / 8) = 1 layer: warm-up 2(p-1) + (v-1)p, +1
    deep = Model("deep", layers=16, dim=8, heads=2, ffn=16, vocab=10)
    interleaved = Plan(pp=4, micro_batches=8, virtual_stages=2)
    assert planner.layers_in_flight(deep, interleaved, 0) == 2 * (2 * 3 + 4 + 1)
    assert planner.layers_in_flight(deep, Plan(pp=4, micro_batches=8), 0) == 16  # 1F1B


def test_collective_prices_by_hand():
    # chapter 03's ring: an all-reduce of 1 MB on 4 ranks: 6 steps, 1.5 MB sent
    seconds = planner.collective_seconds("all_reduce", 1e6, 4, 1e9, 1e-6)
    assert math.isclose(seconds, 6e-6 + 1.5e6 / 1e9)
    assert planner.collective_seconds("all_gather", 1e6, 4, 1e9, 0) == 3e6 / 1e9
    assert planner.collective_seconds("all_to_all", 1e6, 4, 1e9, 0) == 0.75e6 / 1e9
    assert planner.collective_seconds("all_reduce", 1e6, 1, 1e9, 1.0) == 0


def test_tensor_parallel_traffic_by_hand():
    plan = Plan(tp=2, micro_batches=3, checkpointing=True)
    got = planner.predict(TOY, SLOW, plan, 8).communication["tp"]
    slab = 8 * 8 * 2  # tokens x h x bfloat16 bytes
    per_pass = 2 * (slab / 2 * 1 + slab / 2)  # 2 x (all-gather of a half + reduce-scatter)
    assert got.bytes_sent == 4 * 3 * 3 * per_pass  # layers x micro-batches x 3 passes
    assert got.exposed == got.seconds  # on the critical path


def test_the_bubble_is_chapter_06s():
    for p, m, v in ((4, 4, 1), (4, 8, 2), (2, 3, 1)):
        deep = Model("deep", layers=16, dim=8, heads=2, ffn=16, vocab=10)
        got = planner.predict(deep, SLOW, Plan(pp=p, micro_batches=m, virtual_stages=v,
                                                zero=0), 8)
        idle = got.bubble_s / got.step_s
        assert math.isclose(idle, theoretical_bubble(p, m, v), rel_tol=1e-9)


def test_mfu_without_communication_is_the_efficiency_in_the_mfu_convention():
    # time counts attention as a causal fused kernel (7·L·s·h), MFU the full square (12)
    got = planner.predict(TOY, SLOW, Plan(zero=0), 8, efficiency=0.5)
    six_n, lsh = 6 * (4 * 576 + 80), 4 * 8 * 8
    assert math.isclose(got.mfu, 0.5 * (six_n + 12 * lsh) / (six_n + 7 * lsh))
    assert got.communication == {}


def test_recomputation_adds_a_forward_pass():
    plain = planner.predict(TOY, SLOW, Plan(zero=0), 8)
    again = planner.predict(TOY, SLOW, Plan(zero=0, checkpointing=True), 8)
    two_n, lsh = 2 * (4 * 576 + 80), 4 * 8 * 8
    assert math.isclose(again.compute_s - plain.compute_s,
                        (two_n + 2 * lsh) * 8 / (SLOW.peak_flops * 0.6))


def test_zero3_traffic_without_and_with_a_pipeline():
    # FSDP2's default: gathers each way per micro-batch, a reduce-scatter per backward;
    # under PipelineStage: a gather per forward, one for the backward passes, one sync
    plain = planner.predict(TOY, SLOW, Plan(dp=2, zero=3, micro_batches=3), 8)
    held = planner.stage_parameters(TOY, Plan(dp=2), 0)
    params = held["dense"] + held["experts"]
    gathered, reduced = params * 2 / 2, params * 2
    assert plain.communication["dp"].bytes_sent == 6 * gathered + 3 * reduced / 2
    piped_plan = Plan(dp=2, pp=2, zero=3, micro_batches=3)
    piped = planner.predict(TOY, SLOW, piped_plan, 8)
    held = max((planner.stage_parameters(TOY, piped_plan, s) for s in (0, 1)),
               key=lambda h: h["dense"] + h["experts"])
    params = held["dense"] + held["experts"]
    assert piped.communication["dp"].bytes_sent == 4 * params + params


def test_under_a_pipeline_zero3_holds_the_stage_whole_during_the_step():
    plan = Plan(dp=4, pp=2, zero=3, micro_batches=4)
    memory = planner.stage_memory(TOY, plan, 8, 0)
    held = planner.stage_parameters(TOY, plan, 0)
    whole = held["dense"] + held["experts"]
    # at rest a quarter; during the step the gathered weights and whole gradients
    assert memory["weights"] == whole / 4 * 2 and memory["gradients"] == whole / 4 * 2
    assert memory["gradients"] + memory["working set"] == whole * (2 + 2)


def test_interleaving_sends_once_per_chunk():
    deep = Model("deep", layers=16, dim=8, heads=2, ffn=16, vocab=10)
    one = planner.predict(deep, SLOW, Plan(pp=2, micro_batches=4, zero=0), 8)
    two = planner.predict(deep, SLOW, Plan(pp=2, micro_batches=4, virtual_stages=2,
                                           zero=0), 8)
    message = 8 * 8 * 2
    assert one.communication["pp"].bytes_sent == 4 * message  # an end stage sends one way
    assert two.communication["pp"].bytes_sent == 2 * 4 * 2 * message


@pytest.mark.parametrize("p, v, m", [(4, 2, 8), (16, 4, 32), (4, 3, 4), (8, 2, 16)])
def test_interleaved_chunks_in_flight_are_pytorchs_schedule(p, v, m):
    # the peak of forwards not yet backwarded on rank 0, in the order PyTorch's
    # ScheduleInterleaved1F1B computes (a private method, called on its inputs alone)
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    rounds = max(1, m // p)
    schedule = SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds,
                               pp_group_size=p, _n_microbatches=m)
    order = ScheduleInterleaved1F1B._calculate_single_rank_operations(schedule, 0)
    live = peak = 0
    for action in order:
        if action is None:
            continue
        live += {"F": 1, "B": -1}.get(action.computation_type.value, 0)
        peak = max(peak, live)
    deep = Model("deep", layers=p * v, dim=8, heads=2, ffn=16, vocab=10)  # 1 layer a chunk
    plan = Plan(pp=p, micro_batches=m, virtual_stages=v)
    assert planner.layers_in_flight(deep, plan, 0) == peak


def test_data_parallel_traffic_hides_behind_compute():
    fast = planner.predict(TOY, SLOW, Plan(dp=2, zero=0), 8)
    assert fast.communication["dp"].exposed == max(
        0.0, fast.communication["dp"].seconds - fast.compute_s)
    params = planner.stage_parameters(TOY, Plan(dp=2), 0)
    held = params["dense"] + params["experts"]
    assert fast.communication["dp"].bytes_sent == 2 * (2 - 1) / 2 * held * 2


def test_groups_that_span_nodes_use_the_slow_link():
    inside = planner.predict(TOY, SLOW, Plan(tp=2, dp=2, zero=0), 8)
    across = planner.predict(TOY, SLOW, Plan(tp=2, dp=4, zero=0), 8)  # 8 GPUs, nodes of 4
    assert inside.communication["dp"].seconds < across.communication["dp"].seconds
    assert inside.communication["tp"].seconds == across.communication["tp"].seconds


@pytest.mark.parametrize("plan, message", [
    (Plan(tp=4), "kv_heads .2. is not a multiple of tp"),
    (Plan(pp=8), "cannot fill"),
    (Plan(ep=2, dp=2), "has no experts"),
    (Plan(cp=3), "zig-zag"),
])
def test_plans_the_model_cannot_take_are_refused(plan, message):
    with pytest.raises(ValueError, match=message):
        planner.predict(TOY, SLOW, plan, 8)


def test_bad_plans_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="ep .3. must divide"):
        Plan(dp=2, ep=3)
    with pytest.raises(ValueError, match="ZeRO"):
        Plan(zero=4)
    with pytest.raises(ValueError, match="interleaved"):
        Plan(schedule="gpipe", virtual_stages=2)
    with pytest.raises(ValueError, match="efficiency"):
        planner.predict(TOY, SLOW, Plan(), 8, efficiency=1.5)


def test_the_best_plan_fits_and_is_fastest():
    roomy = Cluster("roomy", 8, 5e5, 1e12, 1e9, 1e8)
    found = planner.best_plan(TOY, roomy, 8, 8, 8)
    assert found is not None
    plan, prediction = found
    assert prediction.fits and plan.gpus == 8
    for other in planner.candidate_plans(TOY, roomy, 8, 8, 8):
        other_prediction = planner.predict(TOY, roomy, other, 8)
        assert not other_prediction.fits or other_prediction.step_s >= prediction.step_s


def test_the_calculators_settings_make_the_plan_or_say_why_not():
    from mgpu_helpers.viz import calculator as planner_calculator

    settings = dict(model="Llama 3 70B", nodes=8, tp=8, pp=1, cp=1, zero=3, micro_batch=1,
                    global_batch=256, length=4096, checkpointing=False)
    plan, prediction = planner_calculator.settings_prediction(**settings)
    assert plan == Plan(dp=8, tp=8, zero=3, micro_batch=1, micro_batches=32)
    assert prediction.step_s == planner.predict(planner.LLAMA3_70B, planner.H100_NODES, plan,
                                                4096).step_s
    assert planner_calculator.settings_prediction(**{**settings, "nodes": 1, "pp": 16})[1] \
        == "8 GPUs do not split into tp x pp x cp = 128"
    assert "does not split into dp" in planner_calculator.settings_prediction(
        **{**settings, "global_batch": 16, "micro_batch": 4})[1]
    refused = planner_calculator.settings_prediction(**{**settings, "nodes": 16, "tp": 16})
    assert refused[0] is None and "kv_heads (8) is not a multiple of tp (16)" in refused[1]
    dense = planner_calculator.settings_prediction(**{**settings, "ep": 8})
    assert dense == (None, "Llama 3 70B has no experts: ep must be 1")
    moe, _ = planner_calculator.settings_prediction(**{**settings, "model": "Mixtral 8x7B",
                                                       "ep": 8})
    assert moe.ep == 8 and moe.dp == 8


def test_expert_parallel_traffic_is_chapter_13s_formula():
    # chapter 13: a dispatch sends tokens·k·h·bytes·(ep-1)/ep per rank with even routing
    # (its measured dispatch is within 10% of this on 4 ranks); combine the same, and
    # both again backward
    moe = Model("moe", layers=1, dim=64, heads=4, ffn=32, vocab=8, experts=8, top_k=2)
    plan = Plan(dp=4, ep=4, zero=0, micro_batch=16)
    got = planner.predict(moe, SLOW, plan, 16, costs.FLOAT32).communication["ep"]
    dispatch = 256 * 2 * 64 * 4 * 3 // 4
    assert dispatch == 98_304 and got.bytes_sent == 4 * dispatch
    experts = planner.stage_parameters(moe, plan, 0)["experts"]
    assert experts == 8 * moe.expert_parameters() / 4  # each rank holds 2 of the 8 experts


def test_one_set_of_precision_layouts_serves_the_planner_and_the_strategy_map():
    # bytes a parameter (weight + gradient + optimizer), each layout as its source counts
    per_parameter = {name: p.weight + p.gradient + p.optimizer for name, p in (
        ("ZeRO paper", costs.MIXED), ("PyTorch", costs.PYTORCH),
        ("Megatron-LM", costs.MEGATRON), ("float32", costs.FLOAT32))}
    assert per_parameter == {"ZeRO paper": 16, "PyTorch": 16, "Megatron-LM": 18, "float32": 16}
    assert costs.PYTORCH.copies == 2 and costs.FLOAT32.activation == 4
    # one home: the planner's and the strategy map's defaults are these objects
    import inspect

    for function in (planner.stage_memory, planner.predict, strategy.memory_budget):
        assert inspect.signature(function).parameters["precision"].default is costs.MIXED
    assert strategy.Precision is planner.Precision is costs.Precision
    assert not hasattr(strategy, "_ceil_div") and not hasattr(planner, "_ceil_div")
    assert costs.ceil_div(7, 2) == 4 and costs.ceil_div(8, 2) == 4
