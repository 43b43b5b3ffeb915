"""The arrangement of ranks (mgpu_helpers.runtime.topology.ParallelDims): sizes checked, axes
named, coordinates equal to the DeviceMesh's own."""

import pytest

from mgpu_helpers import launch
from mgpu_helpers.runtime.topology import AXES, ParallelDims


def test_the_sizes_multiply_to_the_world_and_unused_axes_are_left_out():
    dims = ParallelDims(dp=2, fsdp=2, tp=2)
    assert dims.world_size == 8
    assert dims.axes == (("dp", 2), ("fsdp", 2), ("tp", 2))
    assert ParallelDims().axes == (("dp", 1),)  # one rank: a mesh of one axis
    assert ParallelDims(pp=2, ep=3, cp=5).axes == (("pp", 2), ("ep", 3), ("cp", 5))


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "2", None])
def test_a_size_that_is_not_a_whole_number_above_zero_is_refused(size):
    with pytest.raises(ValueError, match=r"tp must be a whole number >= 1 \(1: that "):
        ParallelDims(tp=size)


def test_filling_sizes_one_axis_from_the_others():
    assert ParallelDims.filling(8, tp=2) == ParallelDims(fsdp=4, tp=2)
    assert ParallelDims.filling(8, axis="dp", fsdp=2, tp=2) == ParallelDims(dp=2, fsdp=2, tp=2)
    with pytest.raises(ValueError, match=r"6 ranks cannot be filled along fsdp: the other "
                                         r"sizes \(tp=4\) multiply to 4, which does not divide 6"):
        ParallelDims.filling(6, tp=4)
    with pytest.raises(ValueError, match="sizes fsdp itself"):
        ParallelDims.filling(8, fsdp=2)
    with pytest.raises(ValueError, match="axis must be one of pp, dp, fsdp, ep, cp, tp"):
        ParallelDims.filling(8, axis="zero")


def test_a_wrong_world_size_says_what_would_fit():
    ParallelDims(fsdp=2, tp=2).check_world(4)
    with pytest.raises(ValueError, match=r"ParallelDims\(fsdp=2, tp=2\) arranges 4 ranks, but "
                                         r"this job has 8\..*For example fsdp=4"):
        ParallelDims(fsdp=2, tp=2).check_world(8)
    with pytest.raises(ValueError, match=r"For example fsdp=3, the others unchanged\.$"):
        ParallelDims(fsdp=2, tp=2).check_world(6)
    with pytest.raises(ValueError, match=r"arranges 4 ranks, but this job has 5\. The sizes "
                                         r"must multiply to the number of ranks: change them, or "
                                         r"start 4 ranks\.$"):
        ParallelDims(fsdp=2, tp=2).check_world(5)  # tp=2 does not divide 5: no hint


def test_coordinates_vary_fastest_along_the_innermost_axis():
    dims = ParallelDims(dp=2, fsdp=2, tp=2)
    assert [tuple(dims.coordinates(r).values()) for r in range(8)] == [
        (d, f, t) for d in range(2) for f in range(2) for t in range(2)]
    assert list(dims.coordinates(5)) == ["dp", "fsdp", "tp"]
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.7"):
        dims.coordinates(8)


def test_axes_order_puts_tensor_parallelism_innermost():
    # the ranks of a node (consecutive ranks) share the axis that talks in every layer
    assert AXES[-1] == "tp" and AXES[0] == "pp"


def test_building_a_mesh_outside_a_group_says_where_to_call_it():
    with pytest.raises(RuntimeError, match="needs a running process group: call it inside a rank"):
        ParallelDims().build_mesh("cpu")


def mesh_seen_by_this_rank(dims: ParallelDims):
    mesh = dims.build_mesh("cpu")
    return mesh.mesh_dim_names, [mesh[name].get_local_rank() for name in mesh.mesh_dim_names]


@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
def test_the_mesh_has_the_named_axes_and_the_coordinates_the_dims_predict():
    dims = ParallelDims(dp=2, tp=2)
    # CPU check: the mesh is built on gloo ranks, the same on every machine
    seen = launch(mesh_seen_by_this_rank, dims, nprocs=4, backend="gloo", return_all=True)
    for rank, (names, local_ranks) in enumerate(seen):
        assert names == ("dp", "tp")
        assert local_ranks == list(dims.coordinates(rank).values())


def refuse_the_wrong_world():
    ParallelDims(fsdp=2, tp=2).build_mesh("cpu")


@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
def test_a_mesh_for_another_world_size_is_refused_in_the_rank():
    from mgpu_helpers import LaunchError

    with pytest.raises(LaunchError, match="arranges 4 ranks, but this job has 2"):
        launch(refuse_the_wrong_world, nprocs=2, backend="gloo")
