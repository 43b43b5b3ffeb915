"""Memory per rank and traffic per step of five data-parallel strategies, measured next
to the ZeRO paper's formulas, with activation checkpointing off and on, in one run.

On 2 gloo CPU ranks, `mgpu_helpers.labs.memory.rank_memory` trains 4 feed-forward
blocks (512 -> 2048 -> 512, 8.4 M parameters) with Adam under DDP, DDP with its
gradients as bucket views, ZeRO-1, FSDP2 keeping the gathered weights from forward to
backward, and FSDP2 resharding after forward. Per rank: the parameters, gradients,
Adam state and bucket buffers held after a step (the bytes of their distinct storages;
the buckets through a DDP communication hook), against the formula (target: within
5%); the most bytes allocated on top of them in the forward pass, the backward pass and
the optimizer step (torch.profiler's memory events); the collectives of the step and
their volume in units of the parameter count (flight recorder). Chapter 07 runs the
same measurement live; this stores a reference run. Writes memory_by_strategy.{json,png}.
Run: `make bench` or `python benchmarks/memory_by_strategy.py`.
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
from mgpu_helpers.labs import memory  # noqa: E402

from results_dir import results_dir  # noqa: E402

RESULTS = results_dir()  # runs/bench/ unless MGPU_BENCH_DIR says otherwise
WORLD = 2
MiB = 2**20
HELD = ("parameters", "gradients", "optimizer state", "bucket buffers")


def measure(strategy: str, checkpointing: bool) -> dict:
    # CPU ranks over gloo on every machine: bytes and traffic are what the lesson needs
    ranks = launch(memory.rank_memory, strategy, checkpointing, nprocs=WORLD,
                   backend="gloo", return_all=True)
    parameters = ranks[0]["parameter count"]
    expected = memory.formula(strategy, parameters, WORLD)
    return {
        "strategy": strategy, "checkpointing": checkpointing,
        "stored_per_rank": [r["stored"] for r in ranks], "formula": expected,
        "worst_deviation": max(abs(r["stored"][k] - v) / v for r in ranks
                               for k, v in expected.items() if v),
        "extra_at_peak_per_rank": [r["extra at peak"] for r in ranks],
        "collectives": ranks[0]["collectives"],
        "volume_in_parameters": sum(c["elements"] for c in ranks[0]["collectives"].values())
        / parameters,
        "parameter_count": parameters, "block_bytes": ranks[0]["block bytes"],
        "hidden_activation_bytes": ranks[0]["hidden activation bytes"],
        "weights_match_ddp": None,
        "_weights": ranks[0]["weights"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()

    rows = [measure(strategy, checkpointing) for checkpointing in (False, True)
            for strategy in memory.STRATEGIES]
    reference = rows[0]["_weights"]  # DDP without checkpointing
    for row in rows:
        weights = row.pop("_weights")
        row["weights_match_ddp"] = max((a - b).abs().max().item()
                                       for a, b in zip(weights, reference, strict=True))
    result = {"world": WORLD, "cpus": os.cpu_count(), "torch": torch.__version__,
              "phases": list(memory.PHASES), "rows": rows}
    (RESULTS / "memory_by_strategy.json").write_text(json.dumps(result, indent=2) + "\n")

    print(f"{'strategy':<26} {'ckpt':>4} " + " ".join(f"{k[:11]:>11}" for k in HELD)
          + f" {'vs formula':>10} " + " ".join(f"{p[:9]:>9}" for p in memory.PHASES)
          + f" {'traffic':>8} {'vs DDP':>8}")
    for row in rows:
        held = row["stored_per_rank"][0]
        extra = row["extra_at_peak_per_rank"][0]
        print(f"{row['strategy']:<26} {'on' if row['checkpointing'] else 'off':>4} "
              + " ".join(f"{held[k] / MiB:>9.1f}Mi" for k in HELD)
              + f" {row['worst_deviation']:>10.1%} "
              + " ".join(f"{extra[p] / MiB:>7.1f}Mi" for p in memory.PHASES)
              + f" {row['volume_in_parameters']:>7.2f}P {row['weights_match_ddp']:>8.1e}")

    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    colours = ["#2a7ab0", "#e3863b", "#7aa95c", "#c0392b", "#9aa5b1"]
    plain = [row for row in rows if not row["checkpointing"]]
    for index, row in enumerate(plain):
        left = 0.0
        for colour, key in zip(colours, HELD, strict=False):
            value = row["stored_per_rank"][0][key] / MiB
            axes[0].barh(index, value, left=left, color=colour,
                         label=key if index == 0 else None)
            left += value
        formula = sum(row["formula"].values()) / MiB
        axes[0].plot([formula, formula], [index - 0.4, index + 0.4], "k-",
                     label="formula" if index == 0 else None)
        peak = max(row["extra_at_peak_per_rank"][0].values()) / MiB
        axes[0].barh(index, peak, left=left, color=colours[4], hatch="//",
                     label="extra at the step's peak" if index == 0 else None)
    axes[0].set_yticks(range(len(plain)), [row["strategy"] for row in plain])
    axes[0].invert_yaxis()
    axes[0].set_xlabel("MiB on rank 0 (2 ranks, 8.4 M parameters, Adam)")
    axes[0].legend(fontsize=7, loc="lower right")
    width = 0.38
    for offset, checkpointing in ((-width / 2, False), (width / 2, True)):
        chosen = [row for row in rows if row["checkpointing"] is checkpointing]
        axes[1].bar([i + offset for i in range(len(chosen))],
                    [row["extra_at_peak_per_rank"][0]["forward"] / MiB for row in chosen],
                    width, label=f"checkpointing {'on' if checkpointing else 'off'}")
    axes[1].set_xticks(range(len(plain)), [row["strategy"].replace(", ", ",\n")
                                           for row in plain], fontsize=7)
    axes[1].set_ylabel("MiB allocated in forward, at its peak")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Memory per rank by strategy, {WORLD} gloo CPU ranks")
    fig.tight_layout()
    fig.savefig(RESULTS / "memory_by_strategy.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
