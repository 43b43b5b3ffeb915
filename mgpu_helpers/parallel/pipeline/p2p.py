"""The pipeline's point-to-point protocol between neighbouring ranks, over gloo.

Before its first activation crosses a cut, a rank sends a *header*: the activation's
number of dimensions, dtype and shape, as a small int64 tensor, so that the receiver can
allocate the buffers for every micro-batch. Then come the activations, forward, and
their gradients, back. Where two ranks exchange messages across several cuts (a rank
holding several virtual stages), each message carries the tag :func:`message_tag` gives
its cut and kind.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

MAX_DIMS = 6
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_KINDS = ("header", "activation", "gradient")


def message_tag(cut: int, kind: str) -> int:
    """The tag of a ``kind`` message ("header", "activation" or "gradient") across
    ``cut``, the cut between model pieces ``cut`` and ``cut + 1``: three tags per cut,
    so no two messages between the same two ranks share one."""
    if kind not in _KINDS:
        raise ValueError(f"message kind must be one of {_KINDS}, got {kind!r}")
    if not isinstance(cut, int) or cut < 0:
        raise ValueError(f"cut must be a whole number >= 0 (the cut after piece 0 is 0), "
                         f"got {cut!r}")
    return len(_KINDS) * cut + _KINDS.index(kind)


# --------------------------------------------------------------------- headers


def _header(tensor: torch.Tensor) -> torch.Tensor:
    """The shape and dtype of ``tensor``, as a small tensor the next rank can receive."""
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"can send at most {MAX_DIMS}-dimensional tensors")
    header = torch.zeros(MAX_DIMS + 2, dtype=torch.int64)
    header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
    header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
    return header


def _header_buffer() -> torch.Tensor:
    return torch.zeros(MAX_DIMS + 2, dtype=torch.int64)


def read_header(header: torch.Tensor) -> tuple[list[int], torch.dtype]:
    """The shape and dtype a received header announces."""
    dims = int(header[0])
    return header[2:2 + dims].tolist(), _DTYPES[int(header[1])]


def send_header(tensor: torch.Tensor, dst: int, overlap: bool = False, tag: int = 0) -> tuple:
    """Tell the next rank the shape and dtype of every micro-batch's activation like
    ``tensor``; blocking, or non-blocking with ``overlap`` (as :func:`send`)."""
    return send(_header(tensor), dst, overlap, tag)


def recv_header(src: int) -> tuple[list[int], torch.dtype]:
    """Wait for the previous rank's header: the shape and dtype it will send."""
    header = _header_buffer()
    dist.recv(header, src)
    return read_header(header)


def post_header_receive(src: int, tag: int) -> tuple:
    """Post the receive of a header ahead of time: (buffer, work); once the work is
    done, :func:`read_header` reads the buffer."""
    buffer = _header_buffer()
    return buffer, dist.irecv(buffer, src, tag=tag)


# ------------------------------------------------------- activations, gradients


def send(tensor: torch.Tensor, dst: int, overlap: bool, tag: int = 0) -> tuple:
    """Send ``tensor``: non-blocking with ``overlap`` (the buffer and its work, to be
    waited on later), else blocking until the receiver has it (the buffer, None)."""
    data = tensor.detach().contiguous()
    if overlap:
        return data, dist.isend(data, dst, tag=tag)
    dist.send(data, dst, tag=tag)
    return data, None


def post_receives(shapes: Sequence, dtype: torch.dtype, src: int, tag: int = 0) -> list:
    """Post every receive at once, before the data is needed: (buffer, work) pairs.

    A message that arrives before its receive is posted waits for the sender to
    transmit it later, and on a busy CPU the sender may be slow to do so (gloo); with
    receives posted early, data flows as soon as it is sent."""
    buffers = [torch.empty(shape, dtype=dtype) for shape in shapes]
    return [(buffer, dist.irecv(buffer, src, tag=tag)) for buffer in buffers]


def require_cpu(stage_modules: Sequence[nn.Module], step: str) -> None:
    """The from-scratch steps are CPU code over gloo: their receive buffers are CPU
    tensors, and the interleaved step tells messages apart by tag, which NCCL does not
    match on. A stage module on a GPU gets an error that says what to use instead."""
    for stage_module in stage_modules:
        for name, parameter in stage_module.named_parameters():
            if parameter.device.type != "cpu":
                raise ValueError(
                    f"{step} runs its stage modules on the CPU over gloo, but parameter "
                    f"{name!r} is on {parameter.device}; for GPU stages use "
                    "torch.distributed.pipelining (PipelineStage with a schedule such as "
                    "ScheduleGPipe or Schedule1F1B)")
