"""What a rank really sends, counted where every point-to-point message passes.

``dist.send``, ``dist.isend`` and ``batch_isend_irecv``'s ``P2POp`` all end in
``ProcessGroup.send``; a backend's own ``send`` (``ProcessGroupGloo.send``, reached with
``group._get_backend(device)``) sits below it. :func:`sends_counted` wraps both while a
block runs, so the count does not depend on the code under test counting its own messages.

A Python-level count can still be bypassed (a reference to the unwrapped method taken
earlier, a message through the TCPStore, a socket of one's own). :func:`traffic_measured`
adds what the kernel counts: the bytes written on each of this process's TCP sockets
(``getsockopt(TCP_INFO)``, Linux only), split into the store's sockets (those whose peer
port is ``MASTER_PORT``, the rendezvous store the launcher starts) and the backend's
peer sockets; and the calls of any ``Store`` method, or of a new ``TCPStore`` or
``FileStore``. (A socket opened and closed again inside the block leaves no count in the
kernel; the Python-level counts see how it was reached.) Off Linux (or on a kernel older than
4.19) the kernel's count is ``None`` and only the Python-level counts remain.

Ranks on one machine can also meet outside sockets: :func:`side_channels` records the
files opened for writing and the files mapped into memory while a block runs (Python's
audit events ``open`` and ``mmap.__new__``), and, on Linux, the shared memory mappings
(``/dev/shm``, ``memfd:``, a deleted file: a tensor's ``share_memory_()``, a
``SharedMemory`` block) that were created, or whose bytes changed, during the block,
inherited from the notebook's process or not.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import socket
import struct
import sys
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

# Store methods that move data (set_timeout, timeout, clone... do not), and the stores a
# process can reach other processes with (a new one: a connection or a file of its own)
_STORE_METHODS = ("add", "append", "check", "compare_set", "delete_key", "get", "list_keys",
                  "multi_get", "multi_set", "num_keys", "queue_len", "queue_pop", "queue_push",
                  "set", "wait")
_SHARED_STORES = ("TCPStore", "FileStore")


def _owner(cls: type, name: str) -> type | None:
    """The class in ``cls``'s MRO that defines ``name`` (where a wrapper must go)."""
    return next((klass for klass in cls.__mro__ if name in vars(klass)), None)


def _send_owners() -> list[type]:
    """The classes whose ``send`` a Python caller reaches: the process group, and the
    backends' base class (gloo's, and NCCL's where this build has it)."""
    owners = [dist.ProcessGroup]
    for name in ("ProcessGroupGloo", "ProcessGroupNCCL"):
        backend = getattr(dist, name, None)
        owner = _owner(backend, "send") if backend is not None else None
        if owner is not None and owner not in owners:
            owners.append(owner)
    return owners


@contextmanager
def _wrapped(owners: list[type], name: str, hook, first: bool = False):
    """``owner.name`` replaced, while the block runs, by a function that calls the
    original, then ``hook(args, kwargs)`` once it has returned (a message whose call
    raised moved nothing); with ``first``, the hook runs before the call (any attempt
    counts)."""
    originals = {owner: vars(owner)[name] for owner in owners}

    def wrapper_for(original):
        def counting(this, *args, **kwargs):
            if first:
                hook(args, kwargs)
            result = original(this, *args, **kwargs)
            if not first:
                hook(args, kwargs)
            return result
        return counting

    for owner, original in originals.items():
        setattr(owner, name, wrapper_for(original))
    try:
        yield
    finally:
        for owner, original in originals.items():
            setattr(owner, name, original)


def _message(args, kwargs, peer_name: str) -> tuple[int, int, int]:
    """(peer, elements, bytes) of a ``send``/``recv`` call: ``(tensors, peer, tag)``."""
    tensors = args[0] if args else kwargs.get("tensors", [])
    peer = args[1] if len(args) > 1 else kwargs.get(peer_name, -1)
    return (peer, sum(t.numel() for t in tensors),
            sum(t.numel() * t.element_size() for t in tensors))


@contextmanager
def sends_counted():
    """Inside a rank: a list that receives ``(peer, bytes)`` for every message this rank
    sends while the block runs (``peer`` is the rank in the group the message uses),
    through a process group's ``send`` or a backend's."""
    sent: list[tuple[int, int]] = []
    with _wrapped(_send_owners(), "send", lambda args, kwargs: sent.append(
            _message(args, kwargs, "dstRank")[::2])):
        yield sent


# ------------------------------------------------------------ the kernel's count

_TCP_INFO_BYTES_RECEIVED = 128  # offsets into Linux's struct tcp_info
_TCP_INFO_NOTSENT_BYTES = 144
_TCP_INFO_BYTES_SENT = 200      # with tcpi_bytes_retrans after it (Linux 4.19)
_TCP_INFO_LENGTH = 216


def _tcp_counts(sock: socket.socket) -> tuple[int, int] | None:
    """(bytes the process wrote, bytes received) on a TCP socket, from the kernel.
    Written: sent once (``tcpi_bytes_sent`` less retransmissions) plus not sent yet, so
    the count is complete as soon as the write returns, acknowledged or not."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    if len(info) < _TCP_INFO_LENGTH:
        return None
    (received,) = struct.unpack_from("Q", info, _TCP_INFO_BYTES_RECEIVED)
    (not_sent,) = struct.unpack_from("I", info, _TCP_INFO_NOTSENT_BYTES)
    sent, retransmitted = struct.unpack_from("QQ", info, _TCP_INFO_BYTES_SENT)
    return sent - retransmitted + not_sent, received


def tcp_sockets() -> dict[str, tuple[str, int, int]] | None:
    """Every TCP socket this process holds: its ``/proc`` name -> (kind, bytes written,
    bytes received), kind "store" (a client of the rendezvous store: peer port
    ``MASTER_PORT``), "server" (the store's own end, in the rank that hosts it: what
    other ranks send it is theirs to count) or "peer". None where the kernel does not
    say (not Linux, or a kernel before 4.19)."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "TCP_INFO"):
        return None
    store_port = int(os.environ.get("MASTER_PORT", "-1") or -1)
    found: dict[str, tuple[str, int, int]] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
            if not name.startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:  # closed in the meantime
            continue
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                      socket.AF_INET6):
                continue
            try:
                peer_port = sock.getpeername()[1]
            except OSError:  # a listening socket: it carries nothing
                continue
            counts = _tcp_counts(sock)
            if counts is None:
                return None
            kind = ("store" if peer_port == store_port else
                    "server" if sock.getsockname()[1] == store_port else "peer")
            found[name] = (kind, *counts)
    return found


@dataclass
class KernelBytes:
    """What the kernel counted on this process's TCP sockets while a block ran."""

    peer_written: int = 0   # written on the backend's sockets that existed before
    store: int = 0          # on a store client's socket, or a new one the store accepted
    new_sockets: int = 0    # written or received on other sockets opened meanwhile


def kernel_bytes_between(before: dict, after: dict) -> KernelBytes:
    """The difference of two :func:`tcp_sockets` snapshots."""
    counted = KernelBytes()
    for name, (kind, written, received) in after.items():
        old = before.get(name)
        if old is not None and old[0] != kind:  # the number was reused for another socket
            old = None
        written -= old[1] if old else 0
        received -= old[2] if old else 0
        if kind == "store" or (kind == "server" and old is None):  # a new client's
            counted.store += written + received
        elif kind == "peer" and old is not None:
            counted.peer_written += written
        elif kind == "peer":
            counted.new_sockets += written + received
    return counted


# ------------------------------------------------------------ files and shared memory

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_NOT_A_CHANNEL = ("/dev/null", "/dev/tty", "/dev/stdout", "/dev/stderr")
_recording: list[tuple[list[str], tuple[str, ...]]] = []  # the blocks recording now
_audit_installed = False
# a shared mapping larger than this is noted by its size, not hashed (hashing reads it)
_HASHED_BYTES = 256 << 20


def _audit(event: str, args: tuple) -> None:
    if not _recording or event not in ("open", "mmap.__new__"):
        return
    if event == "open":
        path, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE_FLAGS)
        name = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path)
        if not writes or name in _NOT_A_CHANNEL or name.endswith(".pyc") or \
                "__pycache__" in name:  # an import compiling a module is no message
            return
        for found, ignored in _recording:
            if not any(name.startswith(prefix) for prefix in ignored):
                found.append(f"wrote to the file {name}")
    else:
        fileno = args[0]
        if fileno != -1:  # an anonymous mapping is this process's alone
            for found, _ in _recording:
                found.append(f"mapped a file into memory (file descriptor {fileno})")


def shared_mappings() -> dict[str, tuple[int, int, str]] | None:
    """This process's writable shared mappings that another process can reach:
    name -> (start, end, hash of the bytes or their size). None off Linux. GPU and
    kernel mappings (``/dev/...`` but ``/dev/shm``, ``anon_inode:``) are not channels."""
    try:
        lines = open("/proc/self/maps").read().splitlines()
    except OSError:
        return None
    found = {}
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not re.fullmatch(r"rw.s", parts[1]):
            continue
        path = parts[5]
        if path.startswith("anon_inode:") or (path.startswith("/dev/")
                                               and not path.startswith("/dev/shm/")):
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if end - start > _HASHED_BYTES:
            digest = f"{end - start} bytes, not hashed"
        else:
            digest = hashlib.blake2b(ctypes.string_at(start, end - start),
                                     digest_size=16).hexdigest()
        found[f"{path} at {start:#x}"] = (start, end, digest)
    return found


@contextmanager
def side_channels(ignored: tuple[str, ...] = ()):
    """Inside a rank: a list that receives, in words, each way the block could have
    reached another process outside sockets: a file opened for writing (paths starting
    with one of ``ignored`` aside), a file mapped into memory, a shared mapping created
    or written. (Sockets are :func:`traffic_measured`'s to count.)"""
    global _audit_installed
    if not _audit_installed:  # an audit hook cannot be removed: it stays, idle
        sys.addaudithook(_audit)
        _audit_installed = True
    found: list[str] = []
    before = shared_mappings()
    _recording.append((found, ignored))
    try:
        yield found
    finally:
        _recording.remove((found, ignored))
    after = shared_mappings()
    if before is None or after is None:
        return
    for name, (_, _, digest) in after.items():
        if name not in before:
            found.append(f"created shared memory ({name.split(' at ')[0]})")
        elif before[name][2] != digest:
            found.append(f"wrote to shared memory ({name.split(' at ')[0]})")


@dataclass
class Traffic:
    """What a rank did while :func:`traffic_measured` ran: its messages, as
    ``(peer, elements, bytes)``, counted in Python at the process group and the backend;
    the messages it received; the ``Store`` methods it called; what the kernel counted
    (None where it does not say)."""

    sent: list[tuple[int, int, int]] = field(default_factory=list)
    received: list[tuple[int, int, int]] = field(default_factory=list)
    store_calls: list[str] = field(default_factory=list)
    kernel: KernelBytes | None = None
    side_channels: list[str] = field(default_factory=list)  # files, shared memory


@contextmanager
def traffic_measured(ignored_paths: tuple[str, ...] = ()):
    """Inside a rank: a :class:`Traffic` filled in while the block runs (the kernel's
    count and the shared memory when it ends); files written under ``ignored_paths``
    are not side channels (the checker's own)."""
    traffic = Traffic()
    before = tcp_sockets()
    owners = _send_owners()

    def store_hook(method):
        return lambda args, kwargs: traffic.store_calls.append(method)

    with ExitStack() as wrappers:
        # entered first, so it ends last: its list is complete when the block has ended
        traffic.side_channels = wrappers.enter_context(side_channels(ignored_paths))
        wrappers.enter_context(_wrapped(owners, "send", lambda args, kwargs: traffic.sent.append(
            _message(args, kwargs, "dstRank"))))
        wrappers.enter_context(_wrapped(owners, "recv", lambda args, kwargs: traffic.received
                                        .append(_message(args, kwargs, "srcRank"))))
        wrappers.enter_context(_wrapped(owners, "recv_anysource", lambda args, kwargs: traffic
                                        .received.append((-1, *_message(args, kwargs, "")[1:]))))
        for method in _STORE_METHODS:
            if method in vars(dist.Store):
                wrappers.enter_context(_wrapped([dist.Store], method, store_hook(method),
                                                first=True))
        for name in _SHARED_STORES:
            store = getattr(dist, name, None)
            if store is not None and "__init__" in vars(store):
                wrappers.enter_context(_wrapped([store], "__init__", store_hook(f"{name}(...)"),
                                                first=True))
        yield traffic
        after = tcp_sockets()
    if before is not None and after is not None:
        traffic.kernel = kernel_bytes_between(before, after)
