"""Helpers for the multi-GPU PyTorch workbook.

The notebooks in ``notebooks/`` teach the concepts; this package holds only the
boilerplate around them (environment report, process launching, plotting).
"""

from .launcher import LaunchError, launch
from .runtime.env import describe
from .runtime.notebook_settings import check_notebook_settings
from .runtime.ranks import device, is_main, local_rank, print0, rank, restart_count, world_size
from .runtime.visible_devices import parse_cuda_visible_devices
from .source import show

__all__ = [
    "LaunchError", "check_notebook_settings", "describe", "device", "exercises", "is_main",
    "launch", "local_rank", "parse_cuda_visible_devices", "print0", "rank", "restart_count",
    "show", "world_size",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # ``mh.exercises``, the chapters' checked exercises, loads on first use: it is chapter
    # material (it may import the labs), not part of the core a reader's code imports.
    if name == "exercises":
        import importlib

        return importlib.import_module(f"{__name__}.exercises")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
