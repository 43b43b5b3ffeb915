"""The workbook's chapters as data: titles, summaries, measured run times, navigation.

Each chapter notebook keeps what describes it in its own metadata, under ``"workbook"``:
``summary`` (one line: what you learn) and ``run_time_s`` (seconds, measured by
``execute`` when the chapter last ran in a fresh kernel, kernel start included).
Every notebook (appendices too) may set ``nbval_kernels`` there: ``"generic"`` where its
compared outputs are computed numbers, so ``make nbval`` runs it on PyTorch's generic
kernels (a number printed past its precision fails there); ``"best"``, the default,
runs it on this CPU's best kernels.
From these, ``write_landing`` builds the landing notebook that ``make lab`` opens:
the chapter map with links and this machine's environment report.

An authoring tool, not part of the helper package: chapters never import it.
Command line (what the Makefile runs)::

    python tools/chapters.py execute notebooks/05_*.ipynb   # run in place, timed
    python tools/chapters.py nav                             # navigation lines
    python tools/chapters.py landing                         # notebooks/start_here.ipynb
    python tools/chapters.py kernels generic notebooks/*.ipynb  # those nbval runs so
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import platform
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CHAPTER_PATTERN = re.compile(r"^(\d\d)_\w+\.ipynb$")
TITLE_PATTERN = re.compile(r"^#\s+(\d\d)\s+·\s+(.+)$", re.MULTILINE)
METADATA_KEY = "workbook"
LANDING_NAME = "start_here.ipynb"
# Cell metadata marking the landing page's environment report, so tests can find it.
REPORT_TAG = "environment-report"
# The navigation line under each chapter's heading starts with this (see `navigation`).
NAV_PREFIX = "**Navigate** · "
# The glossary, from a chapter (notebooks/): every navigation line links it.
GLOSSARY_LINK = "../docs/glossary.md"


@dataclass(frozen=True)
class Chapter:
    number: str           # "04"
    path: Path
    title: str            # "DistributedDataParallel: ..."
    summary: str          # one line: what you learn
    run_time_s: float | None  # measured by `execute`; None if never timed
    run_time_machine: str | None = None  # where it was measured, e.g. "2 CPUs, no GPU"
    gpu_check: dict | None = None  # the last `make gpu-check` on GPUs (record_gpu_check)
    words: int = 0        # of prose (markdown cells)
    code_lines: int = 0   # non-blank lines of code cells

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def reading_minutes(self) -> float:
        """How long reading the chapter takes, by READING_RULE."""
        return self.words / PROSE_WORDS_PER_MINUTE + self.code_lines / CODE_LINES_PER_MINUTE


# A reading-time estimate, stated on the landing page: prose at a technical reader's pace,
# code slower (it is read, not skimmed); the exercises' own times are under each task.
PROSE_WORDS_PER_MINUTE = 150
CODE_LINES_PER_MINUTE = 15
READING_RULE = (f"the prose at {PROSE_WORDS_PER_MINUTE} words a minute plus "
                f"the code at {CODE_LINES_PER_MINUTE} lines a minute, without running "
                "anything or the exercises (each task states its own time)")


def appendices(notebooks_dir: Path) -> list[tuple[str, str]]:
    """``(title, file name)`` of each appendix notebook (``appendix_*.ipynb``, headed
    ``# Appendix · Title``), in name order: runnable digressions linked from the chapters."""
    found = []
    for path in sorted(Path(notebooks_dir).glob("appendix_*.ipynb")):
        cells = json.loads(path.read_text()).get("cells", [])
        first = "".join(cells[0]["source"]) if cells else ""
        heading = re.search(r"^#\s+Appendix\s+·\s+(.+)$", first, re.MULTILINE)
        if heading is None:
            raise ValueError(f"{path}: the first cell must start with a heading "
                             "'# Appendix · Title'")
        found.append((heading.group(1).strip(), path.name))
    return found


def chapter_paths(notebooks_dir: Path) -> list[Path]:
    """The chapter notebooks (``NN_name.ipynb``) in reading order."""
    return sorted(p for p in Path(notebooks_dir).iterdir() if CHAPTER_PATTERN.match(p.name))


def read_chapter(path: Path) -> Chapter:
    """A chapter's title (from its first heading), summary and run time (metadata)."""
    path = Path(path)
    notebook = json.loads(path.read_text())
    cells = notebook.get("cells", [])
    first = "".join(cells[0]["source"]) if cells else ""
    heading = TITLE_PATTERN.search(first)
    if heading is None:
        raise ValueError(f"{path}: the first cell must start with a heading "
                         f"'# {path.name[:2]} · Title'")
    if heading.group(1) != path.name[:2]:
        raise ValueError(f"{path}: the heading says chapter {heading.group(1)}, "
                         f"the file name says {path.name[:2]}; rename one of them")
    info = notebook.get("metadata", {}).get(METADATA_KEY, {})
    summary = info.get("summary")
    if not summary:
        raise ValueError(f'{path}: no one-line summary; set metadata["{METADATA_KEY}"]'
                         '["summary"] (shown on the landing page)')
    words = sum(len("".join(c["source"]).split()) for c in cells
                if c["cell_type"] == "markdown")
    code_lines = sum(1 for c in cells if c["cell_type"] == "code"
                     for line in "".join(c["source"]).splitlines() if line.strip())
    return Chapter(number=heading.group(1), path=path, title=heading.group(2).strip(),
                   summary=summary, run_time_s=info.get("run_time_s"),
                   run_time_machine=info.get("run_time_machine"),
                   gpu_check=info.get("gpu_check"), words=words, code_lines=code_lines)


NBVAL_KERNELS = ("best", "generic")


def nbval_kernels(path: Path) -> str:
    """Which of PyTorch's CPU kernels ``make nbval`` runs a notebook on: its metadata's
    ``nbval_kernels``, ``"best"`` where unset."""
    info = json.loads(Path(path).read_text()).get("metadata", {}).get(METADATA_KEY, {})
    kind = info.get("nbval_kernels", "best")
    if kind not in NBVAL_KERNELS:
        raise ValueError(f'{path}: metadata["{METADATA_KEY}"]["nbval_kernels"] is {kind!r}; '
                         f"use one of {', '.join(map(repr, NBVAL_KERNELS))}")
    return kind


NOT_RUN_ON_GPU = "not yet run on a GPU"


def gpu_status(chapter: Chapter) -> str:
    """Where this chapter's GPU path was last checked by `make gpu-check`, honestly:
    "not yet run on a GPU" until a GPU run has been recorded."""
    check = chapter.gpu_check
    if not check:
        return NOT_RUN_ON_GPU
    verdict = "passed" if check["passed"] else "FAILED"
    text = f"{verdict} on {check['gpus']} ({check['torch']}), {check['date']}"
    if check.get("gpu_count") == 1:
        text += "; cells for 2 or more GPUs not run"
    return text


def record_gpu_check(notebooks_dir: Path, report: dict) -> list[Path]:
    """Store a GPU `make gpu-check` report's verdicts in the chapters it ran; a report
    from a machine without GPUs changes nothing (it says nothing about the GPU path)."""
    machine = report["machine"]
    if not machine["gpus"] or machine["backend"] == "gloo":
        raise ValueError("this report comes from a run without GPUs; only a run on GPUs "
                         "says anything about the chapters' GPU path")
    names = sorted(set(machine["gpus"]))
    gpus = " + ".join(f"{machine['gpus'].count(n)}x {n}" for n in names)
    changed = []
    for result in report["results"]:
        path = Path(notebooks_dir) / f"{result['name']}.ipynb"
        if not path.is_file():
            continue
        notebook = json.loads(path.read_text())
        notebook.setdefault("metadata", {}).setdefault(METADATA_KEY, {})["gpu_check"] = {
            "passed": bool(result["passed"]), "gpus": gpus,
            "gpu_count": len(machine["gpus"]),
            "torch": f"PyTorch {machine['torch']}", "date": report["date"]}
        _write_notebook(path, notebook)
        changed.append(path)
    return changed


def read_chapters(notebooks_dir: Path) -> list[Chapter]:
    return [read_chapter(path) for path in chapter_paths(notebooks_dir)]


def _code_of(notebook: dict) -> list[str]:
    """Each code cell's source, with IPython magics and shell lines blanked out."""
    sources = []
    for cell in notebook.get("cells", []):
        if cell["cell_type"] == "code":
            lines = "".join(cell["source"]).splitlines()
            sources.append("\n".join("" if line.lstrip().startswith(("%", "!")) else line
                                      for line in lines))
    return sources


def _module_file(module: str) -> str:
    """``mgpu_helpers.data.loading`` -> ``data/loading.py``; a package -> its ``__init__``."""
    target = importlib.import_module(module)
    package = Path(importlib.import_module("mgpu_helpers").__file__).resolve().parent
    relative = Path(target.__file__).resolve().relative_to(package)
    return relative.as_posix()


def helper_modules(path: Path) -> list[str]:
    """The ``mgpu_helpers`` source files a chapter's code uses, relative to the package.

    Counts ``import mgpu_helpers.x``, ``from mgpu_helpers.x import ...``,
    ``from mgpu_helpers import x`` and ``mh.name`` (for ``import mgpu_helpers as mh``),
    each mapped to the file that defines it (``mh.launch`` -> ``launch.py``).
    """
    used: set[str] = set()

    def add_name(module: str, name: str) -> None:
        """``name`` imported from, or looked up on, ``module``: where is it defined?"""
        try:
            used.add(_module_file(f"{module}.{name}"))  # a submodule
            return
        except ImportError:
            pass
        value = getattr(importlib.import_module(module), name, None)
        defined_in = getattr(value, "__module__", None) or module
        used.add(_module_file(defined_in if defined_in.startswith("mgpu_helpers")
                              else module))

    aliases: set[str] = set()  # names bound to the package, e.g. `mh`, in any cell
    for source in _code_of(json.loads(Path(path).read_text())):
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "mgpu_helpers":
                        aliases.add(alias.asname or alias.name)
                    elif alias.name.startswith("mgpu_helpers."):
                        used.add(_module_file(alias.name))
            elif isinstance(node, ast.ImportFrom) and node.module:
                if node.module.split(".")[0] == "mgpu_helpers":
                    for alias in node.names:
                        add_name(node.module, alias.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases):
                add_name("mgpu_helpers", node.attr)
    return sorted(used)


def short_title(chapter: Chapter) -> str:
    """``05 · DistributedDataParallel`` (the title up to its first colon)."""
    return f"{chapter.number} · {chapter.title.split(':')[0].strip()}"


def navigation(chapters: list[Chapter], index: int) -> str:
    """The navigation line a chapter carries under its heading.

    Previous and next chapter (where there is one), a link to every helper module its
    code uses, so a reader can always see what ``mgpu_helpers`` does for them, and the
    chapter's run time as ``make notebooks`` last measured it, with the machine.
    """
    parts = []
    if index > 0:
        previous = chapters[index - 1]
        parts.append(f"Previous: [{short_title(previous)}]({previous.name})")
    if index + 1 < len(chapters):
        following = chapters[index + 1]
        parts.append(f"Next: [{short_title(following)}]({following.name})")
    modules = helper_modules(chapters[index].path)
    if modules:
        links = ", ".join(f"[`{m}`](../mgpu_helpers/{m})" for m in modules)
        parts.append(f"Helpers used: {links}")
    chapter = chapters[index]
    if chapter.run_time_s is not None:
        where = f" on {chapter.run_time_machine}" if chapter.run_time_machine else ""
        parts.append(f"Run time: {format_run_time(chapter.run_time_s)}{where}")
    parts.append(f"Terms: [glossary]({GLOSSARY_LINK})")
    return NAV_PREFIX + " · ".join(parts)


def _set_navigation(first_cell: str, line: str) -> str:
    """Replace the navigation line in a chapter's first cell, or put one under the heading."""
    lines = first_cell.split("\n")
    for position, text in enumerate(lines):
        if text.startswith(NAV_PREFIX):
            lines[position] = line
            return "\n".join(lines)
    return "\n".join([lines[0], "", line, *lines[1:]])


# The closing paragraph of a chapter's last cell: "Next: [06 · Title](05_x.ipynb): what it
# adds." `make nav` keeps the link right and leaves the words after it to the author.
CLOSING_PATTERN = re.compile(r"^Next: \[[^\]]*\]\([^)]*\)(?P<teaser>.*)$", re.MULTILINE)


def closing_link(chapters: list[Chapter], index: int) -> str | None:
    """The link a chapter's last cell ends with: the next chapter (none after the last)."""
    if index + 1 >= len(chapters):
        return None
    following = chapters[index + 1]
    return f"Next: [{short_title(following)}]({following.name})"


def _set_closing(cells: list[dict], link: str | None) -> bool:
    """Put ``link`` in the last cell's "Next:" paragraph (keeping the words after the
    link), add such a paragraph (in a new markdown cell after a code cell), or remove it
    from the last chapter. Returns whether anything changed."""
    last = cells[-1] if cells else None
    source = "".join(last["source"]) if last and last["cell_type"] == "markdown" else None
    match = CLOSING_PATTERN.search(source) if source is not None else None
    if link is None:
        if not match:
            return False
        last["source"] = (source[:match.start()] + source[match.end():]).rstrip("\n")
        return True
    if match:
        updated = source[:match.start()] + link + match["teaser"] + source[match.end():]
        if updated == source:
            return False
        last["source"] = updated
        return True
    if source is not None:
        last["source"] = source.rstrip("\n") + f"\n\n{link}."
    else:
        from nbformat.v4 import new_markdown_cell

        cells.append(dict(new_markdown_cell(f"{link}.")))
    return True


# An exercise's heading, and the line under it that `make nav` writes from the registry
# (mgpu_helpers.exercises): "**Difficulty** ★★☆ · about 30 minutes".
EXERCISE_HEADING = re.compile(
    r"^(?P<heading>### Exercise (?P<key>\d\d\.\d) · [^\n]*\n)"
    r"(?P<effort>\n\*\*Difficulty\*\* [^\n]*\n)?", re.MULTILINE)


def effort_line(key: str) -> str:
    from mgpu_helpers import exercises

    return f"**Difficulty** {exercises.get(key).effort}"


def _set_efforts(cells: list[dict]) -> bool:
    """Put each exercise's difficulty and time under its heading; returns whether anything
    changed. An exercise the registry does not know raises, naming it."""
    changed = False
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        source = "".join(cell["source"])
        updated = EXERCISE_HEADING.sub(
            lambda match: f"{match['heading']}\n{effort_line(match['key'])}\n", source)
        if updated != source:
            cell["source"] = updated
            changed = True
    return changed


def update_navigation(notebooks_dir: Path) -> list[Path]:
    """Rewrite every chapter's navigation line under its heading, the "Next:" link its
    last cell ends with and the difficulty line under each exercise's heading; returns
    the notebooks that changed."""
    chapters = read_chapters(notebooks_dir)
    changed = []
    for index, chapter in enumerate(chapters):
        notebook = json.loads(chapter.path.read_text())
        cell = notebook["cells"][0]
        source = "".join(cell["source"])
        updated = _set_navigation(source, navigation(chapters, index))
        closing_changed = _set_closing(notebook["cells"], closing_link(chapters, index))
        closing_changed |= _set_efforts(notebook["cells"])
        if updated != source or closing_changed:
            cell["source"] = updated
            _write_notebook(chapter.path, notebook)
            changed.append(chapter.path)
    return changed


def format_run_time(seconds: float | None) -> str:
    if seconds is None:
        return "not measured yet (run `make notebooks`)"
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


#: The parts of the workbook, by the number of their first chapter.
PARTS = {"00": "Part I · Data and data parallelism",
         "06": "Part II · Splitting the model",
         "10": "Part III · Training a language model on many GPUs"}


def format_reading(minutes: float) -> str:
    return f"{minutes:.0f} min" if minutes < 90 else f"{minutes / 60:.1f} h"


def chapter_map(chapters: list[Chapter]) -> str:
    """The chapter map as a markdown table with relative links, a row per part with its
    reading time (READING_RULE)."""
    rows = ["| # | chapter | what you learn | reading | run time | GPU path |",
            "|---|---|---|---|---|---|"]
    parts: list[tuple[int, list[Chapter]]] = []
    for chapter in chapters:
        if chapter.number in PARTS or not parts:
            rows.append("")  # the part's row, written once its chapters are known
            parts.append((len(rows) - 1, []))
        parts[-1][1].append(chapter)
        rows.append(f"| {chapter.number} | [{chapter.title}]({chapter.name}) | "
                    f"{chapter.summary} | {format_reading(chapter.reading_minutes)} | "
                    f"{format_run_time(chapter.run_time_s)} | {gpu_status(chapter)} |")
    for row, members in parts:
        title = PARTS.get(members[0].number, "Chapters")
        total = sum(chapter.reading_minutes for chapter in members)
        rows[row] = f"| | **{title}** | | **{format_reading(total)}** | | |"
    return "\n".join(rows) + f"\n\nReading times are estimates: {READING_RULE}."


def exercise_table(chapters: list[Chapter], progress: dict[str, tuple[int, int]]) -> str:
    """Per chapter with exercises, how many the reader has passed on this machine, with a
    link to them (``progress``: chapter number -> (passed, exercises))."""
    rows = ["| # | chapter | exercises passed here |", "|---|---|---|"]
    for chapter in chapters:
        if chapter.number in progress:
            passed, total = progress[chapter.number]
            rows.append(f"| {chapter.number} | [{chapter.title}]({chapter.name}#Exercises) | "
                        f"{passed} of {total} |")
    return "\n".join(rows)


def landing_notebook(chapters: list[Chapter], report_text: str, measured_on: str,
                     progress: dict[str, tuple[int, int]] | None = None,
                     appendix_links: list[tuple[str, str]] = ()) -> dict:
    """The landing page: how to read the workbook, the chapter map, the environment report.

    The report is stored as the output of a code cell that recomputes it, so the page
    shows this machine's report without running anything, and re-running refreshes it.
    """
    def markdown(cell_id: str, text: str) -> dict:
        return {"cell_type": "markdown", "id": cell_id, "metadata": {}, "source": text}

    intro = (
        "# Multi-GPU PyTorch, from a laptop\n\n"
        "Start with chapter 00 and read in order: each chapter builds on the previous one. "
        "Run a cell with **Shift+Enter**, or a whole chapter with **Run › Run All Cells**. "
        "Every chapter runs on this machine, GPU or not: with no GPU, ranks are CPU "
        "processes over `gloo`; on a GPU node, the GPU-capable cells start one process per "
        "GPU over NCCL, with no change to the notebooks. The last column says where each "
        "chapter's GPU path has been checked by `make gpu-check` (README).\n\n"
        "This page is written by `make lab` each time it starts (it is not part of the "
        "repository). The chapters' run times were measured by `make notebooks` "
        f"(a fresh kernel each, start-up included) on {measured_on}."
    )
    report_cell = {
        "cell_type": "code", "id": "report", "execution_count": 1,
        "metadata": {"tags": [REPORT_TAG]},
        "source": "import mgpu_helpers as mh\n\nprint(mh.describe())",
        "outputs": [{"output_type": "stream", "name": "stdout", "text": report_text + "\n"}],
    }
    return {
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                    "language": "python"},
                     "language_info": {"name": "python"}},
        "cells": [
            markdown("intro", intro),
            markdown("chapters", "## Chapters\n\n" + chapter_map(chapters)
                     + "".join(f"\n\nAppendix: [{title}]({name})"
                               for title, name in appendix_links)),
            markdown("exercises", "## Exercises\n\nEach chapter ends with exercises that "
                     "the chapter checks on this machine (on real ranks where they are "
                     "distributed). Your progress, as `make lab` found it "
                     "(`runs/exercise_progress.json`):\n\n"
                     + exercise_table(chapters, progress or {})),
            markdown("machine", "## This machine\n\nThe environment report, as `make lab` found it "
                     "(the same as `python -m mgpu_helpers`). Re-run the cell after "
                     "changing `CUDA_VISIBLE_DEVICES` or the drivers."),
            report_cell,
            markdown("more", "To keep open beside the chapters: the [glossary]"
                     "(../docs/glossary.md), the [cheat-sheet](../docs/cheatsheet.md) and "
                     "[how the tools map](../docs/tools_map.md) (Accelerate, Lightning, "
                     "torchtitan).\n\n"
                     "More: the README's sections on GPU nodes, clusters, conda, "
                     "running nbval on your own notebooks, and troubleshooting "
                     "([README.md](../README.md))."),
        ],
    }


def write_landing(notebooks_dir: Path, out_path: Path, report_text: str | None = None,
                  progress: dict[str, tuple[int, int]] | None = None) -> Path:
    """Write the landing notebook; the report defaults to this machine's ``describe()``,
    the exercise progress to the reader's (``mgpu_helpers.exercises``)."""
    if progress is None:
        from mgpu_helpers.exercises import chapter_progress
        progress = chapter_progress()
    if report_text is None:
        from mgpu_helpers.runtime.env import describe
        report_text = str(describe())
    chapters = read_chapters(notebooks_dir)
    machines = sorted({c.run_time_machine for c in chapters if c.run_time_machine})
    measured_on = " and ".join(machines) if machines else "this machine, once you run it"
    notebook = landing_notebook(chapters, report_text, measured_on, progress,
                                appendices(notebooks_dir))
    out_path = Path(out_path)
    temporary = out_path.with_name(f".{out_path.name}.tmp")
    temporary.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
    os.replace(temporary, out_path)
    return out_path


def _stamp_run_time(metadata: dict, seconds: float) -> None:
    info = metadata.setdefault(METADATA_KEY, {})
    info["run_time_s"] = round(seconds, 1)
    info["run_time_machine"] = machine_description()


def machine_description() -> str:
    """``2 CPUs, x86_64, no GPU``: where a run time was measured."""
    from mgpu_helpers.runtime.devices import count_gpus
    gpus = count_gpus()
    gpu_text = "no GPU" if gpus == 0 else f"{gpus} GPU{'s' if gpus > 1 else ''}"
    return f"{os.cpu_count()} CPUs, {platform.machine()}, {gpu_text}"


def _write_notebook(path: Path, notebook: dict) -> None:
    import nbformat
    temporary = path.with_name(f".{path.name}.tmp")
    nbformat.write(nbformat.from_dict(notebook), str(temporary))
    os.replace(temporary, path)


def execute(paths: list[Path], timeout: int = 600) -> dict[str, float]:
    """Run each notebook in a fresh kernel, store its outputs and its run time, in place.

    Like ``jupyter nbconvert --to notebook --execute --inplace``: a notebook whose cell
    fails is left as it was (nothing stored), and the error names the cell.
    """
    import nbformat
    from nbconvert.preprocessors import CoalesceStreamsPreprocessor, ExecutePreprocessor

    times = {}
    for path in map(Path, paths):
        notebook = nbformat.read(str(path), as_version=4)
        runner = ExecutePreprocessor(timeout=timeout, kernel_name="python3",
                                     record_timing=False)
        print(f"[chapters] executing {path}", flush=True)
        start = time.perf_counter()
        runner.preprocess(notebook, {"metadata": {"path": str(path.parent)}})
        seconds = time.perf_counter() - start
        # one stream output per run of prints, a progress bar's redraws (\r) kept as its
        # last state: what the reader saw, not every update (nbval compares the same way)
        CoalesceStreamsPreprocessor().preprocess(notebook, {})
        _stamp_run_time(notebook.metadata, seconds)
        _write_notebook(path, dict(notebook))
        print(f"[chapters] {path.name}: {seconds:.1f} s", flush=True)
        times[path.name] = seconds
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/chapters.py",
                                     description="Run chapters timed, or write the landing page.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("execute", help="run notebooks in place, storing run times")
    run.add_argument("notebooks", nargs="+", type=Path)
    nav = commands.add_parser("nav", help="rewrite every chapter's navigation line")
    nav.add_argument("notebooks_dir", type=Path, nargs="?", default=Path("notebooks"))
    landing = commands.add_parser("landing", help="write the landing notebook")
    landing.add_argument("notebooks_dir", type=Path, nargs="?", default=Path("notebooks"),
                         help=f"the chapters' folder; the page is written there as "
                              f"{LANDING_NAME}")
    kernels = commands.add_parser("kernels", help="print the notebooks nbval runs on KIND")
    kernels.add_argument("kind", choices=NBVAL_KERNELS)
    kernels.add_argument("notebooks", nargs="*", type=Path)
    args = parser.parse_args(argv)
    if args.command == "kernels":
        try:
            print(" ".join(str(p) for p in args.notebooks if nbval_kernels(p) == args.kind))
        except (OSError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    elif args.command == "execute":
        missing = [str(p) for p in args.notebooks if not p.is_file()]
        if missing:
            parser.error(f"no such notebook: {', '.join(missing)}")
        execute(args.notebooks)
    elif args.command == "nav":
        for path in update_navigation(args.notebooks_dir):
            print(f"[chapters] updated the navigation of {path}", file=sys.stderr)
    else:
        written = write_landing(args.notebooks_dir, args.notebooks_dir / LANDING_NAME)
        print(f"[chapters] wrote {written}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
