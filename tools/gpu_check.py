"""`make gpu-check`: does every chapter work on this machine, GPUs included?

Runs every chapter top to bottom in a fresh Python process, on this machine's own
PyTorch, then `scripts/train_ddp.py` under `torchrun --nproc-per-node <GPUs>` (2 CPU
processes without GPUs), and writes a JSON report and a one-screen table: chapter,
passed or failed, the first error, seconds, and the plan the chapter's GPU-capable
cells used. It needs no Jupyter: each code cell is executed in order, as a kernel
would, in one namespace; a cell tagged `raises-exception` must raise. Outputs are not
compared (that is nbval's job, on CPUs); what is checked is that every cell, with its
`assert`s, passes here.

    python tools/gpu_check.py                    # every chapter + the torchrun script
    python tools/gpu_check.py --chapters notebooks/05_*.ipynb --no-script
    python tools/gpu_check.py --wheels .whl      # a node without network: see README
    python tools/gpu_check.py --record runs/gpu_check/report.json   # store a GPU run's
                                                 # verdicts in the chapters (landing page)

On a machine without network, the pure-Python packages the chapters import but a bare
PyTorch image lacks (IPython, ipywidgets) travel as wheels: `make gpu-wheels` downloads
them into `.whl/`, and `--wheels .whl` installs them into a temporary folder first.
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "runs" / "gpu_check"
CHAPTER_TIMEOUT_S = 300
SCRIPT_TIMEOUT_S = 300
REQUIRED_ACCURACY = 0.90  # chapter 05's stated test accuracy, also the script's
# Imported by the chapters; a bare PyTorch image may lack the first two.
NEEDED_MODULES = ("torch", "IPython", "ipywidgets", "matplotlib", "tqdm", "cloudpickle", "sklearn",
                  "PIL", "torchvision", "numpy")


# ------------------------------------------------------------------ one chapter


def code_cells(notebook_path: Path) -> list[tuple[int, str, bool]]:
    """(cell index, source, must raise) for each code cell, in order."""
    notebook = json.loads(Path(notebook_path).read_text())
    cells = []
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        tags = cell.get("metadata", {}).get("tags", [])
        cells.append((index, source, "raises-exception" in tags))
    return cells


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def run_chapter(notebook_path: Path) -> dict:
    """Execute a chapter's code cells in this process, as a kernel would; stop at the
    first failing cell. Returns {"passed", "cells", "failed_cell", "error", "seconds"}."""
    import types

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = types.ModuleType("__main__")  # cell functions pickle by reference, as in a kernel
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    started = time.perf_counter()
    cells = code_cells(notebook_path)
    for index, source, must_raise in cells:
        name = f"<{Path(notebook_path).stem} cell {index}>"
        # Like IPython: the source is findable, so inspect.getsource works on cell code.
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        print(f"[gpu-check] {Path(notebook_path).name} cell {index}", flush=True)
        try:
            exec(compile(source, name, "exec"), main.__dict__)  # noqa: S102
        except BaseException as exc:  # the cell's failure is the chapter's result
            if must_raise and isinstance(exc, Exception):
                print(f"[gpu-check]   raised as expected: {_first_line(exc)}", flush=True)
                continue
            traceback.print_exc()
            return {"passed": False, "cells": len(cells), "failed_cell": index,
                    "error": _first_line(exc), "seconds": time.perf_counter() - started}
        finally:
            plt.close("all")
        if must_raise:
            return {"passed": False, "cells": len(cells), "failed_cell": index,
                    "error": "tagged raises-exception, but raised nothing",
                    "seconds": time.perf_counter() - started}
    return {"passed": True, "cells": len(cells), "failed_cell": None, "error": None,
            "seconds": time.perf_counter() - started}


# --------------------------------------------------------------- the whole check


def notebook_settings() -> dict[str, str]:
    """tests/notebook.env, the settings chapters run with under `make lab`/`make test`."""
    settings = {}
    for line in (ROOT / "tests" / "notebook.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings[key] = value
    return settings


def child_environment(extra_path: str | None) -> dict[str, str]:
    env = {**os.environ, **notebook_settings(), "MPLBACKEND": "Agg",
           "PYTHONUNBUFFERED": "1"}
    paths = [str(ROOT)] + ([extra_path] if extra_path else [])
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def install_wheels(folder: Path) -> str:
    """pip-install the wheels in ``folder`` into a temporary folder (no network, no
    dependencies resolved: the folder holds them all); returns that folder."""
    wheels = sorted(str(p) for p in Path(folder).glob("*.whl"))
    if not wheels:
        raise SystemExit(f"gpu-check: no wheels in {folder}; run `make gpu-wheels` where "
                         "there is network, and bring the folder along")
    target = tempfile.mkdtemp(prefix="gpu-check-site-")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                    "--no-deps", "--no-compile", "--target", target, *wheels], check=True)
    return target


def missing_modules(env: dict[str, str]) -> list[str]:
    probe = ("import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] "
             "if importlib.util.find_spec(m) is None))")
    done = subprocess.run([sys.executable, "-c", probe, *NEEDED_MODULES], env=env,
                          capture_output=True, text=True, check=True)
    return done.stdout.split()


def machine_facts(env: dict[str, str]) -> dict:
    """Versions, GPUs and the plan, asked in a child (this process never touches CUDA)."""
    code = ("import json, torch, mgpu_helpers as mh; r = mh.describe(); "
            "print(json.dumps({'torch': torch.__version__, 'cuda_build': torch.version.cuda, "
            "'gpus': [g.name for g in r.gpus], 'plan': r.plan.summary, "
            "'backend': r.plan.backend, 'nprocs': r.plan.nprocs, "
            "'problems': list(r.problems)}))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True)
    facts = json.loads(done.stdout)
    facts.update({"python": platform.python_version(), "machine": platform.machine(),
                  "cpus": os.cpu_count()})
    return facts


def check_chapter(path: Path, out: Path, env: dict[str, str], timeout: float) -> dict:
    result_file = out / f"{path.stem}.result.json"
    log_file = out / f"{path.stem}.log"
    result_file.unlink(missing_ok=True)
    started = time.perf_counter()
    with open(log_file, "w") as log:
        try:
            done = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--run-chapter", str(path),
                 "--result", str(result_file)],
                cwd=path.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
                timeout=timeout, start_new_session=True)
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = time.perf_counter() - started
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    if code is None:  # also after its last cell: something kept the process alive
        after = " after its last cell" if result.get("passed") else ""
        result.update(passed=False, error=f"timed out after {timeout:.0f} s{after}")
    elif code != 0 and (not result or result.get("passed")):
        tail = log_file.read_text().strip().splitlines()[-1:] or ["no output"]
        result.update(passed=False, error=f"exited with status {code}: {tail[0][:200]}")
    result.update({"name": path.stem, "seconds": round(seconds, 1), "log": log_file.name})
    return result


def check_script(out: Path, env: dict[str, str], nprocs: int, timeout: float) -> dict:
    """scripts/train_ddp.py under torchrun, one process per GPU (2 CPU processes without)."""
    result_json = out / "train_ddp.json"
    result_json.unlink(missing_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="gpu-check-train-"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nprocs), str(ROOT / "scripts" / "train_ddp.py"),
               "--checkpoint", str(workdir / "run.pt"), "--result", str(result_json)]
    name = f"torchrun --nproc-per-node {nprocs} scripts/train_ddp.py"
    started = time.perf_counter()
    log_file = out / "train_ddp.log"
    try:
        with open(log_file, "w") as log:
            done = subprocess.run(command, cwd=ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout,
                                  start_new_session=True)
        error = None if done.returncode == 0 else f"exited with status {done.returncode}"
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout:.0f} s"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if error is None:
        accuracy = json.loads(result_json.read_text())["test"]["accuracy"]
        if accuracy < REQUIRED_ACCURACY:
            error = f"test accuracy {accuracy:.1%} < {REQUIRED_ACCURACY:.0%}"
    return {"name": name, "passed": error is None, "error": error,
            "seconds": round(time.perf_counter() - started, 1), "log": log_file.name}


def table(report: dict) -> str:
    facts = report["machine"]
    gpus = ", ".join(facts["gpus"]) or "no GPU"
    lines = [f"gpu-check: {gpus}; PyTorch {facts['torch']}, Python {facts['python']}",
             f"plan of the GPU-capable cells: {facts['plan']}", ""]
    width = max(len(r["name"]) for r in report["results"])
    lines.append(f"{'chapter':<{width}}  {'result':<6}  {'seconds':>7}  first error")
    for row in report["results"]:
        where = "" if row.get("failed_cell") is None else f"cell {row['failed_cell']}: "
        error = "" if row["passed"] else where + (row.get("error") or "")
        lines.append(f"{row['name']:<{width}}  {'passed' if row['passed'] else 'FAILED':<6}  "
                     f"{row['seconds']:>7.1f}  {error}")
    passed = sum(r["passed"] for r in report["results"])
    lines.append(f"\n{passed} of {len(report['results'])} passed in "
                 f"{report['seconds']:.0f} s; report: {report['report_path']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chapters", nargs="*", type=Path, default=None,
                        help="notebooks to run (default: every chapter)")
    parser.add_argument("--no-script", action="store_true",
                        help="skip scripts/train_ddp.py under torchrun")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder for report.json and each chapter's log")
    parser.add_argument("--timeout", type=float, default=CHAPTER_TIMEOUT_S,
                        help="seconds each chapter may take")
    parser.add_argument("--wheels", type=Path, default=None,
                        help="install the wheels in this folder first (no network needed)")
    parser.add_argument("--record", type=Path, default=None,
                        help="store the verdicts of this report (from a run on GPUs) in the "
                             "chapters' metadata, shown on the landing page, and stop")
    parser.add_argument("--run-chapter", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.run_chapter is not None:  # inside the child process of one chapter
        result = run_chapter(args.run_chapter)
        args.result.write_text(json.dumps(result))
        return 0 if result["passed"] else 1

    if args.record is not None:
        from chapters import record_gpu_check  # tools/chapters.py, beside this file
        try:
            changed = record_gpu_check(ROOT / "notebooks", json.loads(args.record.read_text()))
        except (OSError, ValueError, KeyError) as error:
            parser.error(f"cannot record {args.record}: {error}")
        print(f"[gpu-check] recorded the GPU verdicts of {len(changed)} chapter(s); update "
              "the README's chapter table to match (tests/test_chapters.py checks it)")
        return 0

    chapters = args.chapters
    if chapters is None:
        chapters = [*sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")),
                    *sorted((ROOT / "notebooks").glob("appendix_*.ipynb"))]
    chapters = [p.resolve() for p in chapters]
    absent = [str(p) for p in chapters if not p.is_file()]
    if absent:
        parser.error(f"no such notebook: {', '.join(absent)}")
    extra = install_wheels(args.wheels) if args.wheels else None
    try:
        return check_everything(chapters, extra, args, parser)
    finally:
        if extra:
            shutil.rmtree(extra, ignore_errors=True)


def check_everything(chapters: list[Path], extra: str | None, args, parser) -> int:
    env = child_environment(extra)
    missing = missing_modules(env)
    if missing:
        parser.error(f"missing Python packages: {', '.join(missing)}. Install them, or on "
                     "a machine without network bring wheels: `make gpu-wheels` where there "
                     "is network, then `--wheels .whl` here (README, 'make gpu-check').")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    facts = machine_facts(env)
    print(f"[gpu-check] {facts['plan']}", flush=True)
    results = []
    for path in chapters:
        results.append(check_chapter(path, args.out, env, args.timeout))
        row = results[-1]
        print(f"[gpu-check] {row['name']}: {'passed' if row['passed'] else 'FAILED'} "
              f"in {row['seconds']:.0f} s {row.get('error') or ''}", flush=True)
    if not args.no_script:
        gpus = len(facts["gpus"]) if facts["backend"] != "gloo" else 0
        results.append(check_script(args.out, env, gpus or 2, SCRIPT_TIMEOUT_S))
    report_path = args.out / "report.json"
    report = {"machine": facts, "results": results,
              "seconds": round(time.perf_counter() - started, 1),
              "date": time.strftime("%Y-%m-%d"), "report_path": str(report_path)}
    report_path.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report), flush=True)
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
