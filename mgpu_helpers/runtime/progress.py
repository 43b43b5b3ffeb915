"""Progress bars that suit where the code runs.

In a notebook's kernel, ``tqdm.auto`` draws a widget bar (text in a terminal or under
nbval). A rank forked from that kernel must not: it inherits the kernel's connection to
the front end, which belongs to the parent, so its widget messages are dropped (the
kernel logs "attempted to send message from fork") and the reader sees no bar. Inside a
launched rank the bar is text instead, which the launcher relays live, prefixed with
``[rank k]``.
"""

from __future__ import annotations

import os

from tqdm import tqdm as text_tqdm
from tqdm.auto import tqdm as auto_tqdm

from .ranks import INSIDE_RANK_VAR


def progress_bar(iterable=None, **options):
    """``tqdm(iterable, **options)``: a text bar inside a launched rank, else ``tqdm.auto``."""
    bar_type = text_tqdm if os.environ.get(INSIDE_RANK_VAR) else auto_tqdm
    return bar_type(iterable, **options)
