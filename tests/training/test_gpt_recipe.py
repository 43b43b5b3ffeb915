"""Chapter 10's FSDP2 recipe (mgpu_helpers.training.gpt_recipe, scripts/train_gpt.py): the same
losses as one process, a resume equal bit for bit to the uninterrupted run, on another
number of ranks too, and refused for another run's settings, one gradient reduction per
step under accumulation, a gradient scaler that skips a step on every rank together, and
the script under torchrun."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from mgpu_helpers import launch
from mgpu_helpers.launcher import LaunchError
from mgpu_helpers.measure.flight_recorder import collectives_so_far
from mgpu_helpers.runtime.ranks import rank, world_size
from mgpu_helpers.runtime.topology import ParallelDims
from mgpu_helpers.training import lm
from mgpu_helpers.training.checkpoints import load, save
from mgpu_helpers.training.gpt_recipe import GPTRun, lr_factor, shard_model, train_gpt

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "train_gpt.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
QUICK = {"steps": 6, "global_batch": 16, "dim": 32, "heads": 2}

pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.slow]


def reference_losses(run: GPTRun) -> list[float]:
    return lm.train_reference(
        run.task, run.steps, run.global_batch, lr=run.lr, seed=run.seed,
        schedule=lambda step: lr_factor(step, run.steps, run.warmup), dim=run.dim,
        heads=run.heads)[1]


@pytest.mark.parametrize("nprocs, settings", [
    (2, {}), (2, {"accumulate": 2, "checkpointing": "block"}), (4, {"replicate": 2})],
    ids=["fsdp2", "accumulate-and-recompute", "hsdp"])
def test_fsdp2_and_hsdp_follow_the_one_process_run(nprocs, settings):
    run = GPTRun(**QUICK, **settings)
    # CPU check: gloo ranks, float32, the same arithmetic as the reference on any machine
    result = launch(train_gpt, run, nprocs=nprocs, backend="gloo")
    expected = reference_losses(run)
    # float32 sums in another order (per rank, then across ranks): a few ulps apart
    assert result["losses"] == pytest.approx(expected, rel=1e-5)
    assert result["mesh"] == ({"dp": 2, "fsdp": 2} if "replicate" in settings
                              else {"fsdp": nprocs})


def shard_with_bfloat16_weights(model, mesh, param_dtype):
    """A wrapping step that ignores the run's dtype: its effect shows in the losses."""
    shard_model(model, mesh, torch.bfloat16)


def test_train_gpt_applies_the_wrapping_step_it_is_given():
    run = GPTRun(**QUICK)
    # CPU check: gloo ranks; float32 follows the reference within 1e-5 (test above),
    # bfloat16 weights cannot, so the losses tell which step sharded the model
    result = launch(train_gpt, run, shard_with_bfloat16_weights, nprocs=2, backend="gloo")
    expected = reference_losses(run)
    assert result["losses"] != pytest.approx(expected, rel=1e-5)
    assert result["losses"] == pytest.approx(expected, rel=1e-2)
    with pytest.raises(TypeError, match=r"shard must be a function shard\(model, mesh"):
        train_gpt(run, shard="fsdp2")


def test_a_resumed_run_ends_bit_for_bit_where_the_uninterrupted_one_does(tmp_path):
    settings = {**QUICK, "steps": 10, "save_every": 4, "accumulate": 2}
    # CPU checks: gloo ranks, so that "bit for bit" means the same on every machine
    whole = launch(train_gpt, GPTRun(**settings), nprocs=2, backend="gloo", return_all=True)
    first = launch(train_gpt, GPTRun(**settings, checkpoint=tmp_path, stop_after=7),
                   nprocs=2, backend="gloo", return_all=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "step-000004"]
    rest = launch(train_gpt, GPTRun(**settings, checkpoint=tmp_path), nprocs=2,
                  backend="gloo", return_all=True)
    assert first[0]["losses"] == whole[0]["losses"][:7]
    assert rest[0]["resumed_at"] == 4 and rest[0]["losses"] == whole[0]["losses"][4:]
    assert [r["state_digest"] for r in rest] == [r["state_digest"] for r in whole]
    assert rest[0]["lr_at_end"] == whole[0]["lr_at_end"] == 0.0
    # the newest two complete checkpoints are kept, older ones deleted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "step-000008",
                                                          "step-000010"]


def test_a_checkpoint_resumes_on_other_ranks_and_refuses_another_run(tmp_path):
    settings = {**QUICK, "steps": 8, "save_every": 4}
    # CPU checks: gloo ranks, float32 on every machine
    launch(train_gpt, GPTRun(**settings, checkpoint=tmp_path, stop_after=4), nprocs=2,
           backend="gloo")
    # 4 ranks as HSDP (2 x 2) read what 2 FSDP2 ranks wrote: DCP reshards on load
    rest = launch(train_gpt, GPTRun(**settings, checkpoint=tmp_path, replicate=2), nprocs=4,
                  backend="gloo")
    assert rest["resumed_at"] == 4 and rest["mesh"] == {"dp": 2, "fsdp": 2}
    assert rest["losses"] == pytest.approx(reference_losses(GPTRun(**settings))[4:], rel=1e-5)
    with pytest.raises(LaunchError, match=r"another run \(lr 0.002 there, 0.001 now\)"):
        launch(train_gpt, GPTRun(**settings, lr=1e-3, checkpoint=tmp_path), nprocs=2,
               backend="gloo")


def random_numbers_after_a_resume(folder: Path) -> tuple[bool, list[float]]:
    """Save, draw on, restore: whether the draws after the restore repeat those after the
    save (what dropout would draw), and the first of them."""
    model = lm.model_for(GPTRun().task, dim=32, heads=2)
    shard_model(model, ParallelDims(fsdp=world_size()).build_mesh("cpu"), torch.float32)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    torch.manual_seed(100 + rank())  # each rank a stream of its own
    saved = save(folder, 1, model, optimizer, scheduler, GPTRun().resume_settings())
    after_save = torch.rand(4)
    torch.rand(10)  # the run goes on, and is restarted
    load(saved, model, optimizer, scheduler)
    return torch.equal(torch.rand(4), after_save), after_save.tolist()


def test_each_rank_resumes_its_own_random_stream(tmp_path):
    # CPU check: gloo ranks and the CPU generator, on every machine
    outcome = launch(random_numbers_after_a_resume, tmp_path, nprocs=2, backend="gloo",
                     return_all=True)
    assert [same for same, _ in outcome] == [True, True]
    assert outcome[0][1] != outcome[1][1]


def reductions_per_micro_batch(sync_every_micro_batch: bool) -> list[int]:
    """Two micro-batches of one step; the gradient reductions each backward pass ran."""
    model = lm.model_for(GPTRun(**QUICK).task, dim=32, heads=2)
    shard_model(model, ParallelDims(fsdp=world_size()).build_mesh("cpu"), torch.float32)
    inputs, targets = lm.rank_rows(lm.step_batch(GPTRun().task, 0, 16), rank(), world_size())
    counts = []
    for micro, rows in enumerate((slice(0, 4), slice(4, 8))):
        model.set_requires_gradient_sync(sync_every_micro_batch or micro == 1)
        before = len(collectives_so_far())
        lm.lm_loss(model(inputs[rows]), targets[rows]).backward()
        # gloo runs FSDP2's reduce-scatter as an all-reduce
        counts.append(sum(e["profiling_name"] == "gloo:all_reduce"
                          for e in collectives_so_far()[before:]))
    return counts


def test_accumulation_reduces_the_gradients_once_per_step():
    # CPU check: the flight recorder reads gloo groups
    # 3 FSDP units (2 blocks and the root): one reduction each, after the last micro-batch
    assert launch(reductions_per_micro_batch, False, nprocs=2, backend="gloo") == [0, 3]
    assert launch(reductions_per_micro_batch, True, nprocs=2, backend="gloo") == [3, 3]


def skipped_together(poisoned_rank: int) -> dict:
    """One float16 step in which only ``poisoned_rank``'s gradient shard holds an inf."""
    run = GPTRun(**QUICK)
    model = lm.model_for(run.task, dim=run.dim, heads=run.heads)
    shard_model(model, ParallelDims(fsdp=world_size()).build_mesh("cpu"), torch.float16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    inputs, targets = lm.rank_rows(lm.step_batch(run.task, 0, 16), rank(), world_size())
    scaler.scale(lm.lm_loss(model(inputs), targets)).backward()
    if rank() == poisoned_rank:
        next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("inf")
    before = [p.to_local().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    unchanged = all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters(),
                                                                 strict=True))
    return {"unchanged": unchanged, "scale": scaler.get_scale(),
            "sharded": all(isinstance(p, DTensor) for p in model.parameters())}


def test_the_gradient_scaler_skips_a_step_on_every_rank_when_one_shard_overflows():
    # float16 weights need a GradScaler; with sharded gradients an overflow may sit in
    # one rank's shard only, and every rank must still skip the same step
    outcome = launch(skipped_together, 1, nprocs=2, backend="gloo", return_all=True)
    assert all(r["sharded"] for r in outcome)
    assert [r["unchanged"] for r in outcome] == [True, True]
    assert [r["scale"] for r in outcome] == [512.0, 512.0]


def test_the_script_under_torchrun_resumes_and_matches_a_launched_run(tmp_path, capsys):
    # The launched runs call the script's main in this process (launch starts the ranks,
    # one intra-op thread each); the resume runs the script under torchrun.
    main = runpy.run_path(SCRIPT)["main"]
    options = ["--steps", "8", "--global-batch", "16", "--dim", "32", "--heads", "2",
               "--save-every", "4"]
    main(["--nprocs", "2", *options, "--checkpoint", str(tmp_path / "a"),
          "--result", str(tmp_path / "a.json")])
    main(["--nprocs", "2", *options, "--checkpoint", str(tmp_path / "b"), "--stop-after", "6"])
    output = capsys.readouterr().out
    assert "saved" in output and "step-000004" in output
    # one intra-op thread, as launch() gives its ranks: bitwise equality needs the same
    done = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", SCRIPT, *options,
                           "--checkpoint", str(tmp_path / "b"),
                           "--result", str(tmp_path / "b.json")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "resumed from" in output and "at step 4" in output
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [
        "run.json", "step-000004", "step-000008"]  # saved under torchrun too
    whole, resumed = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    assert resumed["resumed_at"] == 4 and resumed["losses"] == whole["losses"][4:]
    assert resumed["state_digest"] == whole["state_digest"]
    # the finished run again: nothing left to train, and it says so
    main(["--nprocs", "2", *options, "--checkpoint", str(tmp_path / "a")])
    assert "nothing to train: the checkpoint is at step 8 of 8" in capsys.readouterr().out
