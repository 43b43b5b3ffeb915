"""Chapter 13: reference solutions and plausible mistakes."""

import torch
import torch.distributed as dist


def dispatch(rows, destinations, group):
    world = dist.get_world_size(group)
    order = destinations.argsort(stable=True)
    counts = torch.bincount(destinations, minlength=world)
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts, group=group)
    out = rows.new_empty((int(incoming.sum()), rows.shape[1]))
    dist.all_to_all_single(out, rows[order].contiguous(), incoming.tolist(), counts.tolist(),
                           group=group)
    return out


def dispatch_gathering_every_count(rows, destinations, group):
    # every rank learns the whole count matrix (as Megatron-LM does), then one all-to-all
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    counts = torch.bincount(destinations, minlength=world)
    matrix = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(matrix, counts, group=group)
    incoming = [int(matrix[source][rank]) for source in range(world)]
    out = rows.new_empty((sum(incoming), rows.shape[1]))
    dist.all_to_all_single(out, rows[destinations.argsort(stable=True)].contiguous(), incoming,
                           counts.tolist(), group=group)
    return out


def dispatch_through_the_store(rows, destinations, group):
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    import pickle
    store.set(f"rows{rank}", pickle.dumps((rows, destinations)))
    pieces = [pickle.loads(store.get(f"rows{r}")) for r in range(world)]
    return torch.cat([r[d == rank] for r, d in pieces])


def dispatch_without_sorting(rows, destinations, group):
    world = dist.get_world_size(group)
    counts = torch.bincount(destinations, minlength=world)
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts, group=group)
    out = rows.new_empty((int(incoming.sum()), rows.shape[1]))
    dist.all_to_all_single(out, rows.contiguous(), incoming.tolist(), counts.tolist(),
                           group=group)
    return out


def dispatch_by_gathering_everything(rows, destinations, group):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    pieces = [None] * world
    dist.all_gather_object(pieces, (rows, destinations), group=group)
    return torch.cat([r[d == rank] for r, d in pieces])


def dispatch_with_an_unstable_sort(rows, destinations, group):
    world = dist.get_world_size(group)
    order = torch.sort(destinations, descending=True).indices.flip(0)  # reverses ties
    counts = torch.bincount(destinations, minlength=world)
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts, group=group)
    out = rows.new_empty((int(incoming.sum()), rows.shape[1]))
    dist.all_to_all_single(out, rows[order].contiguous(), incoming.tolist(), counts.tolist(),
                           group=group)
    return out


def load_balancing_loss(probabilities, chosen):
    experts = probabilities.shape[-1]
    share = torch.bincount(chosen.flatten(), minlength=experts).float() / chosen.numel()
    return experts * (share * probabilities.mean(0)).sum()


def loss_sharing_over_tokens(probabilities, chosen):
    experts = probabilities.shape[-1]
    share = torch.bincount(chosen.flatten(), minlength=experts).float() / chosen.shape[0]
    return experts * (share * probabilities.mean(0)).sum()


def loss_without_the_factor(probabilities, chosen):
    share = torch.bincount(chosen.flatten(), minlength=probabilities.shape[-1]).float()
    return (share / chosen.numel() * probabilities.mean(0)).sum()


def loss_without_minlength(probabilities, chosen):
    experts = probabilities.shape[-1]
    share = torch.bincount(chosen.flatten()).float() / chosen.numel()  # short if one is idle
    return experts * (share * probabilities.mean(0)).sum()


def loss_detached(probabilities, chosen):
    return load_balancing_loss(probabilities.detach(), chosen)


def loss_with_the_probabilities_as_shares(probabilities, chosen):
    experts = probabilities.shape[-1]
    mean = probabilities.mean(0)
    return experts * (mean * mean).sum()


REFERENCE = {"13.1": dispatch, "13.2": load_balancing_loss}
ALTERNATIVES = {"13.1": [dispatch_gathering_every_count]}
MISTAKES = {
    "13.1": [(dispatch_without_sorting, "fail", "each source's in its own order"),
             (dispatch_by_gathering_everything, "fail", "each row must go only"),
             (dispatch_through_the_store, "fail", "outside the collectives"),
             (dispatch_with_an_unstable_sort, "fail", "expected rank")],
    "13.2": [(loss_sharing_over_tokens, "fail", "not of the tokens"),
             (loss_without_the_factor, "fail", "multiplied by E"),
             (loss_detached, "fail", "no gradient"),
             (loss_without_minlength, "error", "must match the size"),
             (loss_with_the_probabilities_as_shares, "fail", "expected")],
}
