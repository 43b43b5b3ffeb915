"""Helpers for the multi-GPU PyTorch workbook.

The notebooks in ``notebooks/`` teach the concepts; this package holds only the
boilerplate around them (environment report, process launching, plotting).
"""

from .env import describe
from .visible_devices import parse_cuda_visible_devices

__all__ = ["describe", "parse_cuda_visible_devices"]
__version__ = "0.1.0"
