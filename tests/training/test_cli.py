"""Options derived from a dataclass's fields (mgpu_helpers.training.cli), and scripts/train_ddp.py's
command line, which is derived that way and must stay what it was."""

from __future__ import annotations

import argparse
import runpy
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mgpu_helpers.training.cli import add_options, from_options
from mgpu_helpers.training.recipe import DigitsRun

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Settings:
    steps: int = 3
    rate: float = 0.5
    out: Path | None = None
    max_len: int | None = None
    mode: str | None = field(default=None, metadata={"choices": ("fast", "slow"),
                                                       "help": "how to run"})
    name: str = "run"
    verbose: bool = True

    def __post_init__(self):
        if self.max_len is not None and self.max_len < 1:
            raise ValueError(f"max_len must be None or >= 1, got {self.max_len}")


OPTIONS = ("steps", "rate", "out", "max_len", "mode", "name")


def parse(argv, defaults=None):
    parser = argparse.ArgumentParser(prog="tool")
    add_options(parser, Settings, OPTIONS, defaults)
    return from_options(parser, Settings, parser.parse_args(argv), OPTIONS)


def test_no_options_give_the_dataclass_defaults_none_included():
    assert parse([]) == Settings()


def test_values_take_the_fields_types_and_names_their_dashes():
    got = parse(["--steps", "5", "--rate", "0.25", "--out", "a/b.pt", "--max-len", "7",
                 "--mode", "fast", "--name", "x"])
    assert got == Settings(5, 0.25, Path("a/b.pt"), 7, "fast", "x")
    assert isinstance(got.out, Path) and type(got.max_len) is int and type(got.rate) is float


def test_a_script_may_override_a_default():
    assert parse([], defaults={"out": Path("runs/x.pt")}).out == Path("runs/x.pt")


def test_help_comes_from_the_field_and_fields_not_named_are_no_options(capsys):
    with pytest.raises(SystemExit):
        parse(["--help"])
    text = capsys.readouterr().out
    assert "--mode {fast,slow}" in text and "how to run" in text
    assert "--max-len MAX_LEN" in text and "--verbose" not in text


@pytest.mark.parametrize(("argv", "message"), [
    (["--mode", "medium"], "argument --mode: invalid choice: 'medium' (choose from"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["--max-len", "0"], "tool: error: max-len must be None or >= 1, got 0"),
])
def test_bad_values_end_the_program_as_argparse_does(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_fields_that_cannot_be_options_are_named():
    parser = argparse.ArgumentParser()
    with pytest.raises(TypeError, match=r"Settings.verbose is <class 'bool'>: an option's"):
        add_options(parser, Settings, ["verbose"])
    with pytest.raises(ValueError, match="Settings has no field 'speed'"):
        add_options(parser, Settings, ["speed"])


# ------------------------------------------------------ scripts/train_ddp.py

#: `python scripts/train_ddp.py --help` (200 columns) before its options were derived
#: from DigitsRun's fields, with the one option added since (--requeue-on).
TRAIN_DDP_OPTIONS = """\
options:
  -h, --help            show this help message and exit
  --epochs EPOCHS
  --global-batch GLOBAL_BATCH
                        samples per optimizer step over all ranks (split between them)
  --lr LR               Adam's peak learning rate for a global batch of 64 (scaled by the \
square-root rule for other global batches)
  --seed SEED
  --checkpoint CHECKPOINT
  --limit LIMIT         train on the first N training images only (quick runs)
  --workers WORKERS     DataLoader workers per rank
  --accumulate ACCUMULATE
                        batches per optimizer step (gradient accumulation, no_sync)
  --amp {auto,bfloat16,float16}
                        mixed precision: auto (bfloat16 where the hardware computes it; else \
float16 with a scaler on GPUs, float32 on CPUs), bfloat16 or float16
  --requeue-on {USR1,USR2}
                        on this signal (sbatch --signal=USR1@120), save at the next step \
and requeue the SLURM job, which resumes there (needs a checkpoint)
  --nprocs NPROCS       ranks to launch when not under torchrun/SLURM (default: GPUs)
  --result RESULT       write the history and test metrics here as JSON (rank 0)
"""


@pytest.fixture
def train_ddp_parse_args():
    return runpy.run_path(str(ROOT / "scripts" / "train_ddp.py"))["parse_args"]


def test_train_ddp_keeps_its_options_and_help(train_ddp_parse_args, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        train_ddp_parse_args(["--help"])
    assert capsys.readouterr().out.split("\n\n")[-1] == TRAIN_DDP_OPTIONS


def test_train_ddp_defaults_are_the_chapters_but_for_its_checkpoint(train_ddp_parse_args):
    run, args = train_ddp_parse_args([])
    assert run == DigitsRun(checkpoint=Path("runs/train_ddp.pt"))
    assert (args.nprocs, args.result) == (None, None)
    run, _ = train_ddp_parse_args(["--accumulate", "2", "--amp", "bfloat16", "--limit", "9"])
    assert (run.accumulate, run.amp, run.limit) == (2, "bfloat16", 9)
