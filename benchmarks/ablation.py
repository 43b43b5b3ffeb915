"""Chapter 07's ablation, headless: training throughput of the tuned DDP configuration
and of one variant per optimisation switched off, all in one run.

Optimisations: DataLoader workers, pinned memory, mixed precision, channels_last,
one big DDP bucket, gradient_as_bucket_view, static_graph, gradient accumulation x4
(`mgpu_helpers.ablation`). 2 DDP ranks, batch 32 per rank; the variants take turns for
several rounds and the median is reported, relative to the tuned configuration.
Writes benchmarks/results/ablation.{json,png}.
Run: `make bench` or `python benchmarks/ablation.py --repeats 5`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from mgpu_helpers import ablation  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-rank-samples", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if min(args.per_rank_samples, args.repeats) < 1:
        parser.error("--per-rank-samples and --repeats must be at least 1")

    def report(round_index, name, value):
        print(f"round {round_index + 1}/{args.repeats}  {name:<38} {value:6.1f} samples/s",
              flush=True)

    result = ablation.measure(per_rank_samples=args.per_rank_samples, repeats=args.repeats,
                              progress=report)
    result.update({"cpus": os.cpu_count(), "torch": torch.__version__})
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ablation.json").write_text(json.dumps(result, indent=2) + "\n")
    ax = ablation.plot(result)
    ax.figure.tight_layout()
    ax.figure.savefig(RESULTS / "ablation.png", dpi=120)
    plt.close(ax.figure)
    print()
    for row in result["rows"]:
        note = f"   (GPU only: {row['gpu_only']})" if row["gpu_only"] else ""
        print(f"{row['variant']:<38} {row['samples_per_s']:7.1f} samples/s "
              f"{row['relative_to_tuned']:6.2f}x{note}")


if __name__ == "__main__":
    main()
