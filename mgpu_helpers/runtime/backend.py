"""How the workbook runs ranks on this machine: the process-group backend, the device a
rank computes on, and how many ranks a GPU-capable cell starts (the plan).

The policy is one rule: with GPUs (and a PyTorch build with NCCL), one rank per GPU in a
group that moves CUDA tensors over NCCL and CPU tensors over gloo; without, CPU ranks over
gloo. CPU checks ignore the plan and pin gloo (CONTRIBUTING.md, "the GPU rule").
"""

from __future__ import annotations

from dataclasses import dataclass

#: Ranks the workbook simulates as CPU processes when there is no GPU.
SIMULATED_RANKS = 2


#: What ``backend="auto"`` means on a machine with GPUs and NCCL: one process group with
#: two backends, NCCL for CUDA tensors and gloo for CPU tensors. A GPU-capable cell then
#: all-reduces its CUDA gradients over NCCL, and a small CPU tensor (a metric, a flag)
#: still works, where a pure NCCL group would refuse it.
GPU_BACKEND = "cpu:gloo,cuda:nccl"


def auto_backend(gpu_count: int, nccl_available: bool) -> str:
    """The backend ``launch(backend="auto")`` uses: NCCL (+ gloo for CPU tensors) with
    GPUs and a PyTorch build that has NCCL, else gloo (ranks compute on the CPU)."""
    return GPU_BACKEND if gpu_count > 0 and nccl_available else "gloo"


def backend_device_type(backend: str) -> str:
    """``"cuda"`` when a group created with ``backend`` moves CUDA tensors (NCCL), else
    ``"cpu"``: the device a rank of such a group computes on."""
    return "cuda" if "nccl" in str(backend) else "cpu"


@dataclass(frozen=True)
class DevicePlan:
    """How the workbook will run parallel ranks on this machine."""

    nprocs: int
    backend: str
    device_type: str
    summary: str


def plan_for(gpu_count: int, nccl_available: bool, usable_cores: int,
             gpus_without_cuda: int = 0) -> DevicePlan:
    """The plan of GPU-capable cells: one process per GPU (NCCL for CUDA tensors, gloo
    for CPU tensors), else CPU ranks over gloo. CPU checks ignore it: they pin gloo.

    ``gpu_count`` counts the GPUs CUDA starts on (``devices.gpu_count().usable``, what
    ``launch()`` goes by); ``gpus_without_cuda``, those the driver lists but CUDA cannot
    start on (a driver too old for the build): no GPUs to the plan, only to its summary.
    """
    backend = auto_backend(gpu_count, nccl_available)
    if gpu_count > 0 and backend != "gloo":
        noun = "GPU" if gpu_count == 1 else "GPUs"
        summary = (f"{gpu_count} {noun}: one process per GPU, NCCL for CUDA tensors "
                   "(gloo for CPU tensors)")
        return DevicePlan(gpu_count, backend, "cuda", summary)
    if gpu_count > 0:
        summary = (f"{gpu_count} GPU(s), but this PyTorch build has no NCCL: "
                   f"{SIMULATED_RANKS} ranks compute on the CPU over gloo")
        return DevicePlan(SIMULATED_RANKS, "gloo", "cpu", summary)
    unusable = ""
    if gpus_without_cuda > 0:
        noun = "GPU" if gpus_without_cuda == 1 else "GPUs"
        unusable = (f"{gpus_without_cuda} {noun} found, but CUDA cannot start on "
                    f"{'it' if gpus_without_cuda == 1 else 'them'} (see Problem): ")
    summary = (f"{unusable or 'no GPU: '}{SIMULATED_RANKS} ranks simulated as CPU processes "
               "over gloo "
               f"(one thread each, on {usable_cores} usable CPU core"
               f"{'' if usable_cores == 1 else 's'})")
    return DevicePlan(SIMULATED_RANKS, "gloo", "cpu", summary)
