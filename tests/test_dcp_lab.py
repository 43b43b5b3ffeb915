"""Chapter 07's distributed checkpoint (mgpu_helpers.labs.dcp): saved by 4 FSDP2 ranks,
loaded by 2 and by 4."""

import pytest
import torch

from mgpu_helpers import launch
from mgpu_helpers.labs import dcp


@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
def test_a_checkpoint_of_4_sharded_ranks_resumes_on_2_and_on_4(tmp_path):
    checkpoint = str(tmp_path / "ckpt")
    straight = launch(dcp.fsdp_run, 0, 4, None, checkpoint, 2, nprocs=4, backend="gloo")
    on_four = launch(dcp.fsdp_run, 2, 4, checkpoint, nprocs=4, backend="gloo")
    on_two = launch(dcp.fsdp_run, 2, 4, checkpoint, nprocs=2, backend="gloo")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
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
    short = launch(dcp.fsdp_run, 0, 2, nprocs=2, backend="gloo")
    assert max((a - b).abs().max().item()
               for a, b in zip(short["weights"], straight["weights"], strict=True)) > 1e-3
