"""Chapter 04: reference solutions and plausible mistakes."""

import math

import torch


def add_replica_grads(model, replicas):
    replica_params = [dict(replica.named_parameters()) for replica in replicas]
    for name, param in model.named_parameters():
        grads = [params[name].grad for params in replica_params
                 if params[name].grad is not None]
        if not grads:  # no replica used it: the module's gradient stays as it was
            continue
        total = sum(grad.to(param.device) for grad in grads)
        param.grad = total if param.grad is None else param.grad + total


def chunk_sizes(batch_size, n_devices):
    size = math.ceil(batch_size / n_devices)  # what torch.chunk gives each chunk
    return [min(size, batch_size - start) for start in range(0, batch_size, size)]


# Plausible mistakes -------------------------------------------------------------------

def add_replica_grads_averaged(model, replicas):
    """Averages the replicas' gradients, as the seed says DataParallel does."""
    for name, param in model.named_parameters():
        grads = [dict(r.named_parameters())[name].grad for r in replicas]
        grads = [g for g in grads if g is not None]
        if grads:
            total = sum(grads) / len(replicas)
            param.grad = total if param.grad is None else param.grad + total


def add_replica_grads_overwriting(model, replicas):
    """Replaces the module's gradient: what was accumulated before is lost."""
    for name, param in model.named_parameters():
        grads = [dict(r.named_parameters())[name].grad for r in replicas]
        grads = [g for g in grads if g is not None]
        if grads:
            param.grad = sum(grads)


def add_replica_grads_assuming_all(model, replicas):
    """Section 3's sum_gradients: every replica must have a gradient for every parameter."""
    for name, param in model.named_parameters():
        total = sum(dict(r.named_parameters())[name].grad.to(param.device) for r in replicas)
        param.grad = total if param.grad is None else param.grad + total


def add_replica_grads_zero_filled(model, replicas):
    """Gives every parameter a gradient, zeros where no replica computed one: a frozen
    layer then gets weight decay and momentum from the optimizer."""
    for name, param in model.named_parameters():
        total = torch.zeros_like(param)
        for replica in replicas:
            grad = dict(replica.named_parameters())[name].grad
            if grad is not None:
                total += grad
        param.grad = total if param.grad is None else param.grad + total


def add_replica_grads_resetting_unused(model, replicas):
    """Sets .grad to None where no replica has a gradient: what the module had
    accumulated from earlier micro-batches is lost."""
    for name, param in model.named_parameters():
        grads = [dict(r.named_parameters())[name].grad for r in replicas]
        grads = [g for g in grads if g is not None]
        if not grads:
            param.grad = None
            continue
        total = sum(grads)
        param.grad = total if param.grad is None else param.grad + total


def chunk_sizes_floor(batch_size, n_devices):
    """Equal shares by floor division: the remainder is lost."""
    return [batch_size // n_devices] * n_devices


def chunk_sizes_balanced(batch_size, n_devices):
    """The most even split (torch.tensor_split's): not what scatter does."""
    return [len(part) for part in torch.arange(batch_size).tensor_split(n_devices)
            if len(part)]


def chunk_sizes_every_device(batch_size, n_devices):
    """Chunk sizes of ceil(batch / devices), but a (possibly empty) chunk for every device."""
    size = math.ceil(batch_size / n_devices)
    return [max(0, min(size, batch_size - k * size)) for k in range(n_devices)]


REFERENCE = {"04.1": add_replica_grads, "04.2": chunk_sizes}
# exercise -> (wrong solution, the status it must get, a phrase its report must contain)
MISTAKES = {
    "04.1": [(add_replica_grads_averaged, "fail", "(0.5 times the expected)"),
             (add_replica_grads_overwriting, "fail", "values differ"),
             (add_replica_grads_assuming_all, "error", "'NoneType' object"),
             (add_replica_grads_zero_filled, "fail", "expected no gradient"),
             (add_replica_grads_resetting_unused, "fail", "aux_head.weight: expected a "
              "gradient, got None (it held an earlier micro-batch's gradient)")],
    "04.2": [(chunk_sizes_floor, "fail", "64 samples, not 65"),
             (chunk_sizes_balanced, "fail", "expected [17, 17, 17, 14], got [17, 16, 16, 16]"),
             (chunk_sizes_every_device, "fail", "3 devices get work")],
}
