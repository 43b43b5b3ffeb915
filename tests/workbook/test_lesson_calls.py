"""The calls a chapter teaches appear in its own code cells (DESIGN.md §3b, "Show the
lesson's code"): helpers hide plumbing, never the lesson.

Each chapter's code cells are parsed with ``ast`` and every call is collected: its
name (``fully_shard``), its dotted name as written (``dcp.load``), and each keyword it
is given (``async_save(process_group=)``). A technique the package keeps for later
chapters (ring attention, the TP plan, the all-to-all) is shown where it is taught with
``mh.show(...)``, which renders its source in the chapter: the calls in the source of
what a cell imports and shows count as the chapter's. A call made inside a helper module
and not shown, written in a comment or a string, or only imported, is not in the
chapter's code, and the table below then fails with a message that names it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import textwrap
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"

#: chapter -> [(alternatives, what the reader learns from seeing it)]: at least one of
#: the alternatives must be called in a code cell of the chapter.
LESSON_CALLS: dict[str, list[tuple[tuple[str, ...], str]]] = {
    "05_distributed_data_parallel": [
        (("DistributedSampler",), "each rank's share of the data"),
        (("set_epoch",), "a new shuffle every epoch, the same on every rank"),
        (("DDP", "DistributedDataParallel"), "wrapping the model"),
        (("no_sync",), "skipping the all-reduce while accumulating gradients"),
        (("register_comm_hook",), "DDP's communication hooks"),
        (("autocast",), "mixed precision"),
        (("GradScaler",), "float16's loss scaling"),
        (("unscale_",), "unscaling before the clip"),
        (("clip_grad_norm_",), "gradient clipping"),
    ],
    "07_sharding_fsdp_and_tensor_parallel": [
        (("fully_shard(mesh=)",), "FSDP2: each layer, then the root, on a device mesh"),
        (("init_device_mesh",), "the device mesh"),
        (("init_device_mesh(mesh_dim_names=)",), "the 2-D mesh's named dimensions"),
        (("parallelize_module",), "tensor parallelism's plan"),
        (("get_state_dict",), "the sharded state a distributed checkpoint saves"),
        (("async_save(process_group=)",), "the background save, on a group of its own"),
        (("dcp.load",), "loading a distributed checkpoint, resharded"),
        (("set_state_dict",), "putting the loaded state back"),
        (("checkpoint(use_reentrant=)",), "activation checkpointing"),
        (("create_selective_checkpoint_contexts",), "the selective checkpointing policy"),
    ],
    "10_language_model_and_fsdp2": [
        (("fully_shard",), "FSDP2 applied to the GPT"),
        (("MixedPrecisionPolicy",), "FSDP2's mixed precision"),
    ],
    "11_tensor_sequence_and_loss_parallel": [
        (("CopyToTP.apply",), "f, the identity forward and all-reduce backward"),
        (("ReduceFromTP.apply",), "g, the all-reduce forward"),
        (("all_reduce",), "the all-reduces of f and g, and the loss's"),
        (("all_gather", "all_gather_single"), "sequence parallelism's all-gather"),
        (("reduce_scatter", "reduce_scatter_single"), "sequence parallelism's reduce-scatter"),
        (("parallelize_module",), "the DTensor plan"),
        (("ColwiseParallel",), "column-parallel layers"),
        (("RowwiseParallel(output_layouts=)",), "row-parallel layers ending in a sequence shard"),
        (("SequenceParallel",), "the norms on sequence shards"),
        (("PrepareModuleInput",), "the gathered inputs of attention and the MLP"),
        (("loss_parallel",), "the vocabulary-parallel loss"),
        (("init_device_mesh(mesh_dim_names=)",), "the 2-D mesh"),
        (("fully_shard(mesh=)",), "FSDP2 along the mesh's dp dimension"),
    ],
    "12_context_parallelism": [
        (("batch_isend_irecv",), "K and V passed around the ring"),
        (("P2POp",), "the ring's sends and receives"),
        (("RingAttention.apply",), "ring attention as an autograd function"),
        (("logaddexp",), "the online-softmax merge"),
        (("all_gather",), "the all-gather design's forward"),
        (("reduce_scatter",), "the all-gather design's backward"),
        (("init_device_mesh(mesh_dim_names=)",), "the (dp, cp) mesh"),
        (("fully_shard(mesh=)",), "FSDP2 over dp x cp"),
        (("context_parallel",), "PyTorch's context parallelism"),
    ],
    "13_mixture_of_experts": [
        (("topk",), "top-k routing"),
        (("bincount",), "tokens per expert"),
        (("all_to_all_single",), "the counts exchange and the uneven dispatch"),
        (("AllToAll.apply",), "the all-to-all as an autograd function"),
        (("index_add", "index_add_"), "the weighted combine"),
        (("traffic_measured",), "the dispatch's bytes, measured"),
    ],
    "14_composing_parallelisms_and_planning": [
        (("init_device_mesh",), "the 3-D device mesh"),
        (("PipelineStage",), "the pipeline stage"),
        (("ScheduleGPipe",), "the pipeline schedule"),
        (("parallelize_module",), "tensor parallelism inside a stage"),
        (("fully_shard",), "FSDP2 over the data-parallel dimension"),
        (("LocalTensorMode",), "a 64-rank mesh simulated in one process"),
        (("planner.predict",), "the planner's prediction"),
    ],
}


def _dotted(node: ast.expr) -> str | None:
    """``dcp.async_save`` for ``dcp.async_save``; the attribute alone where the chain
    starts from a call or a subscript (``model.module.no_sync``: all of it;
    ``mesh["tp"].size``: ``size``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _dotted(node.value)
        return f"{owner}.{node.attr}" if owner else node.attr
    return None


def calls_in(source: str) -> set[str]:
    """Every call in ``source``: its last name, its dotted name and ``name(keyword=)``
    for each keyword; and each function handed to a call by name, as
    ``partial(create_selective_checkpoint_contexts, policy)`` hands one."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        handed = [*node.args, *(keyword.value for keyword in node.keywords)]
        for function in [node.func, *handed]:
            dotted = _dotted(function)
            if dotted is not None:
                found |= {dotted, dotted.rsplit(".", 1)[-1]}
        name = (_dotted(node.func) or "").rsplit(".", 1)[-1]
        found |= {f"{name}({keyword.arg}=)" for keyword in node.keywords if keyword.arg}
    return found


def shown_sources(source: str) -> list[str]:
    """The source of each object a ``show(...)`` call of ``source`` renders, each named
    as the cell names it: imported (``from m import f`` or ``import m as p``) and handed
    to show by name (``f``) or attribute (``p.f``)."""
    imported: dict[str, str] = {}  # the name in the cell -> "module" or "module:attribute"
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{node.module}:{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                imported[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0])
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if (_dotted(node.func) or "").rsplit(".", 1)[-1] != "show":  # show(), mh.show()
            continue
        for argument in node.args:
            dotted = _dotted(argument)
            if dotted is None or dotted.split(".")[0] not in imported:
                continue
            head, *rest = dotted.split(".")
            module, _, attribute = imported[head].partition(":")
            item = importlib.import_module(module)
            for name in ([attribute] if attribute else []) + rest:
                item = getattr(item, name)
            found.append(textwrap.dedent(inspect.getsource(item)))
    return found


def chapter_calls(path: Path) -> set[str]:
    """The calls of a notebook's code cells (IPython's ``%`` and ``!`` lines left out),
    and of the source they show with ``mh.show``."""
    found: set[str] = set()
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            lines = "".join(cell["source"]).splitlines()
            source = "\n".join(line for line in lines
                               if not line.lstrip().startswith(("%", "!")))
            found |= calls_in(source)
            for shown in shown_sources(source):
                found |= calls_in(shown)
    return found


def missing(table: list[tuple[tuple[str, ...], str]], found: set[str]) -> list[str]:
    """A message per entry of ``table`` none of whose alternatives is in ``found``."""
    return [f"the chapter must show {' or '.join(f'`{a}`' for a in alternatives)} "
            f"({why}) in one of its code cells: no code cell calls it (was it moved into a "
            "helper? the helper may keep the plumbing, not the lesson)"
            for alternatives, why in table if not found.intersection(alternatives)]


#: chapters that do not show their calls yet; strict, so the mark must go once they do
NOT_YET: dict[str, str] = {}


@pytest.mark.parametrize("chapter", [
    pytest.param(chapter, marks=pytest.mark.xfail(strict=True, reason=NOT_YET[chapter]))
    if chapter in NOT_YET else chapter for chapter in sorted(LESSON_CALLS)])
def test_each_chapter_shows_the_calls_it_teaches(chapter):
    path = NOTEBOOKS / f"{chapter}.ipynb"
    assert path.exists(), f"{path} is missing: update LESSON_CALLS if the chapter moved"
    problems = missing(LESSON_CALLS[chapter], chapter_calls(path))
    assert not problems, f"{chapter}:\n" + "\n".join(problems)


def test_a_call_inside_a_helper_a_comment_a_string_or_an_import_is_not_shown():
    hidden = '''
from torch.distributed.fsdp import fully_shard  # imported, never called here
from mgpu_helpers.labs import mesh2d

Code(inspect.getsource(mesh2d))  # the helper's source shown as text
note = "fully_shard(model, mesh=mesh)"
# fully_shard(model, mesh=mesh)
grid = mh.launch(mesh2d.fsdp_and_tp, nprocs=4)
'''
    table = LESSON_CALLS["07_sharding_fsdp_and_tensor_parallel"][:1]
    [message] = missing(table, calls_in(hidden))
    assert "`fully_shard(mesh=)`" in message and "must show" in message
    shown = hidden + "fully_shard(layer, mesh=mesh)\n"
    assert missing(table, calls_in(shown)) == []


def test_the_source_a_cell_shows_with_mh_show_counts_and_text_alone_does_not(tmp_path):
    table = [(("batch_isend_irecv",), "the ring's messages")]
    cells = {
        "shown": "from mgpu_helpers.parallel.context import pass_along\n\nmh.show(pass_along)",
        "by attribute": "from mgpu_helpers.parallel import context as cp\n\nmh.show(cp.pass_along)",
        "as text": "from mgpu_helpers.parallel.context import pass_along\n\n"
                   "Code(inspect.getsource(pass_along))",
        "imported only": "from mgpu_helpers.parallel.context import pass_along",
    }
    verdicts = {}
    for name, source in cells.items():
        notebook = {"cells": [{"cell_type": "code", "source": source}]}
        path = tmp_path / f"{name}.ipynb"
        path.write_text(json.dumps(notebook))
        verdicts[name] = missing(table, chapter_calls(path)) == []
    assert verdicts == {"shown": True, "by attribute": True, "as text": False,
                        "imported only": False}


def test_names_keywords_and_alternatives_are_matched():
    found = calls_in('state = dcp.async_save(s, checkpoint_id=p, process_group=g)\n'
                     'with model.no_sync():\n    pass\n'
                     'mesh["tp"].size()\n'
                     'wrapped = DistributedDataParallel(model)\n')
    assert {"dcp.async_save", "async_save", "async_save(process_group=)",
            "async_save(checkpoint_id=)", "model.no_sync", "no_sync", "size",
            "DistributedDataParallel"} <= found
    assert "dcp.load" not in found and "async_save(mesh=)" not in found
    handed = calls_in("contexts = partial(create_selective_checkpoint_contexts, policy)\n"
                      "mh.launch(mesh2d.fsdp_and_tp, nprocs=4)\n")
    assert {"create_selective_checkpoint_contexts", "mesh2d.fsdp_and_tp"} <= handed
    assert "parallelize_module" not in handed  # what the helper calls stays unseen
    assert missing([(("DDP", "DistributedDataParallel"), "wrapping")], found) == []
    assert len(missing([(("dcp.load",), "loading")], found)) == 1
