"""Distributed checkpoints that resume exactly: chapter 10's recipe saves and resumes with
these, and any sharded training can.

* every rank writes its own shards with ``torch.distributed.checkpoint`` (DCP), through
  ``get_state_dict``/``set_state_dict`` (the model's and AdamW's state as sharded tensors),
  with the learning-rate scheduler and the step;
* into a temporary folder, renamed ``step-NNNNNN`` once every rank has finished: a run
  killed while saving leaves no half checkpoint; the newest :data:`KEEP_CHECKPOINTS` are
  kept;
* each rank's random state (CPU, and GPU where there is one) in a file of its own beside
  DCP's: it belongs to the rank, not to a tensor DCP could reshard;
* ``run.json`` records the settings a resumed run must share; another run's are refused.

A checkpoint loads on another number of ranks: DCP reshards the tensors, and the random
states, which belong to ranks that no longer exist, are then not restored. The folder
must be on a filesystem every rank sees (DCP's file writer needs one).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..runtime.ranks import rank, world_size

KEEP_CHECKPOINTS = 2
RUN_FILE = "run.json"


def _step_folder(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def latest_checkpoint(root: Path | None) -> Path | None:
    """The newest complete checkpoint folder under ``root`` (temporary ones ignored)."""
    if root is None or not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
    return done[-1] if done else None


def check_resumable(root: Path, settings: dict) -> None:
    """Refuse to resume from ``root`` a run whose ``settings`` (its model, data and
    schedule) differ from those of the run that saved there (its ``run.json``): it would
    continue someone else's training."""
    saved_file = root / RUN_FILE
    if not saved_file.is_file():
        raise ValueError(f"{root} holds checkpoints but no {RUN_FILE}: it was not written "
                         "by train_gpt. Give another --checkpoint folder.")
    saved = json.loads(saved_file.read_text())
    differ = {name: (saved.get(name), value) for name, value in settings.items()
              if saved.get(name) != value}
    if differ:
        shown = ", ".join(f"{name} {was!r} there, {now!r} now"
                          for name, (was, now) in differ.items())
        raise ValueError(f"the checkpoints in {root} are of another run ({shown}). Run with "
                         f"the same settings to resume it, or give another --checkpoint "
                         f"folder (or delete {root}) to start afresh.")


def newest_to_resume(root: Path, settings: dict) -> Path | None:
    """Rank 0 picks the checkpoint to resume (after :func:`check_resumable`) and every rank
    gets its choice, or its refusal, so that no two ranks read different folders."""
    choice = [None, None]
    if rank() == 0:
        try:
            latest = latest_checkpoint(root)
            if latest is not None:
                check_resumable(root, settings)
                choice[0] = str(latest)
        except ValueError as refused:
            choice[1] = str(refused)
    dist.broadcast_object_list(choice, src=0)
    if choice[1] is not None:
        raise ValueError(choice[1])
    return None if choice[0] is None else Path(choice[0])


def _random_state_file(folder: Path) -> Path:
    return folder / f"random-state-rank{rank()}-of-{world_size()}.pt"


def random_state() -> dict:
    """This process's random state: the CPU generator's, and the GPU's where there is one."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_random_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def save(root: Path, step: int, model, optimizer, scheduler, settings: dict) -> Path:
    """Every rank writes its shards; the folder appears, renamed, once all have. The
    newest :data:`KEEP_CHECKPOINTS` complete folders are kept, older ones deleted (rank 0
    renames and deletes: the folder is on a filesystem every rank sees). The first save
    writes ``settings`` to ``run.json``."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state,
             "scheduler": scheduler.state_dict(), "step": step}
    final = _step_folder(root, step)
    temporary = final.with_name(final.name + ".tmp")
    if rank() == 0:
        shutil.rmtree(temporary, ignore_errors=True)  # left by a killed save
        if not (root / RUN_FILE).is_file():
            root.mkdir(parents=True, exist_ok=True)
            (root / RUN_FILE).write_text(json.dumps(settings, indent=1) + "\n")
    dist.barrier()
    dcp.save(state, checkpoint_id=temporary)
    # a rank's random state is its own, not a shard of anything: a file per rank, beside
    # DCP's (one DCP key per rank would be a key the next run may not have)
    torch.save(random_state(), _random_state_file(temporary))
    dist.barrier()
    if rank() == 0:
        temporary.rename(final)
        for older in sorted(p for p in root.glob("step-*") if p.is_dir()
                            and not p.name.endswith(".tmp"))[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(older)  # the newer ones are complete: nothing is lost
    dist.barrier()
    return final


def load(folder: Path, model, optimizer, scheduler) -> int:
    """Restore what :func:`save` wrote into ``model`` and ``optimizer`` (sharded as they
    are now, on any number of ranks) and ``scheduler``; returns the step to continue
    from. ``get_state_dict`` gives the structure to fill: on an optimizer that has not
    stepped yet it first runs a step with zero gradients and a zero learning rate, which
    allocates AdamW's moments and changes no weight."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state,
             "scheduler": scheduler.state_dict(), "step": 0}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    mine = _random_state_file(folder)
    if mine.is_file():  # the same number of ranks as the run that saved
        set_random_state(torch.load(mine, weights_only=True))
    return state["step"]


def state_digest(model, optimizer) -> str:
    """A fingerprint of this rank's shards of the weights and of AdamW's state, bit for
    bit: two runs that end with equal digests on every rank ended in the same state."""
    digest = hashlib.sha256()
    tensors = [p.to_local() for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [value.to_local() if hasattr(value, "to_local") else value
                    for _, value in sorted(state.items())]
    for tensor in tensors:
        digest.update(tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
