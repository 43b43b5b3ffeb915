"""The chapter catalogue: navigation, links, run times and the landing page."""

import json
import re
import subprocess
import sys
from pathlib import Path

import chapters  # tools/chapters.py (pytest's pythonpath)
import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def markdown_links(path: Path) -> list[str]:
    notebook = json.loads(path.read_text())
    return [link for cell in notebook["cells"] if cell["cell_type"] == "markdown"
            for link in LINK.findall("".join(cell["source"]))]


def test_every_chapter_has_a_title_summary_and_measured_run_time():
    found = chapters.read_chapters(NOTEBOOKS)
    assert [c.number for c in found] == [f"{n:02d}" for n in range(len(found))]
    for chapter in found:
        assert chapter.summary and "|" not in chapter.summary, chapter.name
        assert chapter.run_time_s is not None, (
            f"{chapter.name} has no measured run time: run `make notebooks "
            f"NOTEBOOKS=notebooks/{chapter.name}`")


def test_every_chapter_carries_its_current_navigation_line():
    found = chapters.read_chapters(NOTEBOOKS)
    for index, chapter in enumerate(found):
        first_cell = "".join(json.loads(chapter.path.read_text())["cells"][0]["source"])
        expected = chapters.navigation(found, index)
        assert expected in first_cell.split("\n"), (
            f"{chapter.name}: navigation out of date; run `make nav`")
        links = LINK.findall(expected)
        if index > 0:
            assert found[index - 1].name in links
        if index + 1 < len(found):
            assert found[index + 1].name in links
            # ...and the last cell sends the reader on, too.
            last = json.loads(chapter.path.read_text())["cells"][-1]
            assert f"({found[index + 1].name})" in "".join(last["source"]), chapter.name
        for module in chapters.helper_modules(chapter.path):
            assert f"../mgpu_helpers/{module}" in links


@pytest.mark.parametrize("path", chapters.chapter_paths(NOTEBOOKS), ids=lambda p: p.name[:2])
def test_relative_links_in_chapters_point_at_files(path):
    broken = []
    for link in markdown_links(path):
        if re.match(r"^[a-z]+:", link) or link.startswith("#"):
            continue  # web addresses and anchors within the page
        target = (path.parent / link.split("#")[0]).resolve()
        if not target.exists():
            broken.append(link)
    assert broken == [], f"{path.name} links to missing files"


def write_chapter(path: Path, heading: str, cells: list, summary: str | None = "A line",
                  run_time: float | None = None) -> Path:
    metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3",
                               "language": "python"}}
    info = {}
    if summary is not None:
        info["summary"] = summary
    if run_time is not None:
        info["run_time_s"] = run_time
        info["run_time_machine"] = "2 CPUs, x86_64, no GPU"
    metadata[chapters.METADATA_KEY] = info
    notebook = new_notebook(cells=[new_markdown_cell(heading), *cells], metadata=metadata)
    nbformat.write(notebook, path)
    return path


def test_helper_modules_follow_imports_and_aliases_across_cells(tmp_path):
    path = write_chapter(tmp_path / "00_x.ipynb", "# 00 · X", [
        new_code_cell("import mgpu_helpers as mh\nfrom mgpu_helpers.viz import plots\n"
                      "%matplotlib inline"),
        new_code_cell("from mgpu_helpers.data import ImageDataset\nmh.launch(print)"),
        new_code_cell("mh.rank()  # defined in ranks.py, re-exported by the package"),
    ])
    assert chapters.helper_modules(path) == ["data/image_folder.py", "launcher/api.py",
                                             "runtime/ranks.py", "viz/plots.py"]


def test_navigation_links_neighbours_and_helpers(tmp_path):
    for number, title, run_time in (("00", "Start: here", 36.4), ("01", "Middle", None),
                                    ("02", "End", None)):
        write_chapter(tmp_path / f"{number}_c.ipynb", f"# {number} · {title}",
                      [new_code_cell("from mgpu_helpers.training.seeding import seed_everything")],
                      run_time=run_time)
    found = chapters.read_chapters(tmp_path)
    assert chapters.navigation(found, 0) == (
        "**Navigate** · Next: [01 · Middle](01_c.ipynb) · Helpers used: "
        "[`training/seeding.py`](../mgpu_helpers/training/seeding.py) · Run time: 36 s on 2 CPUs, "
        "x86_64, no GPU"
        " · Terms: [glossary](../docs/glossary.md)")
    assert "Run time" not in chapters.navigation(found, 1)  # never measured: nothing claimed
    assert "Previous: [00 · Start](00_c.ipynb) · Next: [02 · End](02_c.ipynb)" in (
        chapters.navigation(found, 1))
    assert "Next:" not in chapters.navigation(found, 2)

    # update_navigation puts the line under the heading once, then replaces it in place.
    assert len(chapters.update_navigation(tmp_path)) == 3
    assert chapters.update_navigation(tmp_path) == []
    first = "".join(json.loads((tmp_path / "01_c.ipynb").read_text())["cells"][0]["source"])
    assert first.split("\n")[:3] == ["# 01 · Middle", "", chapters.navigation(found, 1)]


def last_cell(path) -> dict:
    return json.loads(path.read_text())["cells"][-1]


def test_make_nav_writes_the_closing_link_and_keeps_the_authors_words(tmp_path):
    ends = {"00": [new_code_cell("x = 1")],  # ends with code: a closing cell is added
            "01": [new_markdown_cell("Done.\n\nNext: [02 · Old title](02_old.ipynb): "
                                     "where the data goes.")],
            "02": [new_markdown_cell("Exercises.\n\nNext: [03 · Gone](03_gone.ipynb).")]}
    for number, title in (("00", "Start"), ("01", "Middle"), ("02", "End")):
        write_chapter(tmp_path / f"{number}_c.ipynb", f"# {number} · {title}", ends[number])
    chapters.update_navigation(tmp_path)
    added = last_cell(tmp_path / "00_c.ipynb")
    assert added["cell_type"] == "markdown"
    assert "".join(added["source"]) == "Next: [01 · Middle](01_c.ipynb)."
    assert "".join(last_cell(tmp_path / "01_c.ipynb")["source"]) == (
        "Done.\n\nNext: [02 · End](02_c.ipynb): where the data goes.")
    assert "".join(last_cell(tmp_path / "02_c.ipynb")["source"]) == "Exercises."  # last one
    assert chapters.update_navigation(tmp_path) == []  # nothing left to change


def test_read_chapter_names_what_is_missing(tmp_path):
    no_summary = write_chapter(tmp_path / "03_a.ipynb", "# 03 · A", [], summary=None)
    with pytest.raises(ValueError, match=r'metadata\["workbook"\]\["summary"\]'):
        chapters.read_chapter(no_summary)
    wrong_number = write_chapter(tmp_path / "04_b.ipynb", "# 05 · B", [])
    with pytest.raises(ValueError, match="heading says chapter 05, the file name says 04"):
        chapters.read_chapter(wrong_number)
    no_heading = write_chapter(tmp_path / "06_c.ipynb", "Some text", [])
    with pytest.raises(ValueError, match="must start with a heading '# 06 · Title'"):
        chapters.read_chapter(no_heading)


def test_landing_page_maps_chapters_and_shows_the_report(tmp_path):
    write_chapter(tmp_path / "00_a.ipynb", "# 00 · Alpha", [], summary="learn a", run_time=37.2)
    write_chapter(tmp_path / "01_b.ipynb", "# 01 · Beta", [], summary="learn b", run_time=150)
    write_chapter(tmp_path / "02_c.ipynb", "# 02 · Gamma", [], summary="learn c")
    out = chapters.write_landing(tmp_path, tmp_path / chapters.LANDING_NAME,
                                 report_text="Environment report\n  Workbook plan  test")
    notebook = nbformat.read(out, as_version=4)
    nbformat.validate(notebook)
    text = "\n".join(cell.source for cell in notebook.cells)
    assert "| 00 | [Alpha](00_a.ipynb) | learn a | 0 min | 37 s | not yet run on a GPU |" in text
    assert "| 01 | [Beta](01_b.ipynb) | learn b | 0 min | 2.5 min | not yet run on a GPU |" in text
    assert ("| 02 | [Gamma](02_c.ipynb) | learn c | 0 min | not measured yet (run `make "
            "notebooks`) | not yet run on a GPU |" in text)
    report = [c for c in notebook.cells if chapters.REPORT_TAG in c.metadata.get("tags", [])]
    assert len(report) == 1 and "Workbook plan  test" in report[0].outputs[0]["text"]
    assert "measured by `make notebooks` (a fresh kernel each, start-up included) on " \
        "2 CPUs, x86_64, no GPU." in text
    assert not list(tmp_path.glob(".*.tmp")), "the page is written atomically"


def test_landing_page_gives_each_part_its_reading_time_and_states_the_rule(tmp_path):
    def prose():  # 30 minutes of it
        return new_markdown_cell(" ".join(["word"] * chapters.PROSE_WORDS_PER_MINUTE * 30))

    code = new_code_cell("\n\n".join(["x = 1"] * chapters.CODE_LINES_PER_MINUTE * 10))
    write_chapter(tmp_path / "00_a.ipynb", "# 00 · Alpha", [prose(), code], summary="a")
    write_chapter(tmp_path / "06_b.ipynb", "# 06 · Beta", [prose()], summary="b")
    write_chapter(tmp_path / "07_c.ipynb", "# 07 · Gamma", [prose(), prose(), prose()],
                  summary="c")
    found = chapters.read_chapters(tmp_path)
    # the heading and the navigation-free first cell add a few words: 30 + 10 minutes
    assert [round(c.reading_minutes) for c in found] == [40, 30, 90]
    text = chapters.chapter_map(found)
    assert f"| | **{chapters.PARTS['00']}** | | **40 min** | | |" in text
    assert f"| | **{chapters.PARTS['06']}** | | **2.0 h** | | |" in text
    assert "| 07 | [Gamma](07_c.ipynb) | c | 1.5 h |" in text
    assert text.endswith(f"Reading times are estimates: {chapters.READING_RULE}.")


def test_landing_page_links_the_appendices_and_refuses_an_untitled_one(tmp_path):
    write_chapter(tmp_path / "00_a.ipynb", "# 00 · Alpha", [], summary="learn a")
    write_chapter(tmp_path / "appendix_tips.ipynb", "# Appendix · Field tips", [])
    text = chapters.write_landing(tmp_path, tmp_path / chapters.LANDING_NAME,
                                  report_text="r").read_text()
    assert "Appendix: [Field tips](appendix_tips.ipynb)" in text
    write_chapter(tmp_path / "appendix_zz.ipynb", "Tips", [])
    with pytest.raises(ValueError, match="appendix_zz.ipynb: the first cell must start"):
        chapters.write_landing(tmp_path, tmp_path / chapters.LANDING_NAME, report_text="r")


def test_landing_page_counts_the_exercises_passed_per_chapter(tmp_path):
    write_chapter(tmp_path / "00_a.ipynb", "# 00 · Alpha", [], summary="learn a")
    write_chapter(tmp_path / "01_b.ipynb", "# 01 · Beta", [], summary="learn b")
    out = chapters.write_landing(tmp_path, tmp_path / chapters.LANDING_NAME, report_text="r",
                                 progress={"01": (1, 3), "07": (0, 2)})
    text = out.read_text()
    assert "| 01 | [Beta](01_b.ipynb#Exercises) | 1 of 3 |" in text
    assert "| 00 |" not in text.split("## Exercises")[1]  # no exercises, no row
    assert "07" not in text.split("## Exercises")[1]      # no such chapter here


@pytest.mark.slow
def test_execute_stores_outputs_and_run_time_and_keeps_a_failing_notebook(tmp_path):
    bar = ("import sys\nprint(6 * 7, flush=True)\n"
           "for k in range(1, 4):  # a progress bar's redraws, as the launcher relays them\n"
           "    print(f'[rank 0] {k}/3', end='\\r', flush=True)\nprint('[rank 0] done')")
    good = write_chapter(tmp_path / "00_ok.ipynb", "# 00 · Ok", [new_code_cell(bar)])
    times = chapters.execute([good])
    stored = json.loads(good.read_text())
    # the stream stored once, the bar as its last state: not one line per redraw
    assert len(stored["cells"][1]["outputs"]) == 1
    assert "".join(stored["cells"][1]["outputs"][0]["text"]) == "42\n[rank 0] done\n"
    assert stored["metadata"]["workbook"]["run_time_s"] == round(times["00_ok.ipynb"], 1) > 0
    assert stored["metadata"]["workbook"]["summary"] == "A line"  # the rest is kept
    assert re.fullmatch(r"\d+ CPUs, \w+, (no GPU|\d+ GPUs?)",
                        stored["metadata"]["workbook"]["run_time_machine"])

    bad = write_chapter(tmp_path / "01_bad.ipynb", "# 01 · Bad",
                        [new_code_cell("raise ValueError('broken on purpose')")])
    before = bad.read_bytes()
    with pytest.raises(Exception, match="broken on purpose"):
        chapters.execute([bad])
    assert bad.read_bytes() == before


def test_command_line_rejects_a_missing_notebook(capsys):
    with pytest.raises(SystemExit) as stopped:
        chapters.main(["execute", "notebooks/99_missing.ipynb"])
    assert stopped.value.code == 2
    assert "no such notebook: notebooks/99_missing.ipynb" in capsys.readouterr().err


def gpu_report(passed: dict[str, bool], gpus=("NVIDIA H200",), backend="cpu:gloo,cuda:nccl"):
    return {"machine": {"gpus": list(gpus), "backend": backend, "torch": "2.11.0+cu130"},
            "date": "2026-12-03",
            "results": [{"name": name, "passed": ok} for name, ok in passed.items()]}


def test_a_gpu_check_is_recorded_per_chapter_and_shown_on_the_landing_page(tmp_path):
    write_chapter(tmp_path / "00_a.ipynb", "# 00 · Alpha", [], summary="learn a", run_time=3)
    write_chapter(tmp_path / "01_b.ipynb", "# 01 · Beta", [], summary="learn b", run_time=3)
    changed = chapters.record_gpu_check(tmp_path, gpu_report({"00_a": True, "01_b": False,
                                                              "torchrun x": True}))
    assert [p.name for p in changed] == ["00_a.ipynb", "01_b.ipynb"]
    found = {c.number: chapters.gpu_status(c) for c in chapters.read_chapters(tmp_path)}
    one_gpu = "; cells for 2 or more GPUs not run"
    assert found == {
        "00": "passed on 1x NVIDIA H200 (PyTorch 2.11.0+cu130), 2026-12-03" + one_gpu,
        "01": "FAILED on 1x NVIDIA H200 (PyTorch 2.11.0+cu130), 2026-12-03" + one_gpu}
    out = chapters.write_landing(tmp_path, tmp_path / chapters.LANDING_NAME, report_text="r")
    assert f"| passed on 1x NVIDIA H200 (PyTorch 2.11.0+cu130), 2026-12-03{one_gpu} |" in \
        out.read_text()
    chapters.record_gpu_check(tmp_path, gpu_report({"00_a": True}, gpus=("A100",) * 8))
    assert chapters.gpu_status(chapters.read_chapter(tmp_path / "00_a.ipynb")) == \
        "passed on 8x A100 (PyTorch 2.11.0+cu130), 2026-12-03"


def test_a_report_without_gpus_is_not_a_gpu_verdict(tmp_path):
    write_chapter(tmp_path / "00_a.ipynb", "# 00 · Alpha", [], summary="learn a", run_time=3)
    with pytest.raises(ValueError, match="run without GPUs"):
        chapters.record_gpu_check(tmp_path, gpu_report({"00_a": True}, gpus=(),
                                                       backend="gloo"))
    assert chapters.gpu_status(chapters.read_chapter(tmp_path / "00_a.ipynb")) == \
        chapters.NOT_RUN_ON_GPU


def test_readme_states_each_chapters_gpu_path_as_recorded():
    readme = (ROOT / "README.md").read_text()
    for chapter in chapters.read_chapters(NOTEBOOKS):
        row = re.search(rf"^\| {chapter.number} \| `{chapter.path.stem}` \|.*\| ([^|]+) \|$",
                        readme, re.MULTILINE)
        assert row, f"README's chapter table has no row for {chapter.path.stem}"
        assert row.group(1) == chapters.gpu_status(chapter), (
            f"README says {row.group(1)!r} for chapter {chapter.number}; its last recorded "
            f"GPU check says {chapters.gpu_status(chapter)!r}")


@pytest.mark.parametrize("path", [*sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")),
                                  *sorted(NOTEBOOKS.glob("appendix_*.ipynb"))],
                         ids=lambda p: p.stem)
def test_every_code_cell_is_plain_python_as_gpu_check_runs_it(path):
    # `make gpu-check` (tools/gpu_check.py) executes each code cell with exec(), outside
    # IPython: a magic (%time, !pip) or other IPython-only syntax would pass nbval and fail
    # there, on the GPU node. Its runner is tested on small notebooks in test_gpu_check.py.
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] == "code":
            source = "".join(cell["source"])
            try:
                compile(source, f"{path.stem} cell {index}", "exec")
            except SyntaxError as error:
                pytest.fail(f"{path.name} cell {index} is not plain Python: {error}")


def test_at_least_80_percent_of_code_cells_have_compared_outputs():
    # tools/compared_share.py, as the README quotes it: a cell tagged nbval-ignore-output
    # or nbval-skip is run but not compared; machine-dependent cells are the only ones.
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "compared_share.py"),
                           "--min", "0.8"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_nbval_runs_each_notebook_on_the_kernels_its_metadata_names(tmp_path, capsys):
    # The flag, read: "best" where unset, an unknown value refused with the fix
    flagged = {}
    for kind in (None, "generic", "best", "fast"):
        notebook = new_notebook(cells=[new_markdown_cell("# 01 · A")])
        if kind:
            notebook.metadata[chapters.METADATA_KEY] = {"nbval_kernels": kind}
        flagged[kind] = tmp_path / f"{kind}.ipynb"
        nbformat.write(notebook, flagged[kind])
    assert [chapters.nbval_kernels(flagged[k]) for k in (None, "generic", "best")] == \
        ["best", "generic", "best"]
    with pytest.raises(ValueError, match=r"nbval_kernels.*'fast'; use one of 'best', 'generic'"):
        chapters.nbval_kernels(flagged["fast"])
    assert chapters.main(["kernels", "generic", *map(str, flagged.values())]) == 2
    assert "'fast'" in capsys.readouterr().err
    # ... and followed by `make nbval`: the flagged notebooks, and they alone, on the
    # generic kernels; the others on this CPU's best, each notebook run once
    dry = subprocess.run(["make", "-n", "--no-print-directory", "nbval"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    runs = [line for line in dry.splitlines() if "--nbval" in line]
    assert len(runs) == 2, dry
    generic = [run for run in runs if "ATEN_CPU_CAPABILITY=default" in run]
    assert len(generic) == 1, runs

    def notebooks_in(command):
        return sorted(re.findall(r"notebooks/\S+\.ipynb", command))

    every = sorted(str(p.relative_to(ROOT)) for p in NOTEBOOKS.glob("*.ipynb")
                   if p.name != chapters.LANDING_NAME)  # the landing page is browser-tested
    expected = [p for p in every if chapters.nbval_kernels(ROOT / p) == "generic"]
    assert notebooks_in(generic[0]) == expected
    assert sorted(notebooks_in(runs[0]) + notebooks_in(runs[1])) == every
    assert "notebooks/06_model_parallel_and_pipelining.ipynb" not in expected
