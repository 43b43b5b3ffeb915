"""GPipe from scratch against the naive split: step time, speed-up and bubble, for
M in {1, 2, 4, 8, 16} micro-batches, 2 stages on 2 CPU processes, in one run.

The model is `mgpu_helpers.labs.gpipe.pipeline_convnet` (9 convolutions of 64 channels on
16x16 images, batch 64) cut where the two stages have equal FLOPs. M = 1 is the naive
split. For each M: the median step time over 5 steps (a step ends when the slowest rank
is done), the speed-up over M = 1
against the ideal K*M/(M+K-1), and the measured idle share against (K-1)/(M+K-1).
The same again with blocking transfers (no overlap of communication with computation).
Target: at M = 8 the pipeline reaches at least 90% of the ideal speed-up.
Writes benchmarks/results/pipeline_bubble.{json,png}.
Run: `make bench` or `python benchmarks/pipeline_bubble.py --steps 9`.
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

from mgpu_helpers import pipeline_parallel as pp  # noqa: E402
from mgpu_helpers.labs import gpipe  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
COUNTS = (1, 2, 4, 8, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per M")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")

    result = gpipe.measure_gpipe(COUNTS, stages=2, steps=args.steps)
    blocking = gpipe.measure_gpipe(COUNTS, stages=2, steps=args.steps, overlap=False)
    stages = result["settings"]["stages"]
    print(f"{'M':>3} {'step':>9} {'speed-up':>9} {'ideal':>6} {'of ideal':>9} "
          f"{'bubble':>7} {'theory':>7} {'blocking: step':>15} {'bubble':>7}")
    table = {}
    for m in COUNTS:
        row = result[m]
        share = row["speedup"] / row["ideal_speedup"]
        print(f"{m:>3} {row['seconds'] * 1e3:>7.1f}ms {row['speedup']:>8.2f}x "
              f"{row['ideal_speedup']:>5.2f}x {share:>8.0%} {row['bubble']:>7.1%} "
              f"{row['theoretical_bubble']:>7.1%} {blocking[m]['seconds'] * 1e3:>13.1f}ms "
              f"{blocking[m]['bubble']:>7.1%}")
        table[m] = {key: row[key] for key in ("seconds", "runs", "speedup", "ideal_speedup",
                                              "bubble", "theoretical_bubble")}
        table[m]["share_of_ideal"] = share
        table[m]["blocking"] = {key: blocking[m][key]
                                for key in ("seconds", "runs", "speedup", "bubble")}
    reached = table[8]["share_of_ideal"]
    output = {"settings": result["settings"], "cpus": os.cpu_count(),
              "torch": torch.__version__, "micro_batches": table,
              "target_M8_at_least_90pct_of_ideal": reached >= 0.9}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipeline_bubble.json").write_text(json.dumps(output, indent=2) + "\n")

    fig = plt.figure(figsize=(11, 6.5))
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 1])
    ax_speed, ax_bubble = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    ms = list(COUNTS)
    ax_speed.plot(ms, [table[m]["ideal_speedup"] for m in ms], "k--", label="ideal KM/(M+K-1)")
    ax_speed.plot(ms, [table[m]["speedup"] for m in ms], "o-", label="measured")
    ax_speed.plot(ms, [result[1]["seconds"] / table[m]["blocking"]["seconds"] for m in ms],
                  "s:", label="measured, blocking transfers")
    ax_speed.set(xscale="log", xticks=ms, xticklabels=ms, xlabel="micro-batches M",
                 ylabel="speed-up over the naive split", title=f"{stages} stages")
    ax_speed.legend()
    ax_bubble.plot(ms, [100 * table[m]["theoretical_bubble"] for m in ms], "k--",
                   label="theory (K-1)/(M+K-1)")
    ax_bubble.plot(ms, [100 * table[m]["bubble"] for m in ms], "o-", label="measured")
    ax_bubble.plot(ms, [100 * table[m]["blocking"]["bubble"] for m in ms], "s:",
                   label="measured, blocking transfers")
    ax_bubble.set(xscale="log", xticks=ms, xticklabels=ms, xlabel="micro-batches M",
                  ylabel="% of time idle", title="Bubble")
    ax_bubble.legend()
    ax_gantt = fig.add_subplot(grid[1, :])
    pp.plot_timeline(result[8]["events"], ax=ax_gantt,
                     title=f"one step with M = 8: bubble {table[8]['bubble']:.0%}")
    fig.tight_layout()
    fig.savefig(RESULTS / "pipeline_bubble.png", dpi=110)
    print(f"target met (M = 8 at >= 90% of the ideal speed-up): "
          f"{output['target_M8_at_least_90pct_of_ideal']} ({reached:.0%})")


if __name__ == "__main__":
    main()
