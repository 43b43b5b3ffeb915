"""Chapter 08's ablation, headless: training throughput of the tuned DDP configuration
and of one variant per optimisation switched off, judged against an A/A control.

Optimisations: DataLoader workers, pinned memory, mixed precision, channels_last,
gradient accumulation x4 (`mgpu_helpers.labs.ablation`). With `--ddp-options`: the DDP
options that act once per all-reduce (the overlap of DDP's 25 MB buckets against one
100 MB bucket, gradient_as_bucket_view, static_graph), timed without accumulation, so
that every batch has its all-reduce. 2 DDP ranks, batch 32 per rank. Every round
measures every variant once, in a counterbalanced order, and "all on" twice (the A/A
control); the noise band is the largest disagreement of the two "all on" runs in any
round, and a variant gets a verdict ("pays", "costs") only when it lies outside the
band, on the same side, in every round.
Writes ablation.{json,png} (with `--ddp-options`: ablation_ddp_options.{json,png}).
Run: `make bench` or `python benchmarks/ablation.py --rounds 7`.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from mgpu_helpers.labs import ablation  # noqa: E402

from results_dir import results_dir  # noqa: E402

RESULTS = results_dir()  # runs/bench/ unless MGPU_BENCH_DIR says otherwise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-rank-samples", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ddp-options", action="store_true",
                        help="time the DDP options without accumulation instead")
    args = parser.parse_args()
    if args.per_rank_samples < 128 or args.rounds < 2:
        parser.error("--per-rank-samples must be at least 128 (the warm-up) and --rounds "
                     "at least 2 (the A/A band)")

    def report(round_index, order, rates):
        print(f"round {round_index + 1}/{args.rounds}:", flush=True)
        for name in order:
            print(f"  {name:<38} {rates[name]:6.1f} samples/s", flush=True)

    load_before = os.getloadavg()[0]  # a shared machine: the band shows what that costs
    started = time.perf_counter()
    chosen = ablation.ddp_option_variants() if args.ddp_options else ablation.variants()
    stem = "ablation_ddp_options" if args.ddp_options else "ablation"
    result = ablation.measure(per_rank_samples=args.per_rank_samples, rounds=args.rounds,
                              progress=report, options=chosen)
    result.update({"seconds": round(time.perf_counter() - started, 1),
                   "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                   "cpus": os.cpu_count(), "torch": torch.__version__})
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    ax = ablation.plot(result)
    ax.figure.savefig(RESULTS / f"{stem}.png", dpi=120, bbox_inches="tight")
    plt.close(ax.figure)
    band = result["band"]
    print(f"\nA/A noise band: {band['low']:.3f}x to {band['high']:.3f}x "
          f"({result['rounds']} rounds, {result['seconds']:.0f} s)")
    for row in result["rows"]:
        note = f"   (GPU only: {row['gpu_only']})" if row["gpu_only"] else ""
        print(f"{row['variant']:<38} {row['samples_per_s']:7.1f} samples/s "
              f"{row['relative_to_tuned']:6.2f}x  {row['verdict'] or 'defines the band'}"
              f"{note}")


if __name__ == "__main__":
    main()
