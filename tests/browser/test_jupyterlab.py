"""The workbook as readers use it: JupyterLab in a real Chromium, driven by Playwright.

One JupyterLab server (free 127.0.0.1 port, random token) serves copies of every chapter
and the landing page; one headless Chromium opens chapters 01 and 05 (05 up to its
broadcast check, nbval running the rest; under `make screenshots`, 05 up to its training
run and plot, and 00 too), clears
their stored outputs, runs every cell from the Run menu, saves them, and checks what a
reader would see: no error output (beyond cells tagged ``raises-exception``), every plot
drawn as a decoded image, the augmentation explorer's sliders redrawing the picture,
launched ranks' ``[rank k]`` lines in the cell. A screenshot of each chapter is saved to
``$BROWSER_ARTIFACTS`` (default ``runs/browser/``).

Needs Chromium (Debian's ``chromium`` package, or ``$MGPU_CHROMIUM``); without it the
test is skipped with a message saying so, or fails when ``MGPU_REQUIRE_BROWSER=1``
(CI sets it, having installed Chromium).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from pathlib import Path

import chapters  # tools/chapters.py (pytest's pythonpath)
import pytest
from lab_session import ROOT, LabServer, chromium_page, find_chromium, prepare_workdir

from mgpu_helpers import exercises as mh_exercises

ALL_CHAPTERS = sorted(path.name for path in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CHAPTERS = ["00_environment.ipynb", "01_datasets_and_augmentation.ipynb",
            "05_distributed_data_parallel.ipynb"]  # run in the browser
RUN_TIMEOUT_S = 600  # generous: a browser and a kernel share 2 cores
# `make screenshots` (MGPU_BROWSER_ALL=1) runs more of the chapters, for the README's
# pictures; `make test` what only a browser checks.
ALL = os.environ.get("MGPU_BROWSER_ALL") == "1"
# Chapter 05 in the browser: its cells up to the broadcast check (launched ranks' lines in
# a cell, a plot); with ALL, up to the plot of the training run, whose screenshot is the
# README's. nbval runs the whole chapter and compares the training's rank-0 lines;
# tests/workbook/test_notebook_harness.py checks a forked rank's progress bar reaches the
# kernel's output.
CHAPTER_05_LAST_CELL = ("history = result[\"history\"]" if ALL
                        else "import hashlib\n\n\ndef fingerprints")
ARTIFACTS = Path(os.environ.get("BROWSER_ARTIFACTS", ROOT / "runs" / "browser"))

def _missing() -> str | None:
    """Why the browser test cannot run here, or None."""
    if find_chromium() is None:
        return ("Chromium not found, so JupyterLab was not tested in a browser: install "
                "Debian's 'chromium' package (sudo apt-get install chromium) or set "
                "MGPU_CHROMIUM to a Chromium binary")
    if importlib.util.find_spec("playwright") is None:
        return "the 'playwright' package is not installed: pip install -e '.[test]'"
    return None


MISSING = _missing()
if MISSING and os.environ.get("MGPU_REQUIRE_BROWSER") == "1":
    pytest.fail(MISSING + " (MGPU_REQUIRE_BROWSER=1 makes this an error)", pytrace=False)
# Skipped tests, not a skipped module: pytest would call a run with nothing collected a
# failure (exit status 5).
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
CHROMIUM = find_chromium()

# Poll on a timer: a headless page's animation frames can stall while the kernel works.
POLL_MS = 500
# The kernel as the status bar shows it ("Python 3 (ipykernel) | Idle"): connected and
# idle. The notebook toolbar's indicator reads "idle" before the kernel has connected,
# and cells run before then are silently skipped.
KERNEL_IDLE = """() => [...document.querySelectorAll('.jp-StatusBar-TextItem')]
    .some(item => /\\|\\s*Idle\\s*$/.test(item.textContent))"""
# Where Run All has got to: prompts numbered, waiting ([*]), and all code cells.
RUN_STATE = """() => {
    const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]
        .map(p => p.textContent);
    return {total: prompts.length,
            numbered: prompts.filter(t => /\\[\\d+\\]/.test(t)).length,
            waiting: prompts.filter(t => t.includes('*')).length,
            idle: (KERNEL_IDLE)()};
}""".replace("(KERNEL_IDLE)", "(" + KERNEL_IDLE + ")")
SETTLED_POLLS = 6  # kernel idle, nothing waiting, for 3 s: Run All has finished or stopped


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    workdir = prepare_workdir(tmp_path_factory.mktemp("browser") / "workbook", ALL_CHAPTERS)
    shorten(workdir / "notebooks" / CHAPTERS[2], CHAPTER_05_LAST_CELL)
    chapters.write_landing(workdir / "notebooks", workdir / "notebooks" / chapters.LANDING_NAME)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    server = LabServer(workdir, workdir / "jupyterlab.log")  # kept with pytest's tmp dirs
    with server, chromium_page(CHROMIUM) as page:
        page.set_default_timeout(60_000)
        yield server, page
        kernels = server.kernel_pids()
    assert server.process.poll() is not None, "the JupyterLab server is still running"
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in kernels) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [pid for pid in kernels if Path(f"/proc/{pid}").exists()], "kernels left running"


def shorten(path: Path, last_cell: str) -> None:
    """Keep the notebook's cells up to the code cell that starts with ``last_cell``, and
    end with the chapter's cell that removes its temporary folder."""
    notebook = json.loads(path.read_text())
    sources = ["".join(cell["source"]) for cell in notebook["cells"]]
    end = next(i for i, source in enumerate(sources) if source.startswith(last_cell))
    cleanup = next((cell for cell in notebook["cells"][::-1] if cell["cell_type"] == "code"
                    and "rmtree(workdir)" in "".join(cell["source"])), None)
    assert cleanup is not None, "chapter 05 no longer removes its temporary folder"
    notebook["cells"] = notebook["cells"][:end + 1] + [cleanup]
    path.write_text(json.dumps(notebook))


def menu(page, top: str, item: str) -> None:
    """Click a JupyterLab menu entry, e.g. ``menu(page, "Run", "Run All Cells")``."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{re.escape(top)}$")).click()
    page.locator(".lm-Menu-itemLabel",
                 has_text=re.compile(f"^{re.escape(item)}$")).first.click()


def open_notebook(server: LabServer, page, relative: str) -> None:
    # `reset` starts from an empty workspace, so only this notebook is open.
    page.goto(server.url(f"/lab/tree/{relative}") + "&reset")
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    page.wait_for_function(KERNEL_IDLE, polling=POLL_MS)


def wait_for_run_all(server: LabServer, page, relative: str) -> None:
    """Return once every code cell has run; fail fast, naming the cell, if Run All stops."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    settled = 0
    while True:
        state = page.evaluate(RUN_STATE)
        if state["idle"] and state["waiting"] == 0 and state["total"] > 0:
            if state["numbered"] == state["total"]:
                return
            settled += 1
        else:
            settled = 0
        if settled >= SETTLED_POLLS or time.monotonic() > deadline:
            break
        time.sleep(POLL_MS / 1000)
    screenshot(page, f"FAILED-{Path(relative).name}")
    if settled < SETTLED_POLLS:
        pytest.fail(f"{relative}: Run All had not finished after {RUN_TIMEOUT_S} s "
                    f"({state['numbered']} of {state['total']} code cells run)")
    menu(page, "File", "Save Notebook")  # keep what ran, to name the failing cell
    page.wait_for_selector(".lm-TabBar-tab.jp-mod-current:not(.jp-mod-dirty)")
    errors = [f"cell {index}: {o['ename']}: {o['evalue']}"
              for index, cell in enumerate(server.saved_notebook(relative)["cells"])
              if cell["cell_type"] == "code"
              for o in cell.get("outputs", []) if o["output_type"] == "error"]
    pytest.fail(f"{relative}: Run All stopped with {state['numbered']} of {state['total']} "
                "code cells run; " + ("; ".join(errors) if errors else
                                      "no cell raised (was the kernel connected?)"))


def run_all_and_save(server: LabServer, page, relative: str) -> dict:
    """Clear outputs, run every cell from the Run menu, save; the notebook as saved."""
    open_notebook(server, page, relative)
    menu(page, "Edit", "Clear Outputs of All Cells")
    page.wait_for_function("() => document.querySelectorAll('.jp-OutputArea-output')"
                           ".length === 0", polling=POLL_MS)
    menu(page, "Run", "Run All Cells")
    wait_for_run_all(server, page, relative)
    before = server.modified(relative)
    menu(page, "File", "Save Notebook")
    # Read the file only once JupyterLab says the save is done: reading a notebook while
    # the server writes it makes the server restore the previous version.
    page.wait_for_selector(".lm-TabBar-tab.jp-mod-current:not(.jp-mod-dirty)")
    deadline = time.monotonic() + 60
    while server.modified(relative) == before:
        if time.monotonic() > deadline:
            pytest.fail(f"{relative}: JupyterLab did not save the notebook within 60 s")
        time.sleep(0.5)
    saved = server.saved_notebook(relative)
    counts = [c["execution_count"] for c in saved["cells"] if c["cell_type"] == "code"]
    assert counts == list(range(1, len(counts) + 1)), (
        f"{relative}: the saved notebook is not one run of every cell in order: {counts}")
    return saved


def check_no_errors(saved: dict, name: str) -> None:
    for index, cell in enumerate(saved["cells"]):
        if cell["cell_type"] != "code":
            continue
        errors = [o for o in cell["outputs"] if o["output_type"] == "error"]
        expected = "raises-exception" in cell["metadata"].get("tags", [])
        shown = "; ".join(f"{o['ename']}: {o['evalue']}" for o in errors)
        assert bool(errors) == expected, (
            f"{name} cell {index}: " + (f"error output {shown}" if errors
                                         else "tagged raises-exception but raised nothing"))


def check_images(page, saved: dict, name: str) -> int:
    """Every image/png output in the saved notebook is drawn, decoded, in the page."""
    stored = sum("image/png" in o.get("data", {}) for c in saved["cells"]
                 if c["cell_type"] == "code" for o in c["outputs"])
    drawn = page.eval_on_selector_all(
        ".jp-OutputArea-output img",
        "images => images.map(i => i.complete && i.naturalWidth > 0)")
    assert stored > 0, f"{name} produced no plot"
    assert len(drawn) >= stored and all(drawn), (
        f"{name}: {stored} plots in the notebook, {sum(drawn)} of {len(drawn)} images "
        "decoded in the page")
    return stored


def screenshot(page, name: str, focus=None) -> Path:
    if focus is not None:
        focus.scroll_into_view_if_needed()
    path = ARTIFACTS / f"{Path(name).stem}.png"
    page.screenshot(path=path)
    assert path.stat().st_size > 10_000, f"{path} looks empty"
    return path


def output_of(page, text: str):
    """The output area of the code cell whose input contains ``text``."""
    cell = page.locator(".jp-CodeCell", has=page.locator(".jp-InputArea", has_text=text))
    return cell.first.locator(".jp-OutputArea")


# Chapter 00 adds nothing the others do not check in a browser (its plots are drawn like
# chapter 01's; its environment report is the landing page's) and takes ~50 s: it runs
# for its README screenshot, under `make screenshots`, which sets MGPU_BROWSER_ALL=1.
@pytest.mark.skipif(not ALL,
                    reason="chapter 00 runs in the browser under `make screenshots` only "
                           "(MGPU_BROWSER_ALL=1); nbval runs it in make test")
def test_chapter_00_runs(lab):
    server, page = lab
    saved = run_all_and_save(server, page, f"notebooks/{CHAPTERS[0]}")
    check_no_errors(saved, CHAPTERS[0])
    check_images(page, saved, CHAPTERS[0])
    report = page.locator(".jp-OutputArea-output", has_text="Environment report").first
    assert "Workbook plan" in report.inner_text()
    screenshot(page, CHAPTERS[0], page.locator(".jp-OutputArea-output img").first)


def test_chapter_01_runs_and_its_explorer_redraws(lab):
    server, page = lab
    saved = run_all_and_save(server, page, f"notebooks/{CHAPTERS[1]}")
    check_no_errors(saved, CHAPTERS[1])
    check_images(page, saved, CHAPTERS[1])

    explorer = page.locator(".widget-interact").first
    explorer.scroll_into_view_if_needed()
    sliders = explorer.locator(".widget-hslider")
    assert sliders.count() == 5, "the explorer should show 5 sliders"
    assert explorer.locator(".widget-checkbox").count() == 1
    picture = explorer.locator(".widget-output img")
    page.wait_for_function("e => e.complete && e.naturalWidth > 0",
                           arg=picture.element_handle(), polling=POLL_MS)
    before = picture.get_attribute("src")
    rotation = sliders.first
    readout = rotation.locator(".widget-readout")
    assert readout.inner_text().strip() in ("0", "0.0", "0.00")
    rotation.locator(".noUi-handle").focus()
    for _ in range(9):  # 5 degrees a step: 45 degrees
        page.keyboard.press("ArrowRight")
    page.wait_for_function(
        "([e, old]) => e.querySelector('img') && e.querySelector('img').src !== old",
        arg=[explorer.locator(".widget-output").element_handle(), before], polling=POLL_MS)
    assert float(readout.inner_text()) == 45.0
    screenshot(page, CHAPTERS[1], explorer)


def test_chapter_05_trains_with_rank_output(lab):
    server, page = lab
    saved = run_all_and_save(server, page, f"notebooks/{CHAPTERS[2]}")
    check_no_errors(saved, CHAPTERS[2])
    check_images(page, saved, CHAPTERS[2])
    # The broadcast check's verdict, printed by the notebook from the ranks' returns;
    # rank 0 reports (and shows a bar) in training, its lines prefixed by the launcher.
    broadcast = output_of(page, "def weights_before_and_after_ddp").inner_text()
    assert "rank 1: 0 of 8 tensors equal to rank 0's initial ones before DDP, 8 of 8 after" \
        in broadcast, broadcast
    if not ALL:
        screenshot(page, CHAPTERS[2], output_of(page, "def weights_before_and_after_ddp"))
        return
    training = output_of(page, "mh.launch(train_digits, run")
    assert re.search(r"\[rank 0\] epoch 3: train loss .* test accuracy", training.inner_text())
    screenshot(page, CHAPTERS[2], training)


def test_landing_page_links_every_chapter(lab):
    server, page = lab
    open_notebook(server, page, f"notebooks/{chapters.LANDING_NAME}")
    page.wait_for_selector(".jp-RenderedMarkdown table a")
    links = page.eval_on_selector_all(".jp-RenderedMarkdown a",
                                      "anchors => anchors.map(a => a.getAttribute('href'))")
    # JupyterLab rewrites relative links into its own URLs; the file name stays last.
    linked = [name for link in links for name in ALL_CHAPTERS
              if link.split("?")[0].endswith(name)]
    assert linked[:len(ALL_CHAPTERS)] == ALL_CHAPTERS, links  # the chapter map
    # then the exercise table: each chapter with exercises, at its "Exercises" heading
    exercise_links = [link for link in links if ".ipynb" in link and link.endswith("#Exercises")]
    with_exercises = sorted({key[:2] for key in mh_exercises.registry()})
    assert linked[len(ALL_CHAPTERS):] == [name for name in ALL_CHAPTERS
                                           if name[:2] in with_exercises], links
    assert len(exercise_links) == len(with_exercises), links
    report = page.locator(".jp-OutputArea-output", has_text="Environment report")
    assert "Workbook plan" in report.inner_text()
    screenshot(page, chapters.LANDING_NAME)
    # A link opens the chapter in JupyterLab (the first: the chapter map's).
    page.locator(".jp-RenderedMarkdown a", has_text=re.compile("^Datasets and")).first.click()
    page.wait_for_selector(".lm-TabBar-tab.jp-mod-current >> text=01_datasets")
