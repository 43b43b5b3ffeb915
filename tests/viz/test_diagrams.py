"""The diagrams draw what the code they depict does: the ring's chunks come from chapter
03's ring_all_reduce run on in-process ranks, the tensor-parallel slices from
parallelize_module, the mesh groups from init_device_mesh (both on a fake process group);
each figure has the panels and boxes its parameters imply; bad parameters say what is
wrong."""

import queue
import re
import threading
from contextlib import contextmanager

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from mgpu_helpers.labs import collectives  # noqa: E402
from mgpu_helpers.viz import diagrams  # noqa: E402


@pytest.fixture
def figures():
    made = []
    yield made.append
    for fig in made:
        plt.close(fig)


# ----------------------------------------------------------------- the ring


class ThreadRanks:
    """Just enough of torch.distributed for ring_all_reduce: each thread is a rank, a
    message is a queue entry. Records, per rank, the chunk each send carried (from the
    view's offset: the chunks are views of the rank's tensor), the chunk each receive
    brought, and the rank's whole tensor before each step."""

    def __init__(self, world):
        self.world = world
        self.local = threading.local()
        self.inbox = [queue.Queue() for _ in range(world)]
        self.sent = [[] for _ in range(world)]
        self.received = [[] for _ in range(world)]
        self.before = [[] for _ in range(world)]

    def get_rank(self):
        return self.local.rank

    def get_world_size(self):
        return self.world

    def isend(self, chunk, dst):
        rank, whole = self.local.rank, self.local.tensor
        assert dst == (rank + 1) % self.world
        self.before[rank].append(whole.clone())
        index = chunk.storage_offset() - whole.storage_offset()  # one element per chunk
        self.sent[rank].append(index)
        self.inbox[dst].put((index, chunk.clone()))
        return type("Done", (), {"wait": lambda self: None})()

    def recv(self, tensor, src):
        rank = self.local.rank
        assert src == (rank - 1) % self.world
        index, data = self.inbox[rank].get(timeout=10)
        self.received[rank].append(index)
        tensor.copy_(data)

    def run(self, world):
        # rank r's chunk c starts as 2**r: a sum of distinct powers of two names its terms
        tensors = [torch.full((world,), float(2 ** r)) for r in range(world)]
        errors = []

        def rank_main(rank):
            self.local.rank, self.local.tensor = rank, tensors[rank]
            try:
                collectives.ring_all_reduce(tensors[rank])
            except Exception as error:  # reported below, in the test's thread
                errors.append(error)

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
        assert not errors, errors
        return tensors


def members(value: float) -> frozenset:
    return frozenset(r for r in range(8) if int(value) >> r & 1)


def chapter_03_ring(world, monkeypatch):
    """Per step: (sends, receives, holds after the step), from ring_all_reduce itself."""
    fake = ThreadRanks(world)
    monkeypatch.setattr(collectives, "dist", fake)
    final = fake.run(world)
    assert all(torch.equal(t, torch.full((world,), 2.0 ** world - 1)) for t in final)
    steps = []
    for k in range(2 * (world - 1)):
        after = [fake.before[r][k + 1] if k + 1 < len(fake.before[r]) else final[r]
                 for r in range(world)]
        steps.append((tuple(fake.sent[r][k] for r in range(world)),
                      tuple(fake.received[r][k] for r in range(world)),
                      tuple(tuple(members(v) for v in after[r].tolist())
                            for r in range(world))))
    return steps


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_the_ring_schedule_is_what_chapter_03s_ring_all_reduce_does(world, monkeypatch):
    traced = chapter_03_ring(world, monkeypatch)
    schedule = diagrams.ring_schedule(world)
    assert len(schedule) == 2 * (world - 1)
    assert [s.phase for s in schedule] == ["reduce-scatter"] * (world - 1) + \
        ["all-gather"] * (world - 1)
    for step, (sends, receives, holds) in zip(schedule, traced, strict=True):
        assert step.sends == sends
        assert step.receives == receives
        assert step.holds == holds
    # after reduce-scatter, rank r holds the complete sum of chunk (r + 1) mod N
    middle = schedule[world - 2].holds
    assert all(len(middle[r][(r + 1) % world]) == world for r in range(world))


def cell_members(text: str) -> frozenset:
    if text == "all":
        return frozenset(range(8))
    return frozenset(int(d) for d in (text.split("+") if "+" in text else text))


@pytest.mark.parametrize("world", [3, 4])
def test_ring_steps_draws_each_step_as_the_ring_runs_it(world, monkeypatch, figures):
    traced = chapter_03_ring(world, monkeypatch)
    fig = diagrams.ring_steps(world)
    figures(fig)
    assert len(fig.axes) == 1 + 2 * (world - 1)  # the start, then one panel per step
    panels = [ax for ax in fig.axes if re.match(r"(reduce-scatter|all-gather) \d", ax.get_title())]
    assert len(panels) == 2 * (world - 1)
    for ax, (sends, receives, holds) in zip(panels, traced, strict=True):
        cells = {t.get_gid(): t.get_text() for t in ax.texts}
        for r in range(world):
            for c in range(world):
                assert cell_members(cells[f"cell {r} {c}"]) == holds[r][c], (ax.get_title(), r)
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert labels == [f"rank {r} sends {sends[r]}" for r in range(world)]
        outlined = {p.get_gid(): int(p.get_x()) for p in ax.patches if p.get_gid()}
        assert [outlined[f"received {r}"] for r in range(world)] == list(receives)
        assert [outlined[f"sent {r}"] for r in range(world)] == list(sends)


def test_ring_cells_name_complete_sums_as_all_beyond_four_ranks():
    assert diagrams.sum_label(frozenset(range(4)), 4) == "0+1+2+3"
    assert diagrams.sum_label(frozenset({4, 0, 1}), 6) == "014"
    assert diagrams.sum_label(frozenset(range(6)), 6) == "all"


# ----------------------------------------------------------------- DDP


def test_ddp_buckets_start_when_ready_and_one_after_another():
    plan = diagrams.ddp_schedule(buckets=3, layers=6, comm_per_layer=0.5, latency=0.2)
    assert plan.buckets == ((5, 4), (3, 2), (1, 0))  # bucket 0: the last layers
    assert [s.index for s in plan.backward] == [5, 4, 3, 2, 1, 0]
    assert [x for s in plan.all_reduces for x in (s.start, s.end)] == pytest.approx(
        [2, 3.2, 4, 5.2, 6, 7.2])
    assert plan.optimizer.start == pytest.approx(7.2)
    assert plan.exposed == pytest.approx(1.2)
    assert plan.no_overlap_all_reduce.end - plan.backward[-1].end == pytest.approx(3.2)
    # communication-bound: a ready bucket waits for the one before it on the stream
    slow = diagrams.ddp_schedule(buckets=3, layers=6, comm_per_layer=2, latency=0.2)
    assert [x for s in slow.all_reduces for x in (s.start, s.end)] == pytest.approx(
        [2, 6.2, 6.2, 10.4, 10.4, 14.6])
    assert slow.optimizer.start == pytest.approx(14.6)


@pytest.mark.parametrize("buckets,layers", [(1, 1), (2, 5), (4, 7), (7, 7)])
def test_ddp_buckets_share_out_every_layer_once(buckets, layers):
    plan = diagrams.ddp_schedule(buckets, layers)
    flat = [layer for group in plan.buckets for layer in group]
    assert flat == list(range(layers - 1, -1, -1))
    assert max(map(len, plan.buckets)) - min(map(len, plan.buckets)) <= 1
    assert plan.optimizer.start >= max(s.end for s in plan.all_reduces)


def test_ddp_overlap_draws_a_box_per_layer_and_per_bucket(figures):
    fig = diagrams.ddp_overlap(buckets=4, layers=8)
    figures(fig)
    top, bottom = fig.axes
    gids = [c.get_gid() for c in top.collections]
    assert sorted(g for g in gids if g.startswith("all-reduce")) == \
        [f"all-reduce {b}" for b in range(4)]
    assert sum(g.startswith("backward") for g in gids) == 8
    assert gids.count("optimizer -1") == 1
    bottom_gids = [c.get_gid() for c in bottom.collections]
    assert sum(g.startswith("all-reduce") for g in bottom_gids) == 1
    assert "schematic" in fig.get_suptitle().lower()
    assert "not measured" in bottom.get_xlabel()


# ----------------------------------------------------------------- FSDP


def by_kind(spans, kind):
    return {s.index: s for s in spans if s.kind == kind}


@pytest.mark.parametrize("units", [1, 3, 5])
def test_an_fsdp_units_life_in_order_with_the_next_all_gather_prefetched(units):
    spans = diagrams.fsdp_schedule(units, comm=0.6)
    kinds = [s.kind for s in spans]
    assert kinds.count("all-gather") == 2 * units
    assert kinds.count("reduce-scatter") == units
    forward, backward = by_kind(spans, "forward"), by_kind(spans, "backward")
    scatter = by_kind(spans, "reduce-scatter")
    gathers = [s for s in spans if s.kind == "all-gather"]
    for u in range(units):
        first, second = [g for g in gathers if g.index == u]
        assert first.end <= forward[u].start < forward[u].end <= second.start
        assert second.end <= backward[u].start < backward[u].end <= scatter[u].start
    for u in range(1, units):  # prefetch: unit u's all-gather overlaps unit u-1's forward
        ahead = [g for g in gathers if g.index == u][0]
        assert forward[u - 1].start <= ahead.start < forward[u - 1].end
    ends = sorted(s.end for s in scatter.values())
    assert by_kind(spans, "optimizer")[-1].start >= ends[-1]
    assert diagrams.most_held(spans) == min(units, 2)


def test_fsdp_without_resharding_gathers_once_and_holds_every_unit():
    spans = diagrams.fsdp_schedule(4, comm=0.6, reshard_after_forward=False)
    assert [s.kind for s in spans].count("all-gather") == 4
    assert diagrams.most_held(spans) == 4


def test_fsdp_unit_life_draws_each_units_boxes(figures):
    fig = diagrams.fsdp_unit_life(units=4)
    figures(fig)
    top, bottom = fig.axes
    gids = [c.get_gid() for c in top.collections]
    for kind, count in (("all-gather", 8), ("forward", 4), ("backward", 4),
                        ("reduce-scatter", 4), ("held", 8)):
        assert sum(g.startswith(kind + " ") for g in gids) == count, kind
    (line,) = [ln for ln in bottom.lines if ln.get_gid() == "held count"]
    assert max(line.get_ydata()) == 2
    assert "at most 2 units" in top.get_title()


# ----------------------------------------------------------------- fake process group


@contextmanager
def fake_rank(rank, world):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ranks,width", [(2, 4), (3, 3)])
def test_tp_shards_are_the_slices_parallelize_module_gives(ranks, width):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    shards = diagrams.tp_shards(ranks, width)
    hidden = 4 * width
    for rank in range(ranks):
        with fake_rank(rank, ranks):
            block = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
            with torch.no_grad():  # each weight entry names its hidden feature
                block[0].weight.copy_(torch.arange(hidden).float()[:, None].expand(-1, width))
                block[2].weight.copy_(torch.arange(hidden).float()[None, :].expand(width, -1))
            parallelize_module(block, init_device_mesh("cpu", (ranks,)),
                               {"0": ColwiseParallel(), "2": RowwiseParallel()},
                               src_data_rank=None)  # each rank splits its own copy
            rows = block[0].weight.to_local()[:, 0].tolist()
            columns = block[2].weight.to_local()[0].tolist()
        a, b = shards[rank]["w1_rows"]
        assert rows == list(range(a, b))
        a, b = shards[rank]["w2_columns"]
        assert columns == list(range(a, b))


def test_tp_splits_draws_every_ranks_shards(figures):
    fig = diagrams.tp_splits(ranks=4, width=4, batch=3)
    figures(fig)
    assert len(fig.axes) == 4 + 2  # the unsplit weights, one row per rank, the all-reduce
    patches = {p.get_gid() for ax in fig.axes for p in ax.patches}
    for r, shard in enumerate(diagrams.tp_shards(4, 4)):
        a, b = shard["w1_rows"]
        assert {f"W1 rows {a}:{b} rank {r}", f"W2 columns {a}:{b} rank {r}",
                f"W1[{a}:{b}].T", f"partial y rank {r}"} <= patches
    (reduce,) = [ax for ax in fig.axes if any(p.get_gid() == "y" for p in ax.patches)]
    assert sum(p.get_gid().startswith("partial y") for p in reduce.patches) == 4
    assert "1 all-reduce of 3 x 4 values" in fig.get_suptitle()


@pytest.mark.parametrize("dp,tp", [(2, 4), (3, 2)])
def test_mesh_groups_are_init_device_meshs(dp, tp):
    from torch.distributed.device_mesh import init_device_mesh

    groups = diagrams.mesh_groups(dp, tp)
    for rank in range(dp * tp):
        with fake_rank(rank, dp * tp):
            mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
            found = {dim: mesh[dim].mesh.tolist() for dim in ("tp", "dp")}
        for dim in ("tp", "dp"):
            (mine,) = [g for g in groups[dim] if rank in g]
            assert mine == found[dim], (dim, rank)


def test_mesh_2d_highlights_each_group_and_says_where_tp_groups_sit(figures):
    fig = diagrams.mesh_2d(2, 4, gpus_per_node=4)
    figures(fig)
    tp_panel, dp_panel = fig.axes
    assert {p.get_gid() for p in tp_panel.patches} == {"tp group 0,1,2,3", "tp group 4,5,6,7"}
    assert {p.get_gid() for p in dp_panel.patches} == {f"dp group {j},{j + 4}"
                                                       for j in range(4)}
    assert "every tp group is inside one node" in fig.get_suptitle()
    spread = diagrams.mesh_2d(2, 4, gpus_per_node=2)
    figures(spread)
    assert "some tp groups span nodes" in spread.get_suptitle()


def test_mesh_3d_draws_each_dimensions_groups_where_the_ranks_sit(figures):
    groups = {"pp": [[0, 4], [1, 5], [2, 6], [3, 7]], "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
              "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    fig = diagrams.mesh_3d(groups, (2, 2, 2), {"tp": "all_reduce"})
    figures(fig)
    for ax, name in zip(fig.axes, ("pp", "dp", "tp"), strict=True):
        patches = {p.get_gid(): (p.get_x(), p.get_y()) for p in ax.patches}
        assert len(patches) == 8 and name in ax.get_title()
        for k, members in enumerate(groups[name]):  # a group's cells share a colour
            colours = {tuple(p.get_facecolor()) for p in ax.patches
                       if p.get_gid().startswith(f"{name} group {k} ")}
            assert len(colours) == 1 and len(members) == 2
    tp_cells = {p.get_gid(): (p.get_x(), p.get_y()) for p in fig.axes[2].patches}
    # a tp pair sits side by side in one row; a pp pair in the same place of two blocks
    (x0, y0), (x1, y1) = tp_cells["tp group 0 rank 0"], tp_cells["tp group 0 rank 1"]
    assert y0 == y1 and x1 - x0 == 1
    pp_cells = {p.get_gid(): (p.get_x(), p.get_y()) for p in fig.axes[0].patches}
    (x0, y0), (x1, y1) = pp_cells["pp group 0 rank 0"], pp_cells["pp group 0 rank 4"]
    assert y0 == y1 and x1 - x0 == pytest.approx(2 + 0.6)  # one block (2 wide) and the gap
    assert "all_reduce" in fig.axes[2].get_title()
    with pytest.raises(ValueError, match="3 named dimensions"):
        diagrams.mesh_3d({"dp": [[0, 1]]}, (1, 1, 2), {})


# ----------------------------------------------------------- DTensor placements (chapter 11)


@pytest.mark.parametrize("ranks,rows,columns", [(2, 4, 4), (3, 4, 5)])
@pytest.mark.parametrize("placement", ["Shard(0)", "Shard(1)", "Replicate()"])
def test_placement_pieces_are_what_distribute_tensor_gives_each_rank(placement, ranks, rows,
                                                                     columns):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    layout = {"Shard(0)": Shard(0), "Shard(1)": Shard(1), "Replicate()": Replicate()}
    whole = torch.arange(rows * columns).reshape(rows, columns)
    pieces = diagrams.placement_pieces(placement, ranks, rows, columns)
    for rank in range(ranks):
        with fake_rank(rank, ranks):
            local = distribute_tensor(whole, init_device_mesh("cpu", (ranks,)),
                                      [layout[placement]], src_data_rank=None).to_local()
        row_range, column_range = pieces[rank]
        assert torch.equal(local, whole[row_range.start:row_range.stop,
                                        column_range.start:column_range.stop])


def test_placements_draws_what_each_rank_holds(figures):
    fig = diagrams.placements(ranks=3)
    figures(fig)
    patches = {p.get_gid(): p for ax in fig.axes for p in ax.patches}
    for placement in diagrams.PLACEMENTS:
        for rank, (rows, columns) in enumerate(diagrams.placement_pieces(placement, 3)):
            if not (rows and columns):  # torch.chunk leaves the last rank nothing here
                assert f"{placement} rank {rank} holds" not in patches
                continue
            held = patches[f"{placement} rank {rank} holds"]
            assert (held.get_width(), held.get_height()) == (len(columns), len(rows))
            assert bool(held.get_hatch()) == (placement == "Partial()")
    assert diagrams.placement_pieces("Partial()", 2) == [(range(4), range(4))] * 2


# ----------------------------------------------------------------- bad parameters


@pytest.mark.parametrize("call,message", [
    (lambda: diagrams.ring_steps(1), "ring_steps needs 2 to 8 ranks, got 1"),
    (lambda: diagrams.ring_steps(9), "ring_steps needs 2 to 8 ranks, got 9"),
    (lambda: diagrams.ring_steps(4.0), "ring_steps needs 2 to 8 ranks, got 4.0"),
    (lambda: diagrams.ddp_overlap(buckets=7, layers=6), "needs 1 to 6 buckets, got 7"),
    (lambda: diagrams.ddp_overlap(comm_per_layer=-1), "needs comm_per_layer between 0"),
    (lambda: diagrams.ddp_overlap(latency=float("nan")), "needs latency between 0"),
    (lambda: diagrams.fsdp_unit_life(units=0), "fsdp_unit_life needs 1 to 8 units, got 0"),
    (lambda: diagrams.fsdp_unit_life(reshard_after_forward=2), "True or False, got 2"),
    (lambda: diagrams.tp_splits(ranks=1), "tp_splits needs 2 to 8 ranks, got 1"),
    (lambda: diagrams.tp_splits(ranks=3, width=4), "4 x 4 = 16 to be a multiple of ranks=3"),
    (lambda: diagrams.tp_splits(batch=True), "tp_splits needs 1 to 8 rows of batch, got True"),
    (lambda: diagrams.mesh_2d(1, 1), "mesh_2d needs at least 2 devices"),
    (lambda: diagrams.mesh_2d(2, 4, gpus_per_node=3), "gpus_per_node to divide the 8"),
    (lambda: diagrams.placements(ranks=9), "placements needs 1 to 8 ranks, got 9"),
    (lambda: diagrams.placement_pieces("Shard(2)"), "unknown placement 'Shard(2)'"),
])
def test_bad_parameters_say_what_is_wrong(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()
