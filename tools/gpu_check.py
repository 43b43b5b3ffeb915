"""`make gpu-check`: does every chapter work on this machine, GPUs included?

Runs every chapter top to bottom in a fresh Python process, on this machine's own
PyTorch, twice: under tests/notebook.env (the settings the chapters are stored under:
seeds, one thread) and in a plain environment without them (a reader's node); then
`scripts/train_ddp.py` under `torchrun --nproc-per-node <GPUs>` (2 CPU processes without
GPUs), then each exercise's reference solution (solutions/chNN.py) through the exercise
checker. It writes a JSON report and prints a summary: the doctor's problems with their
fixes, then a table per part: passed or failed, every failing cell with the first line of
its error, seconds. It needs no Jupyter: each code cell is executed in order, as a kernel
would, in one namespace; a cell tagged `raises-exception` must raise. A failing cell does
not stop the chapter: the cells after it still run, and their failures are reported as
following the first (they may be its consequence: its names are missing). Outputs are
not compared (that is nbval's job, on CPUs); what is checked is that every cell, with its
`assert`s, passes here.

    python tools/gpu_check.py                    # every chapter + the torchrun script
    python tools/gpu_check.py --chapters notebooks/05_*.ipynb --no-script
    python tools/gpu_check.py --env notebook --no-exercises   # half the time: one pass
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
import textwrap
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "runs" / "gpu_check"
CHAPTER_TIMEOUT_S = 300
SCRIPT_TIMEOUT_S = 300
EXERCISES_TIMEOUT_S = 300  # every reference solution, one child (25 took 29 s on 2 CPU cores)
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


def add_failure(result: dict, cell: int | None, error: str) -> None:
    """Record a failing cell (None: outside any cell) in ``result``. The first failure is
    also the chapter's ``failed_cell`` and ``error``; every later one is marked as
    ``follows`` the first, since a failed cell leaves its names unset or half-made and
    whether a later failure is its consequence cannot be told in general."""
    failures = result.setdefault("failures", [])
    first = failures[0]["cell"] if failures else None
    failures.append({"cell": cell, "error": error, "follows": first if failures else None})
    if len(failures) == 1:
        result.update(failed_cell=cell, error=error)
    result["passed"] = False


def run_chapter(notebook_path: Path, result_path: Path | None = None) -> dict:
    """Execute a chapter's code cells in this process, as a kernel would. A failing cell
    does not stop the chapter: the cells after it run too, so that every failure is
    recorded (those after the first marked as following it). Only an exit or an
    interrupt (SystemExit, KeyboardInterrupt) stops it. The result is written to
    ``result_path`` before each cell, so that a parent that has to kill a hanging chapter
    still knows which cell hung and what failed before. Returns {"passed", "cells",
    "failed_cell", "error", "failures", "complete", "running_cell", "seconds"}."""
    import types

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = types.ModuleType("__main__")  # cell functions pickle by reference, as in a kernel
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    started = time.perf_counter()
    cells = code_cells(notebook_path)
    result = {"passed": True, "cells": len(cells), "failed_cell": None, "error": None,
              "failures": [], "complete": False, "running_cell": None, "seconds": 0.0}

    def save() -> None:
        result["seconds"] = time.perf_counter() - started
        if result_path is not None:
            Path(result_path).write_text(json.dumps(result))

    for index, source, must_raise in cells:
        result["running_cell"] = index
        save()
        name = f"<{Path(notebook_path).stem} cell {index}>"
        # Like IPython: the source is findable, so inspect.getsource works on cell code.
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        print(f"[gpu-check] {Path(notebook_path).name} cell {index}", flush=True)
        try:
            exec(compile(source, name, "exec"), main.__dict__)  # noqa: S102
        except BaseException as exc:  # the cell's failure is recorded, the chapter goes on
            if must_raise and isinstance(exc, Exception):
                print(f"[gpu-check]   raised as expected: {_first_line(exc)}", flush=True)
                continue
            traceback.print_exc()
            add_failure(result, index, _first_line(exc))
            if not isinstance(exc, Exception):  # sys.exit(), Ctrl-C: nothing more to run
                break
            continue
        finally:
            plt.close("all")
        if must_raise:
            add_failure(result, index, "tagged raises-exception, but raised nothing")
    result.update(complete=True, running_cell=None)
    save()
    return result


# --------------------------------------------------------------- the whole check


def notebook_settings() -> dict[str, str]:
    """tests/notebook.env, the settings chapters run with under `make lab`/`make test`."""
    settings = {}
    for line in (ROOT / "tests" / "notebook.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings[key] = value
    return settings


# The two environments the chapters run in: the one their outputs are stored under, and a
# reader's own, where nothing of tests/notebook.env is set.
ENVIRONMENTS = {"notebook": "under tests/notebook.env (the chapters' stored settings)",
                "plain": "in a plain environment (tests/notebook.env's variables unset, "
                         "as on a reader's node)"}


def child_environment(extra_path: str | None, notebook: bool = True,
                      more_paths: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment with tests/notebook.env's settings, or (``notebook``
    False) with every variable tests/notebook.env names removed, whatever the shell set."""
    env = dict(os.environ)
    settings = notebook_settings()
    if notebook:
        env.update(settings)
    else:
        for key in settings:
            env.pop(key, None)
    env.update({"MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"})
    paths = [str(ROOT), *more_paths] + ([extra_path] if extra_path else [])
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


def check_chapter(path: Path, out: Path, env: dict[str, str], timeout: float,
                  tag: str = "") -> dict:
    result_file = out / f"{path.stem}{tag}.result.json"
    log_file = out / f"{path.stem}{tag}.log"
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
    result.setdefault("passed", False)
    result.setdefault("failures", [])
    complete = result.get("complete", False)
    if code is None:  # also after its last cell: something kept the process alive
        after = " after its last cell" if complete else ""
        crash = f"timed out after {timeout:.0f} s{after}"
    elif code != 0 and (not complete or result.get("passed")):
        tail = log_file.read_text().strip().splitlines()[-1:] or ["no output"]
        crash = f"exited with status {code}: {tail[0][:200]}"
    else:
        crash = None
    if crash:  # the cell it was in, if it was in one
        add_failure(result, None if complete else result.get("running_cell"), crash)
    for key in ("complete", "running_cell"):
        result.pop(key, None)
    result.update({"name": path.stem, "seconds": round(seconds, 1), "log": log_file.name})
    return result


# ------------------------------------------------------------------ the exercises


def _exercise_error(report) -> str:
    """One line for a reference solution that did not pass: the first case that failed."""
    if not report.attempted:
        return "the solution is still the stub (raises NotImplementedError)"
    outcomes = report.outcomes
    passed = sum(o.status == "pass" for o in outcomes)
    first = next(o for o in outcomes if o.status != "pass")
    detail = (first.detail.strip().splitlines() or [""])[0]
    return (f"{passed} of {len(outcomes)} cases passed; {first.status}: {first.case.label}"
            f"{': ' + detail if detail else ''}")[:300]


def run_exercises(solutions: Path, keys: list[str] | None, result_path: Path) -> list[dict]:
    """Check each exercise's reference solution (``REFERENCE[key]`` of ``solutions``'s
    module ``chNN``, as tests/exercises/test_exercises.py finds it) in this process, without
    recording progress. The rows are written to ``result_path`` before each exercise, so
    that a parent that has to kill a hanging check knows which one hung."""
    import importlib

    from mgpu_helpers import exercises

    sys.path.insert(0, str(Path(solutions).parent))
    registry = exercises.registry()
    keys = list(registry) if keys is None else keys
    rows = [{"name": key, "passed": False, "error": "not run: the check stopped before it",
             "seconds": 0.0} for key in keys]
    state = {"rows": rows, "running": None}
    for index, row in enumerate(rows):
        state["running"] = index
        Path(result_path).write_text(json.dumps(state))
        key, started = row["name"], time.perf_counter()
        print(f"[gpu-check] exercise {key}", flush=True)
        exercise = registry.get(key)
        where = f"{Path(solutions).name}/ch{key.split('.')[0]}.py"
        if exercise is None:
            row["error"] = f"no such exercise; the exercises are {', '.join(registry)}"
            continue
        row["title"] = exercise.title
        try:
            module = importlib.import_module(f"{Path(solutions).name}.ch{exercise.chapter}")
            solution = module.REFERENCE[key]
        except (ImportError, AttributeError, KeyError) as exc:
            row["error"] = f"no reference solution in {where} (REFERENCE[{key!r}]): " \
                           f"{_first_line(exc)}"
            continue
        try:
            report = exercises.run(key, solution, record=False)
        except Exception as exc:  # the checker itself failed: that is the verdict
            traceback.print_exc()
            row["error"] = f"the check failed: {_first_line(exc)}"
        else:
            print("\n".join(report.lines()), flush=True)
            row.update(passed=report.passed,
                       error=None if report.passed else _exercise_error(report))
        row["seconds"] = round(time.perf_counter() - started, 1)
    state["running"] = None
    Path(result_path).write_text(json.dumps(state))
    return rows


def check_exercises(out: Path, env: dict[str, str], solutions: Path, keys: list[str] | None,
                    timeout: float) -> list[dict]:
    """The reference solutions through the exercise checker, in one child process."""
    result_file, log_file = out / "exercises.result.json", out / "exercises.log"
    result_file.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--run-exercises",
               "--solutions", str(solutions), "--result", str(result_file)]
    if keys is not None:
        command += ["--exercises", *keys]
    with open(log_file, "w") as log:
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout,
                                  start_new_session=True)
            crash = None if done.returncode in (0, 1) else \
                f"the check exited with status {done.returncode}"
        except subprocess.TimeoutExpired:
            crash = f"timed out after {timeout:.0f} s"
    state = json.loads(result_file.read_text()) if result_file.exists() else None
    if state is None:
        return [{"name": "exercises", "passed": False, "seconds": 0.0, "log": log_file.name,
                 "error": crash or "the check wrote no result"}]
    rows = state["rows"]
    if crash and state["running"] is not None:
        rows[state["running"]]["error"] = crash
    for row in rows:
        row["log"] = log_file.name
    return rows


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


def _failure_text(failure: dict) -> str:
    where = "" if failure["cell"] is None else f"cell {failure['cell']}: "
    after = "" if failure.get("follows") is None else f" (after cell {failure['follows']})"
    return f"{where}{failure['error']}{after}"


def _section(title: str, label: str, rows: list[dict]) -> list[str]:
    width = max([len(label)] + [len(r["name"]) for r in rows])
    lines = ["", title, f"{label:<{width}}  {'result':<6}  {'seconds':>7}  failures"]
    for row in rows:
        failures = row.get("failures") or []
        texts = [_failure_text(f) for f in failures] if failures else \
            [] if row["passed"] else [row.get("error") or ""]
        texts = texts or [""]
        lines.append(f"{row['name']:<{width}}  {'passed' if row['passed'] else 'FAILED':<6}  "
                     f"{row['seconds']:>7.1f}  {texts[0]}".rstrip())
        lines += [f"{'':<{width + 19}}{text}" for text in texts[1:]]
    return lines


def doctor_lines(problems: list[str]) -> list[str]:
    """The environment report's problems (`python -m mgpu_helpers`), each with its fix."""
    if not problems:
        return ["doctor (python -m mgpu_helpers): no problems"]
    lines = [f"doctor (python -m mgpu_helpers): {len(problems)} problem(s), each with its fix:"]
    for problem in problems:
        lines += textwrap.wrap(problem, 92, initial_indent="  * ", subsequent_indent="    ")
    return lines


def sections(report: dict) -> list[tuple[str, str, str, list[dict]]]:
    """(title, short name, first column, rows) of each part of the report that ran."""
    parts = []
    for env, key in ((report.get("envs") or ["notebook"])[0], "results"), ("plain",
                                                                              "plain_results"):
        if report.get(key):
            parts.append((f"chapters {ENVIRONMENTS[env]}", f"chapters ({env} env)", "chapter",
                          report[key]))
    if report.get("exercises"):
        parts.append(("exercises: the reference solutions through the checker "
                      f"({report.get('solutions', 'solutions')}/chNN.py)", "exercises",
                      "exercise", report["exercises"]))
    return parts


def table(report: dict) -> str:
    facts = report["machine"]
    gpus = ", ".join(facts["gpus"]) or "no GPU"
    lines = [f"gpu-check: {gpus}; PyTorch {facts['torch']}, Python {facts['python']}",
             f"plan of the GPU-capable cells: {facts['plan']}",
             *doctor_lines(facts.get("problems") or [])]
    summary = []
    for title, short, label, rows in sections(report):
        lines += _section(title, label, rows)
        summary.append(f"{short}: {sum(r['passed'] for r in rows)} of {len(rows)} passed")
    lines.append("\n" + "; ".join(summary) +
                 f"\nin {report['seconds']:.0f} s; report: {report['report_path']}")
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
    parser.add_argument("--env", choices=("both", "notebook", "plain"), default="both",
                        help="run the chapters under tests/notebook.env (their stored "
                             "settings), in a plain environment without it (a reader's), "
                             "or both, one after the other (default; twice the time)")
    parser.add_argument("--no-exercises", action="store_true",
                        help="skip checking the exercises' reference solutions")
    parser.add_argument("--exercises", nargs="+", default=None, metavar="KEY",
                        help="check only these exercises (default: every one)")
    parser.add_argument("--solutions", type=Path, default=ROOT / "solutions",
                        help="the package of reference solutions (chNN.py with REFERENCE)")
    parser.add_argument("--run-chapter", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--run-exercises", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.solutions = args.solutions.resolve()

    if args.run_chapter is not None:  # inside the child process of one chapter
        result = run_chapter(args.run_chapter, args.result)
        return 0 if result["passed"] else 1
    if args.run_exercises:  # inside the child process of the exercises
        rows = run_exercises(args.solutions, args.exercises, args.result)
        return 0 if all(r["passed"] for r in rows) else 1

    if args.record is not None:
        from chapters import record_gpu_check  # tools/chapters.py, beside this file
        try:
            changed = record_gpu_check(ROOT / "notebooks", json.loads(args.record.read_text()))
        except (OSError, ValueError, KeyError) as error:
            parser.error(f"cannot record {args.record}: {error}")
        print(f"[gpu-check] recorded the GPU verdicts of {len(changed)} chapter(s); update "
              "the README's chapter table to match (tests/workbook/test_chapters.py checks it)")
        return 0

    chapters = args.chapters
    if chapters is None:
        chapters = [*sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")),
                    *sorted((ROOT / "notebooks").glob("appendix_*.ipynb"))]
    chapters = [p.resolve() for p in chapters]
    absent = [str(p) for p in chapters if not p.is_file()]
    if absent:
        parser.error(f"no such notebook: {', '.join(absent)}")
    if not args.no_exercises and not args.solutions.is_dir():
        parser.error(f"no such folder of reference solutions: {args.solutions}")
    extra = install_wheels(args.wheels) if args.wheels else None
    try:
        return check_everything(chapters, extra, args, parser)
    finally:
        if extra:
            shutil.rmtree(extra, ignore_errors=True)


def check_everything(chapters: list[Path], extra: str | None, args, parser) -> int:
    envs = ["notebook", "plain"] if args.env == "both" else [args.env]
    environments = {name: child_environment(extra, notebook=name == "notebook")
                    for name in envs}
    env = environments[envs[0]]
    missing = missing_modules(env)
    if missing:
        parser.error(f"missing Python packages: {', '.join(missing)}. Install them, or on "
                     "a machine without network bring wheels: `make gpu-wheels` where there "
                     "is network, then `--wheels .whl` here (README, 'make gpu-check').")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    facts = machine_facts(env)
    print(f"[gpu-check] {facts['plan']}", flush=True)
    passes = {}
    for name in envs:
        rows = passes[name] = []
        for path in chapters:
            rows.append(check_chapter(path, args.out, environments[name], args.timeout,
                                      tag="" if name == envs[0] else f".{name}"))
            row = rows[-1]
            row["env"] = name
            print(f"[gpu-check] {row['name']} ({name} env): "
                  f"{'passed' if row['passed'] else 'FAILED'} in {row['seconds']:.0f} s "
                  f"{row.get('error') or ''}", flush=True)
    results = passes[envs[0]]
    if not args.no_script:
        gpus = len(facts["gpus"]) if facts["backend"] != "gloo" else 0
        results.append(check_script(args.out, env, gpus or 2, SCRIPT_TIMEOUT_S))
    exercise_rows = []
    if not args.no_exercises:
        exercise_env = child_environment(extra, notebook=envs[0] == "notebook",
                                         more_paths=(str(args.solutions.parent),))
        exercise_rows = check_exercises(args.out, exercise_env, args.solutions,
                                        args.exercises, EXERCISES_TIMEOUT_S)
    report_path = args.out / "report.json"
    report = {"machine": facts, "envs": envs, "results": results,
              "plain_results": passes["plain"] if envs[1:] else [],
              "exercises": exercise_rows, "solutions": str(args.solutions),
              "seconds": round(time.perf_counter() - started, 1),
              "date": time.strftime("%Y-%m-%d"), "report_path": str(report_path)}
    report_path.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report), flush=True)
    everything = [*results, *report["plain_results"], *exercise_rows]
    return 0 if all(r["passed"] for r in everything) else 1


if __name__ == "__main__":
    raise SystemExit(main())
