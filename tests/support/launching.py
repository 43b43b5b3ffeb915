"""What the launcher's tests share: the scripts they run in a process of their own, and
the functions several of them launch (importable by name, so spawned ranks reach them)."""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

import mgpu_helpers as mh

SCRIPTS = Path(__file__).resolve().parents[1] / "launch_scripts"


def run_script(*command, env=None, timeout=180):
    return subprocess.run([*command], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def where_am_i():
    return {"rank": mh.rank(), "world": mh.world_size(), "local": mh.local_rank(),
            "device": str(mh.device()), "main": mh.is_main(),
            "threads": torch.get_num_threads(), "addr": os.environ["MASTER_ADDR"]}


def rank1_raises_while_rank0_waits():
    if mh.rank() == 1:
        time.sleep(0.2)
        raise ValueError("boom")
    dist.barrier()


def rank1_dies(how):
    if mh.rank() == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
