"""Chapter 07's 2-D mesh, FSDP x tensor parallelism (mgpu_helpers.labs.mesh2d)."""

import pytest

from mgpu_helpers import launch
from mgpu_helpers.labs import mesh2d


@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
def test_fsdp_times_tp_on_a_2x2_mesh_trains_like_the_unsplit_block():
    ranks = launch(mesh2d.fsdp_and_tp, nprocs=4, backend="gloo", return_all=True)
    assert [r["coordinates"] for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in ranks:
        assert r["difference"] < 1e-6
        # the first layer: rows split by TP (64 -> 32), then by FSDP (32 -> 16)
        assert r["local_shapes"]["0.weight"] == (16, 16)
        assert r["local_shapes"]["2.weight"] == (8, 32)  # columns by TP, rows by FSDP
        assert "Shard(dim=0)" in r["placements"]["0.weight"]
