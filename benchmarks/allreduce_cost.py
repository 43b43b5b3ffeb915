"""The all-reduce cost model, fitted and then tested on a prediction, in one run.

On 2 gloo CPU ranks: `dist.all_reduce` timed for float32 tensors of 64 B to 64 MiB
(`mgpu_helpers.labs.collectives`), the model t = alpha * 2(N-1) + 2(N-1)/N * bytes /
bandwidth fitted to those times; then the model predicts the all-reduce of the seed CNN's
gradients as DDP buckets them (its default 25 MB cap, read from DDP itself), and that
all-reduce is measured. Chapter 03 checks the stored run: the prediction within 25% of
the measurement. Writes allreduce_cost.{json,png}.
Run: `make bench` or `python benchmarks/allreduce_cost.py --repeats 5`.
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from mgpu_helpers import launch  # noqa: E402
from mgpu_helpers.labs import ablation, collectives  # noqa: E402

from results_dir import results_dir  # noqa: E402

RESULTS = results_dir()  # runs/bench/ unless MGPU_BENCH_DIR says otherwise
WORLD = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timings per size")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    # CPU ranks over gloo: the chapter's CPU measurement, on every machine
    seconds = launch(collectives.allreduce_seconds, collectives.SIZES, args.repeats,
                     nprocs=WORLD, backend="gloo")
    alpha, bandwidth = collectives.fit(collectives.SIZES, seconds, WORLD)
    layout = launch(ablation.bucket_layouts, [None], nprocs=WORLD, backend="gloo")[0]
    buckets = [round(bucket["megabytes"] * 1e6) for bucket in layout]
    predicted = sum(collectives.predict(n, alpha, bandwidth, WORLD) for n in buckets)
    measured = launch(collectives.buckets_seconds, buckets, args.repeats, nprocs=WORLD,
                      backend="gloo")
    result = {
        "world": WORLD, "repeats": args.repeats, "cpus": os.cpu_count(),
        "torch": torch.__version__, "sizes": list(collectives.SIZES), "seconds": seconds,
        "alpha_s": alpha, "bandwidth_bytes_per_s": bandwidth, "bucket_bytes": buckets,
        "predicted_s": predicted, "measured_s": measured,
    }
    (RESULTS / "allreduce_cost.json").write_text(json.dumps(result, indent=2) + "\n")

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    sizes = collectives.SIZES
    ax.loglog(sizes, [s * 1e3 for s in seconds], "o", label="measured (median)")
    ax.loglog(sizes, [collectives.predict(n, alpha, bandwidth, WORLD) * 1e3 for n in sizes],
              "-", label=f"fit: alpha {alpha * 1e6:.0f} us, {bandwidth / 1e9:.2f} GB/s")
    ax.loglog([sum(buckets)], [measured * 1e3], "D", color="C3",
              label=f"seed CNN's DDP buckets: predicted {predicted * 1e3:.1f} ms")
    ax.set(xlabel="bytes all-reduced", ylabel="ms",
           title=f"gloo all-reduce, {WORLD} CPU ranks ({os.cpu_count()} CPUs)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(RESULTS / "allreduce_cost.png", dpi=120)
    plt.close(fig)

    for nbytes, s in zip(sizes, seconds, strict=True):
        print(f"{nbytes:>10} B  {s * 1e3:8.3f} ms   model "
              f"{collectives.predict(nbytes, alpha, bandwidth, WORLD) * 1e3:8.3f} ms")
    print(f"alpha {alpha * 1e6:.0f} us per step, bandwidth {bandwidth / 1e9:.2f} GB/s")
    print(f"seed CNN's buckets {buckets}: predicted {predicted * 1e3:.1f} ms, measured "
          f"{measured * 1e3:.1f} ms ({predicted / measured:.2f}x)")


if __name__ == "__main__":
    main()
