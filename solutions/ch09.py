"""Chapter 09: reference solutions and plausible mistakes."""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def epoch_mean_loss(local_losses):
    total = torch.tensor([sum(local_losses), len(local_losses)], dtype=torch.float64)
    dist.all_reduce(total)  # every rank, not only the one that prints
    return (total[0] / total[1]).item()


def average_metrics(metrics):
    names = sorted(metrics)  # the same order on every rank
    values = torch.tensor([metrics[name] for name in names], dtype=torch.float64)
    dist.all_reduce(values)
    values /= dist.get_world_size()
    return dict(zip(names, values.tolist(), strict=True))


def train_on_uneven_batches(model, optimizer, batches):
    count = torch.tensor([len(batches)])
    dist.all_reduce(count, op=dist.ReduceOp.MIN)  # every rank runs the smallest count
    for inputs, targets in batches[:int(count)]:
        optimizer.zero_grad()
        F.mse_loss(model(inputs), targets).backward()
        optimizer.step()


# Plausible mistakes -------------------------------------------------------------------

def _global_mean(values):
    total = torch.tensor([sum(values), len(values)], dtype=torch.float64)
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def epoch_mean_loss_as_shipped(local_losses):
    """The bug of the task: only rank 0 calls the all-reduce."""
    mean = None
    if dist.get_rank() == 0:
        mean = _global_mean(local_losses)
        print(f"mean loss {mean:.4f}")
    return mean


def epoch_mean_loss_of_the_ranks_means(local_losses):
    """No hang, but each rank's mean counts the same, whatever its number of samples."""
    mean = torch.tensor([sum(local_losses) / len(local_losses)], dtype=torch.float64)
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def average_metrics_as_shipped(metrics):
    """The bug of the task: one all-reduce per metric, in each rank's own dict order."""
    averaged = {}
    for name, value in metrics.items():
        tensor = torch.tensor([value])
        dist.all_reduce(tensor)
        averaged[name] = tensor.item() / dist.get_world_size()
    return averaged


def train_on_rank_0s_count(model, optimizer, batches):
    """Every rank runs rank 0's count: a rank with fewer batches runs out."""
    count = torch.tensor([len(batches)])
    dist.broadcast(count, src=0)
    for i in range(int(count)):
        inputs, targets = batches[i]
        optimizer.zero_grad()
        F.mse_loss(model(inputs), targets).backward()
        optimizer.step()


def train_with_join(model, optimizer, batches):
    """No hang, but a different training: the ranks that finish early shadow the others'
    steps with zero gradients, and the extra batches are trained on."""
    from torch.distributed.algorithms import Join

    with Join([model]):
        for inputs, targets in batches:
            optimizer.zero_grad()
            F.mse_loss(model(inputs), targets).backward()
            optimizer.step()


# Other correct solutions --------------------------------------------------------------

def epoch_mean_loss_as_a_tensor(local_losses):
    """Returns the mean as a float64 tensor of no dimensions."""
    total = torch.tensor([sum(local_losses), len(local_losses)], dtype=torch.float64)
    dist.all_reduce(total)
    return total[0] / total[1]


def average_metrics_in_numpy(metrics):
    """Returns NumPy float32 scalars: numbers like any other."""
    import numpy as np

    return {name: np.float32(value) for name, value in average_metrics(metrics).items()}


REFERENCE = {"09.1": epoch_mean_loss, "09.2": average_metrics, "09.3": train_on_uneven_batches}
# exercise -> other correct solutions, which must pass too
ALTERNATIVES = {"09.1": [epoch_mean_loss_as_a_tensor], "09.2": [average_metrics_in_numpy]}
# exercise -> (wrong solution, the status it must get, a phrase its report must contain)
MISTAKES = {
    "09.1": [(epoch_mean_loss_as_shipped, "hang", "never comes"),
             (epoch_mean_loss_of_the_ranks_means, "fail", "expected the mean loss")],
    "09.2": [(average_metrics_as_shipped, "fail", "averages over the ranks: 'loss' expected")],
    "09.3": [(train_on_rank_0s_count, "error", "IndexError"),
             (train_with_join, "fail", "the weights differ")],
}
