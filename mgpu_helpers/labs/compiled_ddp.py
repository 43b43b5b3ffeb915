"""Chapter 08's ``torch.compile`` with DDP: graphs cut at bucket boundaries, counted, and
the compile time set against the step time.

DDP starts a bucket's all-reduce as soon as backward has produced every gradient in it.
A compiled model computes its backward in one piece per graph, and hands over all of
that graph's gradients at its end: with the whole model in one graph, every gradient
becomes ready at the very end of backward, and no all-reduce can overlap it. So
Dynamo's *DDPOptimizer* (``torch._dynamo.config.optimize_ddp``, on by default) cuts
the forward graph where DDP's buckets end, one graph per bucket: each graph's backward
then finishes a bucket, whose all-reduce runs while the earlier graphs' backward goes on.

:func:`compare` runs, inside each rank, the same few SGD steps of a small model three
ways: eager DDP, compiled DDP with DDPOptimizer, compiled DDP as one graph. It reports
DDP's buckets, the graphs the compiler backend received (with the parameters each one
holds), the order in which backward graphs finished and all-reduces started, the step
times, and how far each compiled run's weights are from eager DDP's.

Backend. The chapter compiles with ``"aot_eager"``: Dynamo captures the graphs,
DDPOptimizer splits them and AOTAutograd traces each one's forward and backward, exactly
as for inductor, but the graphs then run on PyTorch's own kernels instead of generated
code. It needs no C++ compiler. ``backend="inductor"`` generates the code (C++ on a CPU,
Triton on a GPU). Measured with :func:`compare` on this 2-core machine: aot_eager's
warm-up took 1.4 s and its first step (3 graphs) 0.4 s; inductor's, with an empty cache,
9 s and 4 s (1.5 s and 1.3 s once its on-disk cache held the kernels), too long for a
chapter; and inductor's later steps were no faster than eager ones for this small,
matmul-bound model. Backends without AOTAutograd (``"eager"``) leave backward to
autograd, op by op, so a graph's backward has no end to observe: :func:`compare` refuses
them.

The model. DDPOptimizer does not read DDP's buckets: it plans its own from the sizes of
the parameters in the captured graph, in reverse order of use, with DDP's cap
(``ddp_module.bucket_bytes_cap``, taken in ``torch/_dynamo/convert_frame.py``) but always
a 1 MiB first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, in
``torch/_dynamo/backends/distributed.py``). DDP (this PyTorch, 2.14) has a 1 MiB first
bucket only when ``bucket_cap_mb`` is not given; given, its first bucket has that cap too
(``_BucketCapacityConfig`` in ``torch/nn/parallel/distributed.py``). So at
``bucket_cap_mb=1`` and at the default the two plans agree, and at 2 they do not: here
DDP's buckets are (layers 2 and 1) and (layer 0), the graphs (layer 2) and (layers 1
and 0), and no all-reduce starts before backward has ended. The layers have no bias and
each weight is exactly 1 MiB, so each bucket holds one tensor: the order in which a
compiled graph hands over its gradients cannot move a bucket boundary (DDP rebuilds its
buckets after the first step, in the order gradients became ready).

The model is a class of our own. Dynamo does not trace DDP's own code: a frame it is
asked to evaluate (not one it inlines) is skipped by rule when it is in ``torch.nn``'s
files (``MOD_SKIPLIST`` in ``torch/_dynamo/trace_rules.py``), and DDP's
``_inside_ddp_forward`` is marked ``@torch._disable_dynamo(recursive=False)``. Tracing
starts again at the first frame outside those files, the wrapped model's ``forward``.
A ``torch.nn`` module's own ``forward`` (``nn.Sequential``'s, ``nn.Linear``'s) is such a
skipped frame too, unless the module has hooks (``check_verbose``), so
``DDP(nn.Sequential(...))`` compiled on this PyTorch yields no graph at all and runs
eagerly, without an error (:func:`sequential_graph_count`, :func:`explained_graph_counts`).

Dynamo reports a few things through ``logging`` with a timestamp (for example that it
ignores DDP's profiler label); :func:`compare` collects those records instead of
letting them reach stderr, and returns their messages.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ..runtime.ranks import rank, world_size

BACKENDS = ("aot_eager", "inductor")
WIDTHS = (256, 1024, 256, 1024)  # 3 bias-free layers of 256 x 1024 floats: 1 MiB each
MODES = ("eager", "DDPOptimizer", "one graph")


class BiasFreeMLP(nn.Module):
    """Linear layers without bias, ReLU between them."""

    def __init__(self, widths: tuple[int, ...] = WIDTHS):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False)
                                    for a, b in zip(widths[:-1], widths[1:], strict=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = layer(x)
            if index < len(self.layers) - 1:
                x = F.relu(x)
        return x


# ------------------------------------------------------------------ captured logs


class _Collect(logging.Filter):
    def __init__(self, into: list[str]):
        super().__init__()
        self.into = into
        # a record can pass several handlers; held here, so no other takes its id
        self.seen: dict[int, logging.LogRecord] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True  # what TORCH_LOGS asked for still prints
        if id(record) not in self.seen:
            self.seen[id(record)] = record
            self.into.append(record.getMessage())
        return False  # kept here, not printed


@contextmanager
def torch_warnings_collected() -> Iterator[list[str]]:
    """While active, the warnings (and errors) that ``torch``'s loggers would print to
    stderr, with a timestamp and a process id, go into the list it yields instead: their
    messages only."""
    collected: list[str] = []
    catcher = _Collect(collected)
    handlers = {handler for name, logger in logging.Logger.manager.loggerDict.items()
                if name.split(".")[0] == "torch" and isinstance(logger, logging.Logger)
                for handler in logger.handlers}
    for handler in handlers:
        handler.addFilter(catcher)
    try:
        yield collected
    finally:
        for handler in handlers:
            handler.removeFilter(catcher)


# ------------------------------------------------------------------ one run


def _batch(widths: tuple[int, ...], batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank())  # each rank its own data
    return (torch.randn(batch_size, widths[0], generator=generator),
            torch.randn(batch_size, widths[-1], generator=generator))


def _loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Squared error summed over a sample's outputs, averaged over the samples: the
    weights move by about 1e-2 in a few steps, far above any rounding difference."""
    return F.mse_loss(outputs, targets, reduction="sum") / len(outputs)


def _counting_backend(real: Callable, names: dict[int, str], graphs: list[list[str]],
                      events: dict) -> Callable:
    """A compiler backend that appends a slot to ``graphs`` for each graph it receives
    and hands the graph to ``real``. At run time each compiled graph writes the names of
    the parameters it was given (found by identity) into its slot and, while
    ``events["log"]`` is a list, notes when its backward finished."""

    def backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> Callable:
        index = len(graphs)
        graphs.append([])
        compiled = real(graph_module, example_inputs)

        def run(*args):
            outputs = compiled(*args)
            parameters = [names[id(a)] for a in args if id(a) in names]
            if not parameters:  # DDPOptimizer's trial call on fake tensors while compiling
                return outputs
            graphs[index] = parameters
            log = events["log"]
            if log is not None:
                flat = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
                nodes = {t.grad_fn for t in flat
                         if isinstance(t, torch.Tensor) and t.grad_fn is not None}
                for node in nodes:  # one node per graph: its compiled backward
                    node.register_hook(lambda *_: log.append(("backward", parameters)))
            return outputs

        return run

    return backend


def _run(mode: str, steps: int, bucket_cap_mb: float | None, backend: str, batch_size: int,
         widths: tuple[int, ...]) -> dict:
    torch.manual_seed(0)
    module = BiasFreeMLP(widths)
    names = {id(p): name for name, p in module.named_parameters()}
    start_weights = [p.detach().clone() for p in module.parameters()]
    ddp = DDP(module, bucket_cap_mb=bucket_cap_mb)
    events: dict = {"log": None}
    buckets: list[list[str]] = []

    def noted_allreduce(state, bucket):  # DDP's default hook, with a note of its start
        if events["log"] is not None:
            buckets.append([names[id(p)] for p in bucket.parameters()])
            events["log"].append(("all-reduce", buckets[-1]))
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, noted_allreduce)
    graphs: list[list[str]] = []
    if mode == "eager":
        model = ddp
    else:
        real = torch._dynamo.lookup_backend(backend)
        model = torch.compile(ddp, backend=_counting_backend(real, names, graphs, events))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    inputs, targets = _batch(widths, batch_size)
    step_s = []
    for step in range(steps):
        if step == steps - 1:  # the last step's order, once DDP has rebuilt its buckets
            events["log"] = []
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        _loss(model(inputs), targets).backward()
        optimizer.step()
        step_s.append(time.perf_counter() - began)
    weights = [p.detach().clone() for p in ddp.parameters()]
    moved = max((w - s).abs().max().item() for w, s in zip(weights, start_weights,
                                                            strict=True))
    return {"graphs": graphs, "buckets": buckets, "events": events["log"],
            "step_s": step_s, "weights": weights, "moved": moved}


# ------------------------------------------------------------------ the comparison


def _warm_up(backend: str) -> float:
    """Compiles and runs a one-layer model once: the first compilation in a process also
    loads and initialises the compiler's own modules, a cost no later one pays. Returns
    its seconds."""
    torch._dynamo.reset()
    began = time.perf_counter()
    layer = nn.Linear(4, 4)
    torch.compile(layer, backend=backend)(torch.ones(2, 4)).sum().backward()
    torch._dynamo.reset()
    return time.perf_counter() - began


def compare(steps: int = 5, bucket_cap_mb: float | None = 1.0, backend: str = "aot_eager",
            batch_size: int = 32, widths: tuple[int, ...] = WIDTHS) -> dict:
    """Inside a rank (2 or more, any backend's process group, CPU tensors): ``steps`` SGD
    steps of :class:`BiasFreeMLP` under DDP, eager, then compiled with DDPOptimizer, then
    compiled as one graph (``optimize_ddp=False``), after a warm-up compilation of a tiny
    model (the process's first compilation pays for loading the compiler). Dynamo is
    reset before and after each compiled run and its settings restored.

    Args:
        steps: SGD steps per run (2 or more: the first compiles, the rest are steady).
        bucket_cap_mb: DDP's bucket cap in MiB (None: DDP's default, 25 after a 1 MiB
            first bucket); 1 matches DDPOptimizer's first bucket.
        backend: ``"aot_eager"`` (no code generation) or ``"inductor"``.
        batch_size: samples per rank and step.
        widths: the layers' widths, input first.

    Returns ``runs``: for each of :data:`MODES`, ``graphs`` (per graph the parameters it
    holds, in compile order), ``buckets`` (per bucket its parameters, in the order the
    last step started their all-reduces), ``events`` (the last step's ``("backward",
    parameters of the graph)`` and ``("all-reduce", parameters of the bucket)``, in the
    order they happened: :func:`timeline` writes them out), ``step_s``,
    ``first_s`` (the first step: compiling, for a compiled run), ``steady_s`` (median of
    the others), ``max_diff`` (largest weight difference to eager DDP after the steps) and
    ``moved`` (largest change of a weight from its start); and ``torch_warnings``, the
    messages of the warnings ``torch`` logged meanwhile (collected, not printed), and
    ``warm_up_s``, the warm-up's seconds.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}: a backend "
                         "without AOTAutograd runs backward op by op, with no graph end")
    if steps < 2:
        raise ValueError(f"steps must be 2 or more (a first step and steady ones), got {steps}")
    if world_size() < 2:
        raise ValueError("compare needs 2 or more ranks (DDP's all-reduce is what it "
                         "watches); run it with mgpu_helpers.launch(..., nprocs=2)")
    runs = {}
    with torch_warnings_collected() as warned:
        warm_up_s = _warm_up(backend)
        for mode in MODES:
            torch._dynamo.reset()
            with torch._dynamo.config.patch(optimize_ddp=mode == "DDPOptimizer"):
                runs[mode] = _run(mode, steps, bucket_cap_mb, backend, batch_size, widths)
        torch._dynamo.reset()
    reference = runs["eager"]["weights"]
    for run in runs.values():
        weights = run.pop("weights")
        run["max_diff"] = max((w - r).abs().max().item()
                              for w, r in zip(weights, reference, strict=True))
        run["first_s"] = run["step_s"][0]
        run["steady_s"] = statistics.median(run["step_s"][1:])
    return {"backend": backend, "bucket_cap_mb": bucket_cap_mb, "warm_up_s": warm_up_s,
            "runs": runs, "torch_warnings": sorted(set(warned))}


def started_during_backward(events: list[tuple[str, list[str]]]) -> int:
    """How many all-reduces in ``events`` started while a backward graph was still to
    finish: those could overlap backward."""
    return sum(kind == "all-reduce" and any(later == "backward" for later, _ in events[i + 1:])
               for i, (kind, _) in enumerate(events))


def timeline(events: list[tuple[str, list[str]]]) -> str:
    """``events`` in one line, each with the numbers of its layers: ``backward(2) ->
    all-reduce(2) -> ...``."""
    def layers(names: list[str]) -> str:
        return "+".join(name.split(".")[1] for name in names)  # "layers.2.weight" -> "2"

    return " -> ".join(f"{kind}({layers(names)})" for kind, names in events)


def sequential_graph_count(widths: tuple[int, ...] = WIDTHS) -> int:
    """Inside a rank: how many graphs ``torch.compile`` captures from one forward and
    backward of DDP around an ``nn.Sequential`` of the same layers (0 on this PyTorch:
    it runs eagerly)."""
    torch._dynamo.reset()
    graphs: list = []

    def counting(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch.manual_seed(0)
    layers = BiasFreeMLP(widths).layers
    sequential = nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())][:-1])
    with torch_warnings_collected():
        model = torch.compile(DDP(sequential), backend=counting)
        inputs, targets = _batch(widths, 4)
        _loss(model(inputs), targets).backward()
    torch._dynamo.reset()
    return len(graphs)


def explained_graph_counts(widths: tuple[int, ...] = WIDTHS) -> dict[str, int]:
    """Inside a rank: the number of graphs ``torch._dynamo.explain`` reports for one
    forward pass of DDP around :class:`BiasFreeMLP`, around an ``nn.Sequential`` of the
    same layers, and around such an ``nn.Sequential`` with a (do-nothing) forward hook:
    the check that something was captured at all (0: nothing compiled)."""
    torch.manual_seed(0)
    mlp = BiasFreeMLP(widths)

    def sequential():
        return nn.Sequential(*[m for layer in mlp.layers for m in (layer, nn.ReLU())][:-1])

    hooked = sequential()
    hooked.register_forward_hook(lambda module, args, output: None)
    inputs, _ = _batch(widths, 4)
    counts = {}
    with torch_warnings_collected():
        for name, module in (("BiasFreeMLP", mlp), ("nn.Sequential", sequential()),
                             ("nn.Sequential with a hook", hooked)):
            torch._dynamo.reset()
            counts[name] = torch._dynamo.explain(DDP(module))(inputs).graph_count
    torch._dynamo.reset()
    return counts
