"""Part III's GPT, its recall task and its cost formulas, each formula against a
measurement that does not use it (PyTorch's FLOP counter, the bytes autograd saves, the
bytes AdamW allocates)."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mgpu_helpers.data.recall import IGNORE, RecallDataset, RecallTask
from mgpu_helpers.measure.memory import ActivationMeter
from mgpu_helpers.models.gpt import GPT, GPTConfig
from mgpu_helpers.planning import costs
from mgpu_helpers.training import lm
from mgpu_helpers.training.checkpoints import RUN_FILE, check_resumable
from mgpu_helpers.training.gpt_recipe import GPTRun, compute_dtype, lr_factor

CONFIGS = [GPTConfig(vocab_size=32, context=16, dim=64, layers=2, heads=4),
           GPTConfig(vocab_size=50, context=24, dim=48, layers=3, heads=6, mlp_ratio=2),
           GPTConfig(vocab_size=7, context=9, dim=32, layers=1, heads=1)]


@pytest.mark.parametrize("name, value", [("dim", 0), ("heads", -1), ("layers", 1.5),
                                         ("vocab_size", True)])
def test_a_config_refuses_sizes_that_are_not_whole_numbers(name, value):
    sizes = {"vocab_size": 8, "context": 8, name: value}
    with pytest.raises(ValueError, match=f"GPTConfig.{name} must be a whole number >= 1"):
        GPTConfig(**sizes)


def test_the_width_must_split_into_heads():
    with pytest.raises(ValueError, match="dim 30 is not a multiple of heads 4"):
        GPTConfig(vocab_size=8, context=8, dim=30, heads=4)


def test_the_model_is_causal_and_positions_can_be_given():
    torch.manual_seed(0)
    model = GPT(CONFIGS[0])
    ids = torch.randint(32, (2, 10))
    changed = ids.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 32
    logits, later = model(ids), model(changed)
    assert logits.shape == (2, 10, 32)
    assert torch.equal(logits[:, :6], later[:, :6])  # no position sees a later token
    assert not torch.allclose(logits[:, 6:], later[:, 6:])
    assert torch.equal(model(ids, torch.arange(10)), logits)
    shifted = model(ids[:, 4:], torch.arange(4, 10))  # a later chunk at its true places
    assert not torch.allclose(shifted, model(ids[:, 4:]))


def test_a_sequence_longer_than_the_context_is_refused():
    with pytest.raises(ValueError, match="longer than the model's context of 16"):
        GPT(CONFIGS[0])(torch.zeros(1, 17, dtype=torch.long))


def test_activation_checkpointing_changes_memory_not_gradients():
    task = RecallTask(pairs=6)
    model = lm.model_for(task, dim=32, layers=3, heads=2)
    inputs, targets = task.sequences(4, 0)
    peaks, gradients = [], []
    for checkpointing in (False, True):
        model.activation_checkpointing = checkpointing
        with ActivationMeter(exclude=model.parameters()) as meter:
            loss = lm.lm_loss(model(inputs), targets)
        loss.backward()
        peaks.append(meter.peak)
        gradients.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(*gradients, strict=True))
    per_block = costs.activation_bytes_per_block(model.config, 4, task.length)
    block_input = 4 * task.length * 32 * 4
    # each block keeps only its input: the blocks' activations less one input each
    assert peaks[0] - peaks[1] == 3 * (per_block - block_input)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"h{c.dim}L{c.layers}a{c.heads}")
def test_parameter_counts_add_up_to_the_model(config):
    model = GPT(config)
    counts = costs.parameter_counts(config)
    assert sum(counts.values()) == sum(p.numel() for p in model.parameters())
    matrices = sum(p.numel() for name, p in model.named_parameters()
                   if p.dim() == 2 and not name.startswith(("tokens.", "positions.")))
    assert costs.matmul_parameters(config) == matrices


def counted_training_flops(model, ids, backend=None):
    with FlopCounterMode(display=False) as counter:
        with sdpa_kernel(backend) if backend else torch.enable_grad():
            logits = model(ids)
            F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"h{c.dim}L{c.layers}a{c.heads}")
def test_training_flops_per_token_equal_what_pytorch_counts(config):
    torch.manual_seed(0)
    model, batch, length = GPT(config), 3, config.context - 1
    ids = torch.randint(config.vocab_size, (batch, length))
    counted = counted_training_flops(model, ids, SDPBackend.MATH)
    assert counted == costs.training_flops_per_token(config, length) * batch * length
    # the CPU's default attention kernel is not counted at all: only the 6N part
    six_n = 6 * costs.matmul_parameters(config) * batch * length
    assert counted_training_flops(model, ids) == six_n


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"h{c.dim}L{c.layers}a{c.heads}")
def test_activation_bytes_equal_what_autograd_keeps(config):
    torch.manual_seed(0)
    model, batch, length = GPT(config), 3, config.context - 2
    ids = torch.randint(config.vocab_size, (batch, length))
    with ActivationMeter(exclude=model.parameters()) as meter:
        model(ids)
    assert meter.peak == costs.activation_bytes(config, batch, length)


def test_a_bfloat16_block_keeps_half_the_bytes_but_float32_attention_statistics():
    config = CONFIGS[0]
    block = GPT(config).blocks[0].bfloat16()
    x = torch.randn(2, 12, config.dim, dtype=torch.bfloat16, requires_grad=True)
    with ActivationMeter(exclude=block.parameters()) as meter:
        block(x)
    assert meter.peak == costs.activation_bytes_per_block(config, 2, 12, element_bytes=2)


def test_the_math_kernel_keeps_the_attention_matrix():
    # what the formula's kernel avoids: s x s probabilities per head, float32
    config = CONFIGS[0]
    block = GPT(config).blocks[0]
    x = torch.randn(2, 12, config.dim, requires_grad=True)
    with sdpa_kernel(SDPBackend.MATH), ActivationMeter(exclude=block.parameters()) as meter:
        block(x)
    flash = costs.activation_bytes_per_block(config, 2, 12)
    log_sum_exp = 2 * 12 * config.heads * 4
    assert meter.peak - flash == 2 * config.heads * 12 * 12 * 4 - log_sum_exp


def test_adamw_state_after_a_step_is_sixteen_bytes_a_parameter():
    task = RecallTask()
    model = lm.model_for(task, dim=32, layers=2, heads=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lm.lm_loss(model(task.sequences(2, 0)[0]), task.sequences(2, 0)[1]).backward()
    optimizer.step()
    held = sum(p.numel() * p.element_size() + p.grad.numel() * p.grad.element_size()
               for p in model.parameters())
    held += sum(t.numel() * t.element_size() for state in optimizer.state.values()
                for name, t in state.items() if name != "step")
    parameters = sum(p.numel() for p in model.parameters())
    assert held == costs.training_state_bytes(parameters) == 16 * parameters
    assert costs.training_state_bytes(10, shards=4) == 3 * 16  # a shard rounds up
    with pytest.raises(ValueError, match="shards must be >= 1"):
        costs.training_state_bytes(10, shards=0)


# ------------------------------------------------------------------ the task


def test_each_answer_is_the_value_paired_with_the_asked_key():
    task = RecallTask(pairs=5, queries=3)
    inputs, targets = task.sequences(50, seed=1)
    assert inputs.shape == targets.shape == (50, task.length)
    for row, target in zip(inputs.tolist(), targets.tolist(), strict=True):
        pairs = dict(zip(row[0:10:2], row[1:10:2], strict=True))
        assert len(pairs) == 5 and all(k < task.keys <= v for k, v in pairs.items())
        answers = [(i, t) for i, t in enumerate(target) if t != IGNORE]
        assert [i for i, _ in answers] == [10, 12, 14]
        assert all(pairs[row[i]] == t for i, t in answers)


def test_the_task_is_the_same_for_a_seed_and_differs_between_seeds():
    task = RecallTask()
    first, again, other = task.sequences(8, 3), task.sequences(8, 3), task.sequences(8, 4)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])
    data = RecallDataset(task, 8, 3)
    assert len(data) == 8 and torch.equal(data[5][0], first[0][5])


def test_a_bigram_model_cannot_solve_the_task():
    # the best guess of an answer from the asked key alone, learnt from 20,000 sequences
    task = RecallTask()
    inputs, targets = task.sequences(20_000, seed=0)
    counts = torch.zeros(task.vocab_size, task.vocab_size)
    scored = targets != IGNORE
    counts.index_put_((inputs[scored], targets[scored]), torch.ones(int(scored.sum())),
                      accumulate=True)
    held_in, held_out = task.sequences(2_000, seed=1)
    right = counts.argmax(1)[held_in[held_out != IGNORE]] == held_out[held_out != IGNORE]
    assert right.float().mean() < 2 / task.values  # chance is 1 / values


@pytest.mark.parametrize("sizes, message", [
    ({"pairs": 17}, "17 pairs need 17 distinct keys"),
    ({"queries": 5}, "5 distinct queries cannot come from 4 pairs"),
    ({"values": 0}, "RecallTask.values must be a whole number >= 1")])
def test_an_impossible_task_is_refused(sizes, message):
    with pytest.raises(ValueError, match=message):
        RecallTask(**sizes)


def test_a_global_batch_splits_into_equal_rank_shares():
    rows = torch.arange(12)
    assert lm.rank_rows([rows], 1, 3)[0].tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="does not split evenly over 5 ranks"):
        lm.rank_rows([rows], 0, 5)


# That the reference run learns the task (more than 90% of held-out sequences exactly
# right after 260 steps) is chapter 12's check on the reader's run (section 6, the same
# run), which nbval repeats in `make test`: a unit test here trained it a second time.


def test_next_token_loss_counts_answers():
    task = RecallTask()
    model = lm.model_for(task)
    cost = lm.next_token_loss(model, task.sequences(4, 0), torch.device("cpu"))
    assert int(cost.items) == 4 * task.queries and cost.unit == "answers"


# ---------------------------------------------------------------- the recipe's parts


def test_the_schedule_warms_up_holds_then_decays_to_zero():
    factors = [lr_factor(step, 100, 10) for step in range(101)]
    assert factors[0] == pytest.approx(1 / 11) and factors[9] == pytest.approx(10 / 11)
    assert set(factors[10:80]) == {1.0}
    assert factors[90] == pytest.approx(0.5) and factors[100] == 0.0


def test_the_run_settings_are_checked():
    with pytest.raises(ValueError, match="precision must be one of auto, float32"):
        GPTRun(precision="fp8")
    with pytest.raises(ValueError, match="checkpointing must be 'none' or 'block'"):
        GPTRun(checkpointing="all")
    with pytest.raises(ValueError, match="replicate must be a whole number >= 1"):
        GPTRun(replicate=0)
    assert compute_dtype("auto", torch.device("cpu")) == torch.float32
    assert compute_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_a_checkpoint_folder_is_resumed_only_by_the_run_that_wrote_it(tmp_path):
    (tmp_path / "step-000004").mkdir()
    with pytest.raises(ValueError, match="no run.json: it was not written by train_gpt"):
        check_resumable(tmp_path, GPTRun().resume_settings())
    (tmp_path / RUN_FILE).write_text(json.dumps(GPTRun(steps=40).resume_settings()))
    check_resumable(tmp_path, GPTRun(steps=40, replicate=2, precision="bfloat16").resume_settings())
    with pytest.raises(ValueError, match=r"\(steps 40 there, 300 now, seed 0 there, 1 now\)"):
        check_resumable(tmp_path, GPTRun(seed=1).resume_settings())
