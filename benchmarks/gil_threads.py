"""A second Python thread on a forward pass: the tutorial CNN against a tiny MLP, in one run.

Chapter 04's claim: DataParallel's threads share one GIL, so a second thread speeds up
big convolutions (PyTorch releases the GIL inside them) and does not speed up many tiny
layers (Python, under the GIL, dominates). Both networks run a forward pass of batch 64
split over 1 and 2 threads (`mgpu_helpers.labs.threads`), in turns, round after round;
the speed-up is 1-thread time / 2-thread time, the median over the rounds is reported.
Expected on an idle machine with 2 free cores: the CNN close to 2x, the MLP at most 1x.
Writes gil_threads.{json,png}.
Run: `make bench` or `python benchmarks/gil_threads.py --rounds 5`.
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from mgpu_helpers.labs import threads  # noqa: E402

from results_dir import results_dir  # noqa: E402

RESULTS = results_dir()  # runs/bench/ unless MGPU_BENCH_DIR says otherwise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7, help="timed passes per case")
    args = parser.parse_args()
    if min(args.rounds, args.repeats) < 1:
        parser.error("--rounds and --repeats must be at least 1")
    # One intra-op thread, as in the chapters (tests/notebook.env): the second core is
    # the second Python thread's to use.
    torch.set_num_threads(1)

    def report(round_index, name, speedup):
        print(f"round {round_index + 1}/{args.rounds}  {name:<20} {speedup:5.2f}x", flush=True)

    result = threads.measure(rounds=args.rounds, repeats=args.repeats, progress=report)
    result.update({"cpus": os.cpu_count(), "torch": torch.__version__,
                   "intra_op_threads": torch.get_num_threads()})
    (RESULTS / "gil_threads.json").write_text(json.dumps(result, indent=2) + "\n")

    fig, ax = plt.subplots(figsize=(6, 2.8))
    names = [row["case"] for row in result["cases"]]
    for y, row in enumerate(result["cases"]):
        ax.scatter(row["speedups"], [y] * len(row["speedups"]), color="C0", alpha=0.5,
                   label="one round" if y == 0 else None)
        ax.scatter([row["speedup"]], [y], color="C1", marker="D", s=60,
                   label="median" if y == 0 else None)
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set(yticks=range(len(names)), yticklabels=names, xlabel="speed-up of a second thread",
           title=f"Forward pass on 2 threads vs 1 ({os.cpu_count()} CPUs)",
           ylim=(-0.6, len(names) - 0.4))
    ax.legend(loc="center")
    fig.tight_layout()
    fig.savefig(RESULTS / "gil_threads.png", dpi=120)
    plt.close(fig)

    print()
    for row in result["cases"]:
        print(f"{row['case']:<20} 1 thread {row['one_thread_s'] * 1e3:7.2f} ms, 2 threads "
              f"{row['two_threads_s'] * 1e3:7.2f} ms, speed-up {row['speedup']:.2f}x "
              f"(median of {len(row['speedups'])} rounds)")


if __name__ == "__main__":
    main()
