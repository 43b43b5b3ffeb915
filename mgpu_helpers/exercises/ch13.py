"""Chapter 13's exercises: dispatching rows to the ranks that asked for them (the all-to-all
of expert parallelism), and the load-balancing loss of top-k routing."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from ..labs.comm_log import CollectivesLogged
from ..measure.traffic import sends_counted, traffic_measured
from .core import Case, Exercise, largest_abs

# ------------------------------------------------------------------- 13.1 dispatch

WIDTH = 16  # features per row: 64 bytes, more than any rank's counts


def _my_routing(world: int, rank: int, kind: str):
    """This rank's rows and destinations, drawn from its own ``os.urandom`` seed: no other
    rank, and nothing in the checker's frames, knows them while the reader's code runs.
    Rank r's rows hold r * 1000 + their index, so a row in the wrong place names where it
    came from."""
    generator = torch.Generator().manual_seed(random.SystemRandom().getrandbits(63))
    count = int(torch.randint(2, 9, (), generator=generator))
    if kind == "someone sends nothing" and rank == world - 1:
        count = 0
    values = rank * 1000 + torch.arange(count, dtype=torch.float32)
    rows = values[:, None].repeat(1, WIDTH) + torch.arange(WIDTH) / 100
    targets = torch.randint(world, (count,), generator=generator)
    if kind == "someone gets nothing":
        targets = targets.clamp(max=world - 2)  # the last rank receives nothing
    return rows, targets


def _dispatch_trial(fn, kind: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    rows, destinations = _my_routing(world, rank, kind)
    mine = rows.clone(), destinations.clone()
    with traffic_measured() as traffic, CollectivesLogged() as logged, \
            sends_counted() as sent:
        result = fn(rows, destinations, dist.group.WORLD)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)  # the checker's own, after the call
    expected = torch.cat([r[d == rank] for r, d in everyone])
    carried = [(kind_, size) for kind_, size in logged.calls if kind_ not in ("send", "recv")]
    return ({"result": result, "carried": carried,
             "bytes": sum(size for _, size in carried) + sum(size for _, size in sent),
             "store": traffic.store_calls, "side channels": traffic.side_channels},
            {"rows": expected, "rank": rank, "world": world,
             "limit": mine[0].numel() * 4 + 64 * world})  # its rows, and the counts


def _dispatch_judge(got, expected) -> str | None:
    where = f"rank {expected['rank']} of {expected['world']}"
    if got["store"] or got["side channels"]:
        used = ", ".join(got["store"] + got["side channels"])
        return (f"{where}: your function passed data outside the collectives ({used}); "
                "send the rows with all_to_all_single")
    # a collective other than all-to-all may carry counts, never a row's worth of data
    broadcasting = sorted({k for k, size in got["carried"]
                           if k != "all_to_all" and size >= WIDTH * 4})
    if broadcasting:
        return (f"{where}: your function sent rows with {', '.join(broadcasting)}; each row "
                "must go only to its destination: all_to_all_single, with the sizes "
                "exchanged first")
    if got["bytes"] > expected["limit"]:
        return (f"{where}: your collectives carried {got['bytes']:,} bytes from this rank; its "
                f"rows and the counts take at most {expected['limit']:,}")
    result, right = got["result"], expected["rows"]
    if not isinstance(result, torch.Tensor):
        return f"{where}: expected a tensor of rows, got {type(result).__name__}"
    if tuple(result.shape) != tuple(right.shape):
        return (f"{where}: expected {len(right)} rows of {WIDTH} (every row sent here), got "
                f"shape {tuple(result.shape)}")
    if not torch.equal(result, right):
        first = (result != right).any(1).nonzero()[0].item()
        came = int(result[first, 0].item()) if result[first, 0].item() >= 0 else None
        source = f"rank {came // 1000}'s row {came % 1000}" if came is not None else "nothing"
        return (f"{where}: row {first} is {source}; expected rank "
                f"{int(right[first, 0]) // 1000}'s row {int(right[first, 0]) % 1000} (rows by "
                "source rank, each source's in its own order)")
    return None


# ------------------------------------------------------ 13.2 the load-balancing loss


def _loss_inputs(kind: str):
    generator = torch.Generator().manual_seed(random.SystemRandom().getrandbits(63))
    experts = int(torch.randint(3, 9, (), generator=generator))
    tokens = int(torch.randint(5, 40, (), generator=generator))
    top_k = 1 if kind == "top 1" else int(torch.randint(2, experts, (), generator=generator))
    logits = torch.randn(tokens, experts, generator=generator)
    if kind == "an idle expert":
        logits[:, -1] -= 30  # the last expert never chosen: bincount needs minlength
    return logits, top_k


def _balancing_reference(probabilities, chosen):
    experts = probabilities.shape[-1]
    share = torch.bincount(chosen.flatten(), minlength=experts).float() / chosen.numel()
    return experts * (share * probabilities.mean(0)).sum()


def _loss_trial(fn, kind: str):
    logits, top_k = _loss_inputs(kind)
    mine = logits.clone().requires_grad_()
    probabilities = mine.softmax(-1)
    chosen = probabilities.detach().topk(top_k, -1).indices
    value = fn(probabilities, chosen.clone())
    gradient = None
    if isinstance(value, torch.Tensor) and value.requires_grad and value.numel() == 1:
        gradient = torch.autograd.grad(value.sum(), mine)[0]
    whole = logits.clone().requires_grad_()
    expected = _balancing_reference(whole.softmax(-1), chosen)
    return ({"value": value, "gradient": gradient},
            {"value": expected.detach(), "gradient": torch.autograd.grad(expected, whole)[0],
             "top_k": top_k, "experts": logits.shape[1]})


def _loss_judge(got, expected) -> str | None:
    value = got["value"]
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        return f"expected a scalar tensor, got {type(value).__name__}"
    right = expected["value"].item()
    if abs(value.item() - right) > 1e-5 * max(1.0, abs(right)):
        ratio = value.item() / right if right else float("nan")
        why = ""
        if abs(ratio - expected["top_k"]) < 1e-4:
            why = ": f_e is a share of the tokens x k assignments, not of the tokens"
        elif abs(ratio * expected["experts"] - 1) < 1e-4:
            why = ": the sum is multiplied by E, the number of experts"
        return f"the loss is {value.item():.6g}, expected {right:.6g}{why}"
    if got["gradient"] is None:
        return ("the loss has no gradient with respect to the probabilities: P_e must be "
                "their mean, computed with torch operations, not detached")
    if not torch.allclose(got["gradient"], expected["gradient"], rtol=1e-5, atol=1e-7):
        return (f"the gradient differs from the formula's by up to "
                f"{largest_abs(got['gradient'] - expected['gradient']):.3g}: f_e (the counts) "
                "carries no gradient; P_e (the mean probability) does")
    return None


EXERCISES = [
    Exercise(
        key="13.1", difficulty=2, minutes=30,
        title="dispatch: rows to the ranks that asked for them", function="dispatch",
        cases=[Case("2 ranks, routing drawn afresh", ("random",), 2),
               Case("3 ranks, one sends nothing", ("someone sends nothing",), 3),
               Case("4 ranks, one receives nothing", ("someone gets nothing",), 4)],
        trial=_dispatch_trial, judge=_dispatch_judge,
        hint=("sort the rows by destination (a stable sort keeps each destination's rows in "
              "order) and count them per destination: torch.bincount(destinations, "
              "minlength=world)",
              "one all_to_all_single of the counts tells each rank how many rows it gets from "
              "each other; a second one, with those output and input split sizes, moves the "
              "rows"),
    ),
    Exercise(
        key="13.2", difficulty=1, minutes=15,
        title="the load-balancing loss for top-k routing", function="load_balancing_loss",
        cases=[Case("sizes drawn afresh", ("random",)), Case("top 1", ("top 1",)),
               Case("an expert no token chose", ("an idle expert",))],
        trial=_loss_trial, judge=_loss_judge,
        hint=("f_e: torch.bincount(chosen.flatten(), minlength=E) over chosen.numel(); P_e: "
              "probabilities.mean(0); the loss: E times the sum of their products"),
    ),
]
