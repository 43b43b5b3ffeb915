"""DDP weak scaling of the tutorial CNN's training on this machine, all setups in one run.

Setups (the chapter 05 pipeline each time: DistributedSampler, augmenting DataLoader,
DDP, train_one_epoch with global metrics; the same samples per rank and batch per rank):

* 1 rank, 1 thread (the baseline);
* 1 rank, 2 threads (the other way to use a second core);
* 2 DDP ranks, 1 thread each (plain DDP);
* 2 DDP ranks exchanging no gradients (a hook that skips the all-reduce: the ceiling
  that two processes on this hardware reach without any communication);
* 2 DDP ranks with gradients sent as float16 (DDP's ``fp16_compress_hook``);
* the baseline, plain DDP and fp16 DDP again with gradient accumulation over 4 batches
  (``no_sync``: one all-reduce and one optimizer step per 4 batches).

Weak-scaling efficiency = throughput(2 ranks) / (2 x throughput(1 rank, 1 thread)), the
baseline having the same accumulation. The setups take turns, round after round; the
ratio is taken within each round and the median over the rounds is reported, because
this shared machine's speed drifts by 20% over minutes. Targets: efficiency >= 0.95,
and 2 DDP ranks faster than 1 rank with 2 threads.
Writes ddp_scaling.{json,png}.
Run: `make bench` or `python benchmarks/ddp_scaling.py --repeats 5`.
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from mgpu_helpers.labs import scaling  # noqa: E402

from results_dir import results_dir  # noqa: E402

RESULTS = results_dir()  # runs/bench/ unless MGPU_BENCH_DIR says otherwise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-rank-samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if min(args.per_rank_samples, args.batch_size, args.repeats) < 1:
        parser.error("--per-rank-samples, --batch-size and --repeats must be at least 1")

    def report(round_index, setup, value):
        print(f"round {round_index + 1}/{args.repeats}  {setup.label:<40} {value:6.1f} "
              "samples/s", flush=True)

    result = scaling.measure(per_rank_samples=args.per_rank_samples,
                             batch_size=args.batch_size, repeats=args.repeats,
                             progress=report)
    two_threads = next(row for row in result["setups"] if row["threads"] == 2)
    ddp_rows = [row for row in result["setups"]
                if row["ranks"] == 2 and row["comm_hook"] != "none"]
    result.update({
        "cpus": os.cpu_count(), "torch": torch.__version__,
        "target_efficiency_at_least_0.95": {
            row["label"]: row["efficiency"] >= 0.95 for row in ddp_rows},
        "target_2_ranks_faster_than_1_rank_2_threads": {
            row["label"]: row["samples_per_s"] > two_threads["samples_per_s"]
            for row in ddp_rows},
    })
    (RESULTS / "ddp_scaling.json").write_text(json.dumps(result, indent=2) + "\n")
    ax = scaling.plot(result)
    ax.figure.tight_layout()
    ax.figure.savefig(RESULTS / "ddp_scaling.png", dpi=120)
    plt.close(ax.figure)

    print()
    for row in result["setups"]:
        efficiency = "" if row["efficiency"] is None else f"   efficiency {row['efficiency']:.3f}"
        print(f"{row['label']:<40} {row['samples_per_s']:7.1f} samples/s (median of "
              f"{len(row['runs'])}){efficiency}")
    for target in ("target_efficiency_at_least_0.95",
                   "target_2_ranks_faster_than_1_rank_2_threads"):
        print(f"{target}: {result[target]}")


if __name__ == "__main__":
    main()
