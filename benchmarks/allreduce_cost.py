"""The collectives' cost model, fitted and then tested on predictions it never saw.

On 2 gloo CPU ranks: `dist.all_reduce`, `all_gather_single` and `reduce_scatter_single`
timed for float32 tensors of 64 B to 64 MiB (`mgpu_helpers.labs.collectives`); the model
t = alpha * 2(N-1) + 2(N-1)/N * bytes / bandwidth fitted to the all-reduce times up to
16 MiB only. Then the fit predicts, out of sample: the 64 MiB all-reduce, the all-reduce of
the tutorial CNN's gradients as DDP buckets them (read from DDP itself), the all-gathers and
reduce-scatters (half the ring: N-1 steps, (N-1)/N of the bytes), and all-reduces on 3 and
4 ranks. Chapter 03 checks the stored run's errors. Writes allreduce_cost.{json,png}.
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
SIZES = collectives.SIZES
FIT_SIZES = [n for n in SIZES if n <= 16 * 2 ** 20]  # 64 MiB is held out
MIB = (2 ** 20, 16 * 2 ** 20)  # the sizes predicted for the halves and for 3 and 4 ranks
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def entry(what: str, nbytes: int, world: int, predicted: float, measured: float) -> dict:
    """One prediction the fit never saw, with its measurement."""
    return {"what": what, "bytes": nbytes, "world": world, "predicted_s": predicted,
            "measured_s": measured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timings per size")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    # CPU ranks over gloo: the chapter's CPU measurement, on every machine
    timed = {name: launch(collectives.collective_seconds, name, SIZES, args.repeats,
                          nprocs=WORLD, backend="gloo") for name in COLLECTIVES}
    seconds = timed["all_reduce"]["median"]
    alpha, bandwidth = collectives.fit(FIT_SIZES, seconds[:len(FIT_SIZES)], WORLD)

    def model(nbytes, world=WORLD, name="all_reduce"):
        return collectives.predict(nbytes, alpha, bandwidth, world, name)

    # CPU check: DDP's bucket layout is the same on every backend
    layout = launch(ablation.bucket_layouts, [None], nprocs=WORLD, backend="gloo")[0]
    buckets = [round(bucket["megabytes"] * 1e6) for bucket in layout]
    # gloo, as the fit: the model is tested on the transport it was fitted on
    measured_buckets = launch(collectives.buckets_seconds, buckets, args.repeats,
                              nprocs=WORLD, backend="gloo")
    held_out = [entry("all_reduce", SIZES[-1], WORLD, model(SIZES[-1]), seconds[-1]),
                entry("DDP's two buckets", sum(buckets), WORLD,
                      sum(model(n) for n in buckets), measured_buckets)]
    for name in COLLECTIVES[1:]:
        for nbytes in MIB:
            held_out.append(entry(name, nbytes, WORLD, model(nbytes, name=name),
                                  timed[name]["median"][SIZES.index(nbytes)]))
    for world in (3, 4):
        # CPU ranks over gloo: 3 and 4 ranks exist on every machine only as processes
        measured = launch(collectives.collective_seconds, "all_reduce", list(MIB),
                          args.repeats, nprocs=world, backend="gloo")["median"]
        for nbytes, s in zip(MIB, measured, strict=True):
            held_out.append(entry("all_reduce", nbytes, world, model(nbytes, world), s))
    busbw = {name: collectives.bus_bandwidth(MIB[1], timed[name]["median"][SIZES.index(MIB[1])],
                                             WORLD, name)[1] for name in COLLECTIVES}
    result = {
        "world": WORLD, "repeats": args.repeats, "cpus": os.cpu_count(),
        "torch": torch.__version__, "sizes": list(SIZES), "fit_sizes": FIT_SIZES,
        "seconds": timed, "alpha_s": alpha, "bandwidth_bytes_per_s": bandwidth,
        "bucket_bytes": buckets, "held_out": held_out, "busbw_16MiB": busbw,
    }
    (RESULTS / "allreduce_cost.json").write_text(json.dumps(result, indent=2) + "\n")

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for k, (name, marker) in enumerate(zip(COLLECTIVES, "os^", strict=True)):
        ax.loglog(SIZES, [s * 1e3 for s in timed[name]["median"]], marker, color=f"C{k}",
                  label=f"{name} measured")
        ax.loglog(SIZES, [model(n, name=name) * 1e3 for n in SIZES],
                  "-" if name == "all_reduce" else ":", color=f"C{k}",
                  label=(f"fit to 16 MiB: alpha {alpha * 1e6:.0f} us, "
                         f"{bandwidth / 1e9:.2f} GB/s") if name == "all_reduce"
                  else f"{name} predicted")
    ax.axvspan(16 * 2 ** 20 * 1.5, SIZES[-1] * 1.5, color="0.9", label="held out")
    ax.set(xlabel="bytes (whole tensor)", ylabel="ms",
           title=f"gloo collectives, {WORLD} CPU ranks ({os.cpu_count()} CPUs)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(RESULTS / "allreduce_cost.png", dpi=120)
    plt.close(fig)

    for nbytes, s in zip(SIZES, seconds, strict=True):
        print(f"{nbytes:>10} B  {s * 1e3:8.3f} ms   model {model(nbytes) * 1e3:8.3f} ms"
              f"{'' if nbytes in FIT_SIZES else '   (held out)'}")
    print(f"alpha {alpha * 1e6:.0f} us per step, bandwidth {bandwidth / 1e9:.2f} GB/s")
    for row in held_out:
        print(f"{row['what']:<18} {row['bytes'] / 2 ** 20:5.1f} MiB, {row['world']} ranks: "
              f"predicted {row['predicted_s'] * 1e3:7.2f} ms, measured "
              f"{row['measured_s'] * 1e3:7.2f} ms "
              f"({(row['predicted_s'] / row['measured_s'] - 1) * 100:+.0f}%)")
    print("busbw at 16 MiB: " + ", ".join(f"{n} {b / 1e9:.2f} GB/s" for n, b in busbw.items()))


if __name__ == "__main__":
    main()
