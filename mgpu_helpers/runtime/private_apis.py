"""The one home of the private PyTorch and Python interfaces the workbook calls.

Each function below reaches one name that is not part of a public API, because no public
route gives the same answer (each docstring says why). A private name can change or
vanish in any release, so none is used anywhere else in the package, the chapters, the
scripts or the benchmarks (``tests/workbook/test_layout.py`` checks it): a new release breaks this
one file, and with an error that names the missing interface and the versions involved
instead of an ``AttributeError`` deep inside a rank.

Checked with the pinned PyTorch (2.14.1, requirements/constraints.txt), and with Python
3.10 to 3.13 for the two Python interfaces.
"""

from __future__ import annotations

import platform
import sys

import torch

CHECKED_TORCH = "2.14.1"
CHECKED_PYTHON = "3.10 to 3.13"


class PrivateAPIMissing(RuntimeError):
    """A private interface the workbook relies on is not in this PyTorch or Python."""


def _find(owner, path: str, what: str, python: bool = False):
    """``owner.<path>`` (dotted), or an error naming it, this release and what it did."""
    found = owner
    for part in path.split("."):
        found = getattr(found, part, None)
        if found is None:
            break
    if found is not None:
        return found
    if python:
        release = f"Python {platform.python_version()}, checked with Python {CHECKED_PYTHON}"
    else:
        release = f"PyTorch {torch.__version__}, checked with PyTorch {CHECKED_TORCH}"
    raise PrivateAPIMissing(
        f"{getattr(owner, '__name__', type(owner).__name__)}.{path} is missing in {release}. "
        f"The workbook uses it to {what}; it is private and this release changed it. Use a "
        "checked release (requirements/constraints.txt pins one), or update "
        "mgpu_helpers/runtime/private_apis.py for this one.")


# ------------------------------------------------------------------ CUDA, no init


def nvml_device_count() -> int:
    """The GPUs a process started from here would see, counted by NVML, or -1 where NVML
    cannot count them. ``torch.cuda.device_count()`` answers the same but may initialise
    the CUDA driver where NVML is absent, after which forking ranks is unsafe; this never
    does. Honours ``CUDA_VISIBLE_DEVICES``."""
    return _find(torch.cuda, "_device_count_nvml", "count GPUs without initialising CUDA")()


def cudnn_library_version() -> int | None:
    """cuDNN's version as an integer (92400), read from the library alone, or None in a
    build without cuDNN. ``torch.backends.cudnn.version()`` answers the same but first
    calls ``torch.cuda.is_available()``, a CUDA call that a process forking ranks must not
    make; the environment report asks this in the notebook kernel itself."""
    cudnn = getattr(torch._C, "_cudnn", None)
    if cudnn is None:
        return None
    return int(_find(cudnn, "getVersionInt", "read cuDNN's version without CUDA")())


def cuda_in_bad_fork() -> bool:
    """True in a process forked from one that had initialised CUDA: CUDA cannot work here.
    The public calls raise only once CUDA is used; a launched rank asks first so that it
    fails with advice instead of CUDA's own error."""
    return bool(_find(torch.cuda, "_is_in_bad_fork", "detect a poisoned fork")())


# ------------------------------------------------------- torch.distributed records


def flight_recorder_dump(stack_traces: bool = False) -> bytes:
    """This process's flight recorder for its gloo groups, pickled: the entries of the
    collectives it ran (the dump ``TORCH_FR_DUMP_TEMP_FILE`` writes on a timeout). No
    public call returns it; ``torch.distributed.flight_recorder`` only reads dumps."""
    dump = _find(torch._C._distributed_c10d, "_dump_fr_trace",
                 "read the flight recorder of the gloo process groups")
    return dump(includeStackTraces=stack_traces)


def ddp_logging_data(model) -> dict:
    """DistributedDataParallel's debugging record (bucket sizes, unused parameters, whether
    buckets were rebuilt...). A prototype interface: DDP's documentation points to it,
    and nothing public exposes the reducer's buckets."""
    return _find(model, "_get_ddp_logging_data", "read DDP's bucket and unused-parameter "
                 "record")()


# ------------------------------------------------------------------- the profiler


def profiler_event_tree(profile) -> list:
    """The root events of a finished ``torch.profiler.profile``, each with ``children``:
    the only form that carries every allocation with the allocator's running total
    (``profile_memory=True``). ``key_averages()`` and the Chrome trace lose the order."""
    results = _find(profile, "profiler.kineto_results", "read the profiler's event tree")
    return _find(results, "experimental_event_tree", "read the profiler's event tree")()


def is_allocation(event) -> bool:
    """Whether an event of :func:`profiler_event_tree` is an allocation or a free."""
    from torch._C import _profiler

    kinds = _find(_profiler, "_EventType.Allocation", "tell allocation events apart")
    return event.tag == kinds


# ---------------------------------------------------------- a process's own ending


def run_multiprocessing_finalizers() -> None:
    """What a multiprocessing child runs after its target returns: the registered
    finalizers, daemonic children terminated, the others joined. A launched rank ends
    with ``os._exit`` and runs this first, as ``multiprocessing`` itself does; the only
    public trigger is a normal interpreter exit."""
    import multiprocessing.util

    _find(multiprocessing.util, "_exit_function", "end a rank as multiprocessing ends "
          "a process", python=True)()


def join_non_daemon_threads() -> None:
    """Join the non-daemon threads and thread pools, as the interpreter does at exit
    (``threading._shutdown``), before a rank leaves with ``os._exit``. Joining the threads
    one by one would miss the pools' shutdown hooks."""
    _find(sys.modules["threading"], "_shutdown", "join a rank's threads before it ends",
          python=True)()
