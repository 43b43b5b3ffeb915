"""Launch latency: `mgpu_helpers.launch` against the launchers a user would otherwise pick.

Each launcher runs, on 2 gloo ranks, a function that joins the process group, runs one
barrier and returns; the time is measured from the call to its return:

* `launch`, fork (the default on Linux);
* `launch`, spawn (what macOS/Windows use; the function travels with cloudpickle);
* `torch.multiprocessing.start_processes`, spawn (the raw PyTorch way);
* `torch.distributed.launcher.api.elastic_launch`, fork (torchrun's engine, which other
  notebook launchers wrap).

Writes benchmarks/results/launch_latency.{json,png}. Run: `make bench`, or
`python benchmarks/launch_latency.py --repeats 10`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time
import uuid
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as torch_mp  # noqa: E402
from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # noqa: E402

from mgpu_helpers import launch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TIMEOUT = datetime.timedelta(seconds=30)


def barrier_once():
    """Under `launch`: the group is ready, so one barrier is the whole job."""
    dist.barrier()
    return dist.get_rank()


def barrier_from_env():
    """Under elastic_launch: the environment describes the group; join, barrier, leave."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=TIMEOUT)
    dist.barrier()
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank


def barrier_in_spawned(index: int, port: int, world_size: int) -> None:
    """Under start_processes: the caller sets up the group by hand, as tutorials do."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=index, world_size=world_size, timeout=TIMEOUT)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ours_fork() -> None:
    launch(barrier_once, nprocs=2, backend="gloo", start_method="fork")  # gloo, as the others


def run_ours_spawn() -> None:
    launch(barrier_once, nprocs=2, backend="gloo", start_method="spawn")  # gloo, as the others


def run_start_processes() -> None:
    torch_mp.start_processes(barrier_in_spawned, args=(free_port(), 2), nprocs=2,
                             start_method="spawn")


def run_elastic_launch() -> None:
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
                          max_restarts=0, start_method="fork", monitor_interval=0.05)
    elastic_launch(config, barrier_from_env)()


LAUNCHERS = {  # elastic_launch last: it installs signal handlers in this process
    "launch (fork)": run_ours_fork,
    "launch (spawn)": run_ours_spawn,
    "start_processes (spawn)": run_start_processes,
    "elastic_launch (fork)": run_elastic_launch,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    times: dict[str, list[float]] = {}
    for name, run in LAUNCHERS.items():
        run()  # warm-up: first-use costs (imports, page cache) are not launch latency
        times[name] = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
        print(f"{name:<24} median {statistics.median(times[name]):6.3f} s")

    medians = {name: statistics.median(values) for name, values in times.items()}
    targets = {
        "fork median <= 0.5 s": medians["launch (fork)"] <= 0.5,
        "fork no slower than elastic_launch": (medians["launch (fork)"]
                                               <= medians["elastic_launch (fork)"]),
        "spawn within 1.2x of start_processes": (medians["launch (spawn)"]
                                                 <= 1.2 * medians["start_processes (spawn)"]),
    }
    result = {
        "repeats": args.repeats, "ranks": 2, "backend": "gloo", "torch": torch.__version__,
        "cpus": os.cpu_count(), "seconds": times, "median_s": medians,
        "spawn_ratio_to_start_processes": (medians["launch (spawn)"]
                                           / medians["start_processes (spawn)"]),
        "fork_ratio_to_elastic_launch": (medians["launch (fork)"]
                                         / medians["elastic_launch (fork)"]),
        "targets_met": targets,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "launch_latency.json").write_text(json.dumps(result, indent=2) + "\n")

    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = list(medians)
    ax.barh(names, [medians[n] for n in names], color=["C0", "C0", "C7", "C7"])
    for y, name in enumerate(names):
        ax.text(medians[name], y, f" {medians[name]:.2f} s", va="center")
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds from call to return (median of {args.repeats}, 2 gloo ranks)")
    ax.set_title("Launch latency: init + one barrier + teardown")
    ax.set_xlim(0, max(medians.values()) * 1.25)
    fig.tight_layout()
    fig.savefig(RESULTS / "launch_latency.png", dpi=120)

    print(f"spawn / start_processes : {result['spawn_ratio_to_start_processes']:.2f}x")
    print(f"fork / elastic_launch   : {result['fork_ratio_to_elastic_launch']:.2f}x")
    for target, met in targets.items():
        print(f"target {'met    ' if met else 'MISSED '} {target}")


if __name__ == "__main__":
    main()
