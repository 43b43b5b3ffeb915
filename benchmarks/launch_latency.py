"""Launch latency: `mgpu_helpers.launch` against the launchers a user would otherwise pick.

Each launcher runs, on 2 gloo ranks, a function that joins the process group, runs one
barrier and returns; the time is measured from the call to its return:

* `launch`, fork (the default on Linux);
* `launch`, spawn (what macOS/Windows use; the function travels with cloudpickle);
* `torch.multiprocessing.start_processes`, spawn (the raw PyTorch way);
* `torch.distributed.launcher.api.elastic_launch`, fork (torchrun's engine, which other
  notebook launchers wrap);
* Lightning Fabric's `ddp_fork` strategy (`Fabric(...).launch(fn)`), when Lightning is
  installed (`pip install -e ".[bench]"`); otherwise the run says it left Fabric out.
  Importing Lightning makes this process bigger, and a bigger process forks and exits
  more slowly, so Fabric runs last, and `launch` runs once more after it: the pair
  compared like for like.

Writes launch_latency.{json,png}. Run: `make bench`, or
`python benchmarks/launch_latency.py --repeats 10`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import socket
import statistics
import time
import uuid

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as torch_mp  # noqa: E402
from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # noqa: E402

from mgpu_helpers import launch  # noqa: E402

from results_dir import results_dir  # noqa: E402

# Optional (the `bench` extra). Imported only when its turn comes, last: a process that
# has imported Lightning is bigger, and every later fork (and spawned import) pays for it.
HAVE_FABRIC = importlib.util.find_spec("lightning") is not None

RESULTS = results_dir()  # runs/bench/ unless MGPU_BENCH_DIR says otherwise
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


def barrier_under_fabric(fabric) -> int:
    """Under Fabric: it has joined the group before calling; one barrier is the job."""
    fabric.barrier()
    return fabric.global_rank


def run_fabric_fork() -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_fork")
    fabric.launch(barrier_under_fabric)


LAUNCHERS = {  # elastic_launch late: it installs signal handlers in this process
    "launch (fork)": run_ours_fork,
    "launch (spawn)": run_ours_spawn,
    "start_processes (spawn)": run_start_processes,
    "elastic_launch (fork)": run_elastic_launch,
    **({"Fabric ddp_fork": run_fabric_fork,  # imports Lightning
        # like for like with Fabric: the same launch from a process that imported Lightning
        "launch (fork), Lightning imported": run_ours_fork} if HAVE_FABRIC else {}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    if not HAVE_FABRIC:
        print("Lightning is not installed: Fabric left out (pip install -e '.[bench]')")
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
    if "Fabric ddp_fork" in medians:
        targets["fork no slower than Fabric ddp_fork (both with Lightning imported)"] = (
            medians["launch (fork), Lightning imported"] <= medians["Fabric ddp_fork"])
    result = {
        "repeats": args.repeats, "ranks": 2, "backend": "gloo", "torch": torch.__version__,
        "cpus": os.cpu_count(), "seconds": times, "median_s": medians,
        "spawn_ratio_to_start_processes": (medians["launch (spawn)"]
                                           / medians["start_processes (spawn)"]),
        "fork_ratio_to_elastic_launch": (medians["launch (fork)"]
                                         / medians["elastic_launch (fork)"]),
        "fork_ratio_to_fabric": (medians["launch (fork), Lightning imported"]
                                 / medians["Fabric ddp_fork"]
                                 if "Fabric ddp_fork" in medians else None),
        "targets_met": targets,
    }
    (RESULTS / "launch_latency.json").write_text(json.dumps(result, indent=2) + "\n")

    fig, ax = plt.subplots(figsize=(7, 0.55 * len(medians) + 1))
    names = list(medians)
    ax.barh(names, [medians[n] for n in names],
            color=["C0" if n.startswith("launch") else "C7" for n in names])
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
    if result["fork_ratio_to_fabric"] is not None:
        print(f"fork / Fabric ddp_fork  : {result['fork_ratio_to_fabric']:.2f}x "
              "(both from a process that imported Lightning)")
    for target, met in targets.items():
        print(f"target {'met    ' if met else 'MISSED '} {target}")


if __name__ == "__main__":
    main()
