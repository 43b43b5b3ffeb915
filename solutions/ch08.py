"""Chapter 08: reference solutions and plausible mistakes."""

import io
import math
import os
from pathlib import Path

import torch


def save_atomically(state, path):
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def batch_plan(global_batch, world, limit):
    if global_batch % world:
        raise ValueError(f"a global batch of {global_batch} cannot be split evenly "
                         f"between {world} ranks")
    per_rank = global_batch // world
    micro = max(d for d in range(1, min(per_rank, limit) + 1) if per_rank % d == 0)
    return micro, per_rank // micro


# Plausible mistakes -------------------------------------------------------------------

def save_atomically_in_place(state, path):
    """Writes straight onto the checkpoint: a failed save leaves a broken file."""
    torch.save(state, path)


def save_atomically_leaving_the_temporary(state, path):
    """Replaces atomically, but a failed save leaves its temporary file behind."""
    temporary = Path(path).with_name("checkpoint.pt.tmp")
    torch.save(state, temporary)
    os.replace(temporary, path)


def save_atomically_swallowing_the_error(state, path):
    """Keeps the old checkpoint, but the caller never learns the save failed."""
    try:
        save_atomically(state, path)
    except OSError:
        pass


def batch_plan_ignoring_the_world(global_batch, world, limit):
    """Splits the global batch as if one rank processed all of it."""
    micro = max(d for d in range(1, min(global_batch, limit) + 1) if global_batch % d == 0)
    return micro, global_batch // micro


def batch_plan_rounding_down(global_batch, world, limit):
    """Never raises: integer division drops samples when the ranks cannot share evenly."""
    per_rank = global_batch // world
    micro = min(per_rank, limit)
    return micro, per_rank // micro


def save_atomically_through_memory(state, path):
    """Serialises into memory first, then writes the bytes over the checkpoint: a crash
    during that write still leaves a half-written file."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    Path(path).write_bytes(buffer.getvalue())


def batch_plan_rounding_the_steps_up(global_batch, world, limit):
    """Steps = ceil(per-rank batch / limit), micro-batch = per-rank batch // steps: drops
    samples when the steps do not divide the per-rank batch."""
    if global_batch % world:
        raise ValueError(f"a global batch of {global_batch} cannot be split evenly "
                         f"between {world} ranks")
    per_rank = global_batch // world
    steps = math.ceil(per_rank / limit)
    return per_rank // steps, steps


REFERENCE = {"08.1": save_atomically, "08.2": batch_plan}
MISTAKES = {
    "08.1": [(save_atomically_in_place, "fail", "previous checkpoint is lost"),
             (save_atomically_leaving_the_temporary, "fail", "remove what the save leaves"),
             (save_atomically_swallowing_the_error, "fail", "no exception reached"),
             (save_atomically_through_memory, "fail", "it was rewritten in place")],
    "08.2": [(batch_plan_ignoring_the_world, "fail", "expected (micro-batch per rank"),
             (batch_plan_rounding_down, "fail", "expected a ValueError"),
             (batch_plan_rounding_the_steps_up, "fail", "world x micro-batch x steps = "
                                                        "2 x 4 x 3 = 24, not 28")],
}
