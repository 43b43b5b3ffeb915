"""Pipelines from scratch on 2 CPU processes, in one run: GPipe against the naive split,
1F1B and interleaved 1F1B beside GPipe, overlapped against blocking transfers, and what
rank 0's first backward pass of a step costs.

The model is `mgpu_helpers.labs.gpipe.pipeline_convnet` (9 convolutions of 64 channels on
16x16 images, batch 64), cut into pieces of equal FLOPs. Four measurements:

1. GPipe, M in {1, 2, 4, 8, 16} micro-batches (M = 1 is the naive split): the median
   step time over --steps steps (a step ends when the slowest rank is done), the
   speed-up over M = 1 against the ideal K*M/(M+K-1), and the idle share of the median
   step against (K-1)/(M+K-1) (measured, and with instant transfers as in 2.).
   Target: at M = 8 the pipeline reaches at least 90% of the ideal speed-up.
2. GPipe, 1F1B (one piece per rank) and interleaved 1F1B (2 ranks x 2 virtual stages),
   M in {2, 4, 8, 16}, in one launch, their steps taken in turns: the idle share
   measured, and with instant transfers (the same passes replayed in the same order,
   messages taking no time, each pass as long as its CPU time, so that neither transfers
   nor a core taken by another process leave gaps), against (K-1)/(v·M+K-1) of the step,
   i.e. (K-1)/(v·M) of the ideal compute time (Narayanan et al., 2021).
3. Overlapped against blocking transfers, GPipe at M = 8 and 16, in --rounds interleaved
   rounds in one launch (each round runs both, the order alternating): every round's
   median step time is stored.
4. Rank 0's first backward pass of a step against its other backward passes, at M = 8:
   wall time, CPU time and page faults; by default, with the allocator keeping the memory
   it frees, and with one core taken by another process.

Writes pipeline_bubble.{json,png}.
Run: `make bench` or `python benchmarks/pipeline_bubble.py` (about 2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from mgpu_helpers.labs import gpipe  # noqa: E402
from mgpu_helpers.viz.plots import plot_timeline  # noqa: E402

from results_dir import results_dir  # noqa: E402

RESULTS = results_dir()  # runs/bench/ unless MGPU_BENCH_DIR says otherwise
COUNTS = (1, 2, 4, 8, 16)
SCHEDULE_COUNTS = (2, 4, 8, 16)
OVERLAP_COUNTS = (8, 16)
SCHEDULE_KEYS = ("seconds", "runs", "bubble", "bubbles", "bubble_instant_transfers",
                 "bubbles_instant_transfers", "theoretical_bubble")


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def gpipe_sweep(steps: int) -> tuple[dict, dict]:
    result = gpipe.measure_gpipe(COUNTS, ranks=2, steps=steps)
    print(f"{'M':>3} {'step':>9} {'speed-up':>9} {'ideal':>6} {'of ideal':>9} "
          f"{'bubble':>7} {'theory':>7}")
    table = {}
    for m in COUNTS:
        row = result[m]
        share = row["speedup"] / row["ideal_speedup"]
        print(f"{m:>3} {row['seconds'] * 1e3:>7.1f}ms {row['speedup']:>8.2f}x "
              f"{row['ideal_speedup']:>5.2f}x {share:>8.0%} {row['bubble']:>7.1%} "
              f"{row['theoretical_bubble']:>7.1%}", flush=True)
        table[m] = {key: row[key] for key in ("seconds", "runs", "speedup", "ideal_speedup",
                                              "bubble", "bubbles", "bubble_instant_transfers",
                                              "theoretical_bubble")}
        table[m]["share_of_ideal"] = share
    return result, table


def schedules(steps: int) -> dict:
    out = gpipe.compare_schedules(SCHEDULE_COUNTS, ranks=2, steps=steps)
    print(f"\n{'M':>3} {'idle share: measured (instant transfers) | theory':>60}")
    for m in SCHEDULE_COUNTS:
        rows = {name: out[name][m] for name in gpipe.SCHEDULES}
        print(f"{m:>3} " + "  ".join(
            f"{name} {row['bubble']:6.1%} ({row['bubble_instant_transfers']:5.1%}) | "
            f"{row['theoretical_bubble']:5.1%}" for name, row in rows.items()), flush=True)
    return out


def overlap_rounds(steps: int, rounds: int) -> dict:
    result = gpipe.measure_overlap_rounds(OVERLAP_COUNTS, rounds=rounds, steps=steps)
    print()
    for index, row in enumerate(result["rounds"]):
        print(f"round {index + 1}/{rounds}  " + "  ".join(
            f"M = {m}: overlapped {row[m]['overlapped'] * 1e3:6.1f} ms, blocking "
            f"{row[m]['blocking'] * 1e3:6.1f} ms" for m in OVERLAP_COUNTS), flush=True)
    for m, row in result["summary"].items():
        print(f"M = {m}: median over rounds overlapped {row['overlapped'] * 1e3:.1f} ms, "
              f"blocking {row['blocking'] * 1e3:.1f} ms; blocking slower in "
              f"{row['blocking_slower_in']} of {rounds} rounds, by {row['median_ratio']:.2f}x "
              "in the median round")
    return result


def first_backward(steps: int, launches: int) -> dict:
    out: dict = {"default": [], "memory_kept": []}
    for _ in range(launches):  # alternating, so both meet the same load
        out["default"].append(gpipe.first_backward_costs(8, steps=steps))
        out["memory_kept"].append(gpipe.first_backward_costs(8, steps=steps, keep_memory=True))
    context = mp.get_context("spawn")
    stop = context.Event()
    spinner = context.Process(target=_spin, args=(stop,), daemon=True)
    spinner.start()
    try:
        time.sleep(0.5)
        out["one_core_busy"] = [gpipe.first_backward_costs(8, steps=steps)]
    finally:
        stop.set()
        spinner.join(10)
    print()
    for condition, runs in out.items():
        for run in runs:
            first, others = (run["ranks"][0][key] for key in ("first_backward",
                                                               "other_backwards"))
            print(f"rank 0, {condition:<13}: first backward {first['wall_ms']:5.1f} ms "
                  f"(CPU {first['cpu_ms']:5.1f} ms, {first['page_faults']:6.0f} page faults), "
                  f"others {others['wall_ms']:5.1f} ms (CPU {others['cpu_ms']:5.1f} ms, "
                  f"{others['page_faults']:4.0f} faults); gradient gap "
                  f"{run['gradient_gap_ms']:.2f} ms (at least {run['gradient_gap_min_ms']:.2f})")
    return out


def plot(table: dict, result: dict, schedule: dict, rounds: dict, backward: dict) -> None:
    fig = plt.figure(figsize=(11, 17))
    grid = fig.add_gridspec(5, 2, height_ratios=[1, 1, 1, 1, 1])
    ms = list(COUNTS)
    ax = fig.add_subplot(grid[0, 0])
    ax.plot(ms, [table[m]["ideal_speedup"] for m in ms], "k--", label="ideal KM/(M+K-1)")
    ax.plot(ms, [table[m]["speedup"] for m in ms], "o-", label="measured")
    ax.set(xscale="log", xticks=ms, xticklabels=ms, xlabel="micro-batches M",
           ylabel="speed-up over the naive split", title="GPipe, 2 ranks")
    ax.legend(fontsize=8)

    ax = fig.add_subplot(grid[0, 1])
    ax.plot(ms, [100 * table[m]["theoretical_bubble"] for m in ms], "k--",
            label="theory (K-1)/(M+K-1)")
    ax.plot(ms, [100 * table[m]["bubble"] for m in ms], "o-", label="measured")
    ax.plot(ms, [100 * table[m]["bubble_instant_transfers"] for m in ms], "^:",
            label="instant transfers")
    ax.set(xscale="log", xticks=ms, xticklabels=ms, xlabel="micro-batches M",
           ylabel="% of the step idle", title="GPipe's bubble")
    ax.legend(fontsize=8)

    ax = fig.add_subplot(grid[1, 0])
    sm = list(SCHEDULE_COUNTS)
    for name, colour in (("gpipe", "C0"), ("1f1b", "C2"), ("interleaved", "C3")):
        ax.plot(sm, [100 * schedule[name][m]["bubble"] for m in sm], "o-", color=colour,
                label=f"{name}, measured")
        ax.plot(sm, [100 * schedule[name][m]["bubble_instant_transfers"] for m in sm], "^:",
                color=colour, label=f"{name}, instant transfers")
    ax.plot(sm, [100 * schedule["gpipe"][m]["theoretical_bubble"] for m in sm], "k--",
            label="theory v = 1: (K-1)/(M+K-1)")
    ax.plot(sm, [100 * schedule["interleaved"][m]["theoretical_bubble"] for m in sm], "k-.",
            label="theory v = 2: (K-1)/(vM+K-1)")
    ax.set(xscale="log", xticks=sm, xticklabels=sm, xlabel="micro-batches M",
           ylabel="% of the step idle", title="Schedules, 2 ranks",
           ylim=(0, 1.6 * max(100 * schedule[name][m]["bubble"] for name in gpipe.SCHEDULES
                              for m in sm)))
    ax.minorticks_off()
    ax.legend(fontsize=6, ncols=2, loc="upper center")

    ax = fig.add_subplot(grid[1, 1])
    for offset, m in enumerate(OVERLAP_COUNTS):
        for kind, marker, colour in (("overlapped", "o", "C0"), ("blocking", "s", "C1")):
            values = [1e3 * row[m][kind] for row in rounds["rounds"]]
            ax.scatter([offset + (0.1 if kind == "blocking" else -0.1)] * len(values), values,
                       marker=marker, color=colour, alpha=0.6,
                       label=kind if offset == 0 else None)
        for row in rounds["rounds"]:
            ax.plot([offset - 0.1, offset + 0.1],
                    [1e3 * row[m]["overlapped"], 1e3 * row[m]["blocking"]],
                    color="grey", linewidth=0.6)
    ax.set(xticks=range(len(OVERLAP_COUNTS)),
           xticklabels=[f"M = {m}" for m in OVERLAP_COUNTS], ylabel="median step (ms)",
           title=f"Overlapped vs blocking, {len(rounds['rounds'])} rounds (lines pair a round)")
    ax.legend(fontsize=8)

    ax = fig.add_subplot(grid[2, :])
    labels, walls, cpus, others = [], [], [], []
    for condition, runs in backward.items():
        for index, run in enumerate(runs):
            row = run["ranks"][0]
            labels.append(f"{condition.replace('_', ' ')} {index + 1}\n"
                          f"{row['first_backward']['page_faults']:.0f} faults")
            walls.append(row["first_backward"]["wall_ms"])
            cpus.append(row["first_backward"]["cpu_ms"])
            others.append(row["other_backwards"]["wall_ms"])
    xs = range(len(labels))
    ax.bar([x - 0.27 for x in xs], walls, width=0.27, label="first backward, wall")
    ax.bar(xs, cpus, width=0.27, label="first backward, CPU")
    ax.bar([x + 0.27 for x in xs], others, width=0.27, label="other backwards, wall (median)")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set(ylabel="ms (median over steps)", ylim=(0, 1.3 * max(walls + others)),
           title="Rank 0's first backward pass of a step, M = 8")
    ax.legend(fontsize=8, ncols=3, loc="upper left")

    plot_timeline(result[8]["events"], ax=fig.add_subplot(grid[3, :]),
                  title=f"GPipe, one step with M = 8: idle {table[8]['bubble']:.0%}")
    row = schedule["interleaved"][8]
    plot_timeline(row["events"], ax=fig.add_subplot(grid[4, :]),
                  title=f"interleaved 1F1B, 2 ranks x 2 virtual stages, M = 8: idle "
                        f"{row['bubble']:.0%}, {row['bubble_instant_transfers']:.0%} with "
                        f"instant transfers (theory {row['theoretical_bubble']:.0%})")
    fig.tight_layout()
    fig.savefig(RESULTS / "pipeline_bubble.png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=9, help="timed steps per measurement")
    parser.add_argument("--rounds", type=int, default=9,
                        help="interleaved rounds of overlapped vs blocking transfers")
    parser.add_argument("--launches", type=int, default=3,
                        help="launches per condition of the first-backward measurement")
    args = parser.parse_args()
    if min(args.steps, args.rounds, args.launches) < 1:
        parser.error("--steps, --rounds and --launches must be at least 1")

    load_before = os.getloadavg()
    result, table = gpipe_sweep(args.steps)
    schedule = schedules(args.steps)
    rounds = overlap_rounds(args.steps, args.rounds)
    backward = first_backward(args.steps, args.launches)
    reached = table[8]["share_of_ideal"]
    output = {"settings": result["settings"], "cpus": os.cpu_count(),
              "torch": torch.__version__,
              "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
              "micro_batches": table,
              "target_M8_at_least_90pct_of_ideal": reached >= 0.9,
              "schedules": {key: value if key == "settings" else
                            {m: {k: v for k, v in row.items() if k != "events"}
                             for m, row in value.items()}
                            for key, value in schedule.items()},
              "overlap_rounds": rounds, "first_backward": backward}
    (RESULTS / "pipeline_bubble.json").write_text(json.dumps(output, indent=2) + "\n")
    plot(table, result, schedule, rounds, backward)
    interleaved = schedule["interleaved"][8]
    print(f"\ntarget met (M = 8 at >= 90% of the ideal speed-up): "
          f"{output['target_M8_at_least_90pct_of_ideal']} ({reached:.0%}); interleaved at "
          f"M = 8 idle {interleaved['bubble']:.0%} measured, "
          f"{interleaved['bubble_instant_transfers']:.0%} with instant transfers; load "
          f"average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
