"""What a rank really sends, counted where every point-to-point message passes.

``dist.send``, ``dist.isend`` and ``batch_isend_irecv``'s ``P2POp`` all end in
``ProcessGroup.send``; :func:`sends_counted` wraps that method while a block runs, so the
count does not depend on the code under test counting its own messages. (A caller can
still reach a backend's ``send`` below the process group, or talk through the TCPStore;
the exercise checkers refuse those separately.)
"""

from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def sends_counted():
    """Inside a rank: a list that receives ``(peer, bytes)`` for every message this rank
    sends while the block runs (``peer`` is the rank in the group the message uses)."""
    sent: list[tuple[int, int]] = []
    original = dist.ProcessGroup.send

    def counting(group, tensors, *args, **kwargs):
        peer = args[0] if args else kwargs.get("dstRank")
        sent.append((peer, sum(t.numel() * t.element_size() for t in tensors)))
        return original(group, tensors, *args, **kwargs)

    dist.ProcessGroup.send = counting
    try:
        yield sent
    finally:
        dist.ProcessGroup.send = original
