"""Chapter 10: reference solutions and plausible mistakes."""

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from mgpu_helpers.measure.memory import ActivationMeter
from mgpu_helpers.models.gpt import Block, GPTConfig
from mgpu_helpers.planning import costs
from mgpu_helpers.training.gpt_recipe import shard_model


def block_activation_bytes(batch, length, dim, heads, mlp_ratio, element_bytes):
    tokens = batch * length
    # 8 tensors as wide as the residual stream: the block's input, the two normalised
    # inputs, q, k, v, attention's output, the residual between attention and MLP;
    # 2 mlp_ratio times wider: the MLP's hidden layer before and after GELU
    stream = (8 + 2 * mlp_ratio) * dim * element_bytes
    # per token: two layer norms' mean and 1/std, and one float32 log-sum-exp per head
    return tokens * (stream + 4 * element_bytes + heads * 4)


def block_activation_bytes_for_ratio_four(batch, length, dim, heads, mlp_ratio,
                                          element_bytes):
    return batch * length * (16 * dim * element_bytes + 4 * element_bytes + heads * 4)


def block_activation_bytes_without_statistics(batch, length, dim, heads, mlp_ratio,
                                              element_bytes):
    return batch * length * (8 + 2 * mlp_ratio) * dim * element_bytes


def block_activation_bytes_qkv_inputs_thrice(batch, length, dim, heads, mlp_ratio,
                                             element_bytes):
    tokens = batch * length
    return tokens * ((10 + 2 * mlp_ratio) * dim * element_bytes + 4 * element_bytes + heads * 4)


def block_activation_bytes_log_sum_exp_in_element_bytes(batch, length, dim, heads, mlp_ratio,
                                                        element_bytes):
    tokens = batch * length
    return tokens * ((8 + 2 * mlp_ratio) * dim * element_bytes + (4 + heads) * element_bytes)


def block_activation_bytes_from_the_chapters_formula(batch, length, dim, heads, mlp_ratio,
                                                     element_bytes):
    config = GPTConfig(vocab_size=8, context=length, dim=dim, heads=heads, mlp_ratio=mlp_ratio)
    return costs.activation_bytes_per_block(config, batch, length, element_bytes)


def block_activation_bytes_measured(batch, length, dim, heads, mlp_ratio, element_bytes):
    dtype = torch.bfloat16 if element_bytes == 2 else torch.float32
    config = GPTConfig(vocab_size=8, context=length, dim=dim, heads=heads, mlp_ratio=mlp_ratio)
    block = Block(config).to(dtype)
    with ActivationMeter(exclude=block.parameters()) as meter:
        block(torch.randn(batch, length, dim, dtype=dtype, requires_grad=True))
    return meter.peak


def shard(model, mesh):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def shard_root_only(model, mesh):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def shard_every_linear(model, mesh):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def shard_reducing_in_bfloat16(model, mesh):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # reduce_dtype follows it
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def shard_without_a_policy(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def shard_with_the_chapters_helper(model, mesh):
    shard_model(model, mesh, torch.bfloat16)


def shard_on_the_shard_dimension_only(model, mesh):
    # on the HSDP mesh this shards within each replica group and never averages the
    # gradients across the groups
    group = mesh["fsdp"] if mesh.ndim == 2 else mesh
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=group, mp_policy=policy)
    fully_shard(model, mesh=group, mp_policy=policy)


REFERENCE = {"10.1": block_activation_bytes, "10.2": shard}
MISTAKES = {
    "10.1": [(block_activation_bytes_for_ratio_four, "fail", "expected"),
             (block_activation_bytes_without_statistics, "fail", "bytes per token missing"),
             (block_activation_bytes_qkv_inputs_thrice, "fail",
              "2 residual-stream-sized tensors too many"),
             (block_activation_bytes_log_sum_exp_in_element_bytes, "fail", "bytes per token"),
             (block_activation_bytes_from_the_chapters_formula, "fail",
              "called costs.activation_bytes_per_block"),
             (block_activation_bytes_measured, "fail", "called ActivationMeter")],
    "10.2": [(shard_root_only, "fail", "the FSDP units are the model"),
             (shard_every_linear, "fail", "expected one per block and the model"),
             (shard_reducing_in_bfloat16, "fail", "gradients were reduced in BFloat16"),
             (shard_without_a_policy, "fail", "expected torch.bfloat16"),
             (shard_with_the_chapters_helper, "fail",
              "called mgpu_helpers.training.gpt_recipe.shard_model"),
             (shard_on_the_shard_dimension_only, "fail", "expected (Replicate(), Shard(dim=0))")],
}
