"""docs/cheatsheet.md and its two templates: the sheet shows the files as they are, cites a
source for every environment variable, and the templates train under torchrun."""

import hashlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SHEET = ROOT / "docs" / "cheatsheet.md"
TEMPLATES = {name: ROOT / "scripts" / "templates" / f"{name}.py"
             for name in ("ddp_minimal", "fsdp2_minimal")}
# The variables the sheet promises to explain (issue 33), each in a row of its table.
REQUIRED_VARIABLES = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE",
    "TORCH_DISTRIBUTED_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT", "OMP_NUM_THREADS",
)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def sheet() -> str:
    return SHEET.read_text()


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.DOTALL | re.MULTILINE)


def section(text: str, title: str) -> str:
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_the_sheet_shows_both_templates_exactly_as_the_files_are():
    blocks = python_blocks(sheet())
    assert blocks == [TEMPLATES["ddp_minimal"].read_text(),
                      TEMPLATES["fsdp2_minimal"].read_text()]


@pytest.mark.parametrize("name", TEMPLATES)
def test_each_template_fits_on_the_page(name):
    assert len(TEMPLATES[name].read_text().splitlines()) <= 72


def variable_rows() -> list[tuple[str, list[str]]]:
    """(first cell, the source tags of the last cell) of each row of section 2's table."""
    rows = [line for line in section(sheet(), "2. Environment variables").splitlines()
            if line.startswith("| `")]
    return [(row.split("|")[1], re.findall(r"\[(\w+)\]", row.split("|")[-2])) for row in rows]


def test_every_variable_row_cites_a_source_listed_at_the_bottom():
    listed = set(re.findall(r"^\* \[(\w+)\] .*https://", section(sheet(), "Sources"),
                            flags=re.MULTILINE))
    rows = variable_rows()
    assert len(rows) >= 10
    for first_cell, tags in rows:
        assert tags, f"no source for {first_cell}"
        assert set(tags) <= listed, f"{first_cell} cites {tags}, listed: {sorted(listed)}"
    named = " ".join(first_cell for first_cell, _ in rows)
    missing = [v for v in REQUIRED_VARIABLES if not re.search(rf"`{v}`", named)]
    assert missing == []


def test_every_relative_link_of_the_sheet_exists():
    links = re.findall(r"\]\((\.\./[^)#]+)\)", sheet())
    assert links, "the sheet links to the chapters"
    assert [link for link in links if not (SHEET.parent / link).exists()] == []


def test_the_error_table_has_ten_to_fifteen_rows():
    table = section(sheet(), "4. Error")
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]  # no header
    assert 10 <= len(rows) <= 15
    assert all(line.count("|") == 4 for line in rows), "every row: error | cause | fix"


def run_template(name: str, checkpoint: Path, timeout: float = 120) -> str:
    """Run a template under torchrun on 2 processes; its output, or a failure."""
    # A CPU check: no visible GPU, so the templates take their gloo/CPU branch on every
    # machine (with GPUs they would pick NCCL, and 2 NCCL ranks need 2 GPUs).
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(TEMPLATES[name]), str(checkpoint)]
    # A session of its own, so that a timeout ends torchrun and both of its workers.
    process = subprocess.Popen(command, env=env, cwd=checkpoint.parent, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{name} ran past {timeout} s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-3000:]
    return output


def losses(output: str) -> list[float]:
    # not anchored to line ends: torchrun merges the ranks' streams, and another rank's
    # line can land right after this one's last digit, before its newline
    return [float(x) for x in re.findall(r"epoch \d+: loss of rank 0's last batch (\d+\.\d+)",
                                         output)]


def fingerprint(state: dict) -> str:
    """The DDP template's digest, of a state dict's tensors in order."""
    flat = torch.cat([tensor.flatten() for tensor in state.values()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("ddp") / "ddp.pt"
    output = run_template("ddp_minimal", checkpoint)
    return output, torch.load(checkpoint, weights_only=True)


@pytest.mark.slow
def test_the_ddp_template_trains_and_its_replicas_agree_with_the_checkpoint(ddp_run):
    output, saved = ddp_run
    digests = dict(re.findall(r"rank (\d): weights ([0-9a-f]{16})", output))  # merged streams
    assert sorted(digests) == ["0", "1"], output[-3000:]
    assert digests["0"] == digests["1"] == fingerprint(saved["model"])
    assert not any(key.startswith("module.") for key in saved["model"])
    trained = losses(output)
    assert len(trained) == saved["epochs"] == 3 and trained[-1] < trained[0] / 2


@pytest.mark.slow
def test_the_fsdp2_template_saves_the_full_model_ddp_trains(ddp_run, tmp_path):
    # Same seed, data, sampler, global batch and optimizer as the DDP template: sharding
    # changes where the numbers live, not the training.
    output = run_template("fsdp2_minimal", tmp_path / "fsdp2.pt")
    saved = torch.load(tmp_path / "fsdp2.pt", weights_only=True)["model"]
    ddp_saved = ddp_run[1]["model"]
    assert list(saved) == list(ddp_saved)
    for key, tensor in saved.items():
        assert type(tensor) is torch.Tensor and tensor.shape == ddp_saved[key].shape, key
        assert torch.allclose(tensor, ddp_saved[key], rtol=0, atol=1e-6), key
    assert losses(output) == pytest.approx(losses(ddp_run[0]), abs=1e-4)
