"""Chapter 07's 2-D mesh, FSDP x tensor parallelism (the chapter's set-up, with
mgpu_helpers.labs.mesh2d's training and comparison)."""

from types import SimpleNamespace

import pytest
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from mgpu_helpers import launch
from mgpu_helpers.labs import mesh2d


def _fsdp_and_tp(tensor_parallel=True):
    """The chapter's set-up; without ``tensor_parallel``, FSDP alone on the "dp" axis."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, reference = mesh2d.block(), mesh2d.block()
    if tensor_parallel:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return mesh2d.train_and_compare(model, reference, mesh)


@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
def test_fsdp_times_tp_on_a_2x2_mesh_trains_like_the_unsplit_block():
    ranks = launch(_fsdp_and_tp, nprocs=4, backend="gloo", return_all=True)
    assert [r["coordinates"] for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in ranks:
        assert r["difference"] < 1e-6
        # the first layer: rows split by TP (64 -> 32), then by FSDP (32 -> 16)
        assert r["local_shapes"]["0.weight"] == (16, 16)
        assert r["local_shapes"]["2.weight"] == (8, 32)  # columns by TP, rows by FSDP
        assert "Shard(dim=0)" in r["placements"]["0.weight"]
    # the shapes come from the split: FSDP alone halves the rows only
    fsdp_only = launch(_fsdp_and_tp, False, nprocs=4, backend="gloo")
    assert fsdp_only["local_shapes"]["0.weight"] == (32, 16)
    assert fsdp_only["difference"] < 1e-6


def test_a_mesh_without_the_dp_and_tp_dimensions_is_refused():
    with pytest.raises(ValueError, match=r"mesh_dim_names=\('dp', 'tp'\)"):
        mesh2d.train_and_compare(mesh2d.block(), mesh2d.block(),
                                 SimpleNamespace(mesh_dim_names=("fsdp", "tp")))
