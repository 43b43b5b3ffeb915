"""Chapter 07's distributed checkpoint (mgpu_helpers.labs.dcp's training, with the
checkpoint calls the chapter writes): saved by 4 FSDP2 ranks, loaded by 2 and by 4."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from mgpu_helpers import launch
from mgpu_helpers.labs import dcp as dcp_lab


def _checkpointable(model, optimizer):
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def _train(first_step, last_step, load_from=None, save_to=None, save_after=None,
           in_background=False):
    """The chapter's function, with a blocking save (``dcp.save``) to compare with."""
    model, optimizer = dcp_lab.sharded_mlp()
    loaded = None
    if load_from is not None:
        state = _checkpointable(model, optimizer)
        dcp.load(state, checkpoint_id=load_from)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        loaded = dcp_lab.full_weights(model)
    save_group = dist.new_group(backend="gloo") if save_to and in_background else None
    pending = None
    for step in range(first_step, last_step):
        dcp_lab.train_step(model, optimizer, step)
        if step + 1 == save_after:
            if in_background:
                pending = dcp.async_save(_checkpointable(model, optimizer),
                                         checkpoint_id=save_to, process_group=save_group)
            else:
                dcp.save(_checkpointable(model, optimizer), checkpoint_id=save_to)
    if pending is not None:
        pending.result()
    return dcp_lab.summary(model, optimizer, loaded)


@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
def test_a_checkpoint_of_4_sharded_ranks_resumes_on_2_and_on_4(tmp_path):
    checkpoint = str(tmp_path / "ckpt")
    straight = launch(_train, 0, 4, None, checkpoint, 2, nprocs=4, backend="gloo")
    on_four = launch(_train, 2, 4, checkpoint, nprocs=4, backend="gloo")
    on_two = launch(_train, 2, 4, checkpoint, nprocs=2, backend="gloo")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    assert straight["stored_shape"] == (16, 16) and on_two["stored_shape"] == (32, 16)
    # resharding on load is exact: 2 and 4 ranks read the same full state
    assert all(torch.equal(a, b) for a, b in zip(on_two["loaded"], on_four["loaded"],
                                                 strict=True))
    # the same layout resumes bitwise, weights and Adam's moments
    for key in ("weights", "moments"):
        assert all(torch.equal(a, b) for a, b in zip(on_four[key], straight[key], strict=True))
    # another layout resumes the same training, up to the order of the gradient sums
    assert max((a - b).abs().max().item()
               for a, b in zip(on_two["weights"], straight["weights"], strict=True)) < 1e-6
    # and the check can fail: two steps fewer is another model
    short = launch(_train, 0, 2, nprocs=2, backend="gloo")
    assert max((a - b).abs().max().item()
               for a, b in zip(short["weights"], straight["weights"], strict=True)) > 1e-3


@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
def test_a_checkpoint_written_in_the_background_holds_the_state_at_the_save(tmp_path):
    # training goes on for 2 steps while the background thread writes; the checkpoint
    # must still hold the state after step 2, as the blocking save's does
    blocking, background = str(tmp_path / "blocking"), str(tmp_path / "background")
    straight = launch(_train, 0, 4, None, blocking, 2, nprocs=2, backend="gloo")
    async_run = launch(_train, 0, 4, None, background, 2, True, nprocs=2, backend="gloo")
    assert all(torch.equal(a, b) for a, b in zip(async_run["weights"], straight["weights"],
                                                 strict=True))
    loaded = [launch(_train, 2, 2, path, nprocs=2, backend="gloo")["loaded"]
              for path in (blocking, background)]
    assert all(torch.equal(a, b) for a, b in zip(*loaded, strict=True))
    # and what it holds is step 2's state, not the end of training's
    assert not all(torch.equal(a, b) for a, b in zip(loaded[1], async_run["weights"],
                                                     strict=True))

