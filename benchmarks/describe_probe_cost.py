"""What fork safety costs: describe()'s child-process CUDA probe vs asking CUDA in-process.

`mgpu_helpers.describe()` asks CUDA its questions from a child process so that the
calling process (a notebook kernel that later forks ranks) never initialises CUDA. The
alternative a user would write is `torch.cuda.is_available()` / `device_count()` /
`get_device_properties()` in the kernel itself: fast, but on a GPU machine it
initialises the driver and poisons later forks. This benchmark measures both in one
run and writes describe_probe_cost.{json,png}.

Run: `make bench` (or `python benchmarks/describe_probe_cost.py --repeats 5`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from mgpu_helpers import describe  # noqa: E402

from results_dir import results_dir  # noqa: E402

RESULTS = results_dir()  # runs/bench/ unless MGPU_BENCH_DIR says otherwise


def in_process_queries() -> int:
    """What a user would write instead; initialises CUDA when a GPU is present."""
    if not torch.cuda.is_available():
        return 0
    count = torch.cuda.device_count()
    for index in range(count):
        torch.cuda.get_device_properties(index)
    return count


def median_seconds(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    # describe() first: the in-process variant may initialise CUDA, which must not
    # happen before the safe variant is measured.
    probe_median, probe_times = median_seconds(describe, args.repeats)
    cuda_touched_by_describe = torch.cuda.is_initialized()
    direct_median, direct_times = median_seconds(in_process_queries, args.repeats)

    result = {
        "repeats": args.repeats,
        "torch": torch.__version__,
        "gpus": in_process_queries(),
        "describe_child_probe_s": {"median": probe_median, "all": probe_times},
        "in_process_queries_s": {"median": direct_median, "all": direct_times},
        "ratio_probe_over_in_process": probe_median / max(direct_median, 1e-9),
        "cuda_initialised_by_describe": cuda_touched_by_describe,
    }
    (RESULTS / "describe_probe_cost.json").write_text(json.dumps(result, indent=2) + "\n")

    fig, ax = plt.subplots(figsize=(6, 3))
    labels = ["describe()\n(child probe, fork-safe)", "torch.cuda queries\n(in-process)"]
    ax.barh(labels, [probe_median, direct_median], color=["C0", "C3"])
    ax.set_xlabel(f"median seconds per call ({args.repeats} calls)")
    ax.set_xscale("log")
    ax.set_title("The price of leaving CUDA untouched")
    fig.tight_layout()
    fig.savefig(RESULTS / "describe_probe_cost.png", dpi=120)

    print(f"describe() with child probe : {probe_median * 1e3:9.1f} ms (median of {args.repeats})")
    print(f"in-process torch.cuda calls : {direct_median * 1e3:9.3f} ms")
    print(f"ratio                       : {result['ratio_probe_over_in_process']:9.0f}x")
    print(f"CUDA initialised by describe(): {cuda_touched_by_describe}")


if __name__ == "__main__":
    main()
