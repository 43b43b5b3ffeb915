"""DDP's gradient all-reduce inside backward, against the cost model and against itself alone.

On 2 gloo CPU ranks, in one run: the all-reduce cost model of chapter 03 fitted again
(`mgpu_helpers.labs.collectives`); the tutorial CNN's DDP buckets all-reduced on their own,
with nothing else running; then DDP training steps whose communication hook times each
bucket's all-reduce inside backward (`mgpu_helpers.labs.ddp_internals.backward_timeline`),
and the same steps with a hook that exchanges nothing. Chapter 05 checks its claims about
overlap on the stored run. Writes ddp_backward.{json,png}.
Run: `make bench` or `python benchmarks/ddp_backward.py --steps 12`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from mgpu_helpers import launch  # noqa: E402
from mgpu_helpers.labs import collectives, ddp_internals  # noqa: E402

from results_dir import results_dir  # noqa: E402

RESULTS = results_dir()  # runs/bench/ unless MGPU_BENCH_DIR says otherwise
WORLD = 2
WARM_UP_STEPS = 2  # DDP rebuilds its buckets after the first step


def summary(records: list[dict]) -> dict:
    """Medians over the timed steps: when backward returned, when the last gradient was
    ready, and each bucket's all-reduce duration and start."""
    timed = records[WARM_UP_STEPS:]
    buckets = len(timed[0]["buckets"])
    return {
        "backward_s": statistics.median(r["backward_s"] for r in timed),
        "last_gradient_s": statistics.median(max(r["ready"].values()) for r in timed),
        "bucket_bytes": [b["bytes"] for b in timed[0]["buckets"]],
        "bucket_parameters": [b["parameters"] for b in timed[0]["buckets"]],
        "allreduce_s": [statistics.median(r["buckets"][k]["end"] - r["buckets"][k]["start"]
                                          for r in timed) for k in range(buckets)],
        "allreduce_start_s": [statistics.median(r["buckets"][k]["start"] for r in timed)
                              for k in range(buckets)],
        "steps": [{"backward_s": r["backward_s"],
                   "allreduce_s": [b["end"] - b["start"] for b in r["buckets"]]}
                  for r in timed],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed training steps")
    parser.add_argument("--repeats", type=int, default=5, help="timings per size for the fit")
    args = parser.parse_args()
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1")

    # CPU ranks over gloo on every machine: the chapter's CPU measurement
    seconds = launch(collectives.allreduce_seconds, collectives.SIZES, args.repeats,
                     nprocs=WORLD, backend="gloo")
    alpha, bandwidth = collectives.fit(collectives.SIZES, seconds, WORLD)
    steps = WARM_UP_STEPS + args.steps
    with_exchange = summary(launch(ddp_internals.backward_timeline, steps, nprocs=WORLD,
                                   backend="gloo"))
    without = summary(launch(ddp_internals.backward_timeline, steps, exchange=False,
                             nprocs=WORLD, backend="gloo"))
    buckets = with_exchange["bucket_bytes"]
    alone = launch(collectives.buckets_seconds, buckets, args.repeats, nprocs=WORLD,
                   backend="gloo")
    result = {
        "world": WORLD, "steps": args.steps, "repeats": args.repeats,
        "cpus": os.cpu_count(), "torch": torch.__version__,
        "alpha_s": alpha, "bandwidth_bytes_per_s": bandwidth,
        "predicted_s": [collectives.predict(n, alpha, bandwidth, WORLD) for n in buckets],
        "alone_s": alone,
        "with_exchange": with_exchange, "without_exchange": without,
    }
    (RESULTS / "ddp_backward.json").write_text(json.dumps(result, indent=2) + "\n")

    fig, ax = plt.subplots(figsize=(7, 3.2))
    rows = [("backward, no exchange", without["backward_s"]),
            ("backward with DDP's all-reduce", with_exchange["backward_s"]),
            ("buckets all-reduced alone", alone),
            ("cost model's prediction", sum(result["predicted_s"]))]
    ax.barh([name for name, _ in rows], [s * 1e3 for _, s in rows],
            color=["C0", "C1", "C2", "C7"])
    ax.invert_yaxis()
    ax.set(xlabel="ms (median)", title=f"Tutorial CNN, batch 32, {WORLD} gloo ranks "
                                       f"({os.cpu_count()} CPUs)")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(RESULTS / "ddp_backward.png", dpi=120)
    plt.close(fig)

    print(f"alpha {alpha * 1e6:.0f} us, bandwidth {bandwidth / 1e9:.2f} GB/s")
    for k, nbytes in enumerate(buckets):
        print(f"bucket {k}: {nbytes:>10} B  predicted {result['predicted_s'][k] * 1e3:6.1f} ms"
              f"  inside backward {with_exchange['allreduce_s'][k] * 1e3:6.1f} ms")
    print(f"all buckets alone {alone * 1e3:.1f} ms; backward {without['backward_s'] * 1e3:.0f}"
          f" ms without exchange, {with_exchange['backward_s'] * 1e3:.0f} ms with it")


if __name__ == "__main__":
    main()
