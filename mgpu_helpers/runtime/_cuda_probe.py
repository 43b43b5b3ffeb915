"""Ask CUDA about the GPUs, in a child process, and print the answer as JSON.

Run as ``python -m mgpu_helpers.runtime._cuda_probe``. It lives in its own process because
asking CUDA about its devices (their names, memory and capability; the device count
too, where NVML cannot answer it) initialises the driver, and a process whose driver is
initialised cannot safely fork: later chapters fork training ranks from
the notebook kernel, so the kernel itself must never touch CUDA.
"""

from __future__ import annotations

import json


def _first_sentence(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    sentence, dot, _ = lines[0].partition(". ")
    return sentence + dot.strip()


def probe() -> dict:
    """Everything the environment report needs from CUDA, as plain data."""
    import torch

    facts: dict = {"device_count": 0, "gpus": [], "cuda_error": None,
                   "cudnn_version": None, "nccl_version": None}
    if torch.backends.cudnn.is_available():
        facts["cudnn_version"] = torch.backends.cudnn.version()
    if torch.distributed.is_available() and torch.distributed.is_nccl_available():
        facts["nccl_version"] = ".".join(str(p) for p in torch.cuda.nccl.version())
    try:
        torch.cuda.init()
    except (RuntimeError, AssertionError) as exc:
        facts["cuda_error"] = _first_sentence(exc)
        return facts
    facts["device_count"] = torch.cuda.device_count()
    for index in range(facts["device_count"]):
        props = torch.cuda.get_device_properties(index)
        facts["gpus"].append({
            "index": index,
            "name": props.name,
            "total_memory_bytes": props.total_memory,
            "capability": [props.major, props.minor],
        })
    return facts


if __name__ == "__main__":
    print(json.dumps(probe()))
