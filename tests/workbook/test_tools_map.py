"""docs/tools_map.md (how Accelerate, Lightning and torchtitan map onto the chapters' calls):
its chapter links lead to notebooks that exist, its citations and its numbered source list
match one to one, it names the three tools, and it stays within its length."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "tools_map.md"
SOURCES_HEADING = "## Sources"
MAX_WORDS = 1500  # the page, without its source list

LINK = re.compile(r"\]\(([^)\s]+)\)")
CITATION = re.compile(r"\[(\d+(?:,\s*\d+)*)\](?!\()")
SOURCE_ENTRY = re.compile(r"^(\d+)\. \S", re.MULTILINE)


def split_page() -> tuple[str, str]:
    text = PAGE.read_text(encoding="utf-8")
    assert text.count(SOURCES_HEADING) == 1, f"{PAGE.name} needs one '{SOURCES_HEADING}' section"
    body, sources = text.split(SOURCES_HEADING)
    return body, sources


def notebook_links(body: str) -> list[str]:
    return [target for target in LINK.findall(body) if ".ipynb" in target]


def cited_numbers(body: str) -> set[int]:
    return {int(n) for group in CITATION.findall(body) for n in group.split(",")}


def test_every_chapter_link_points_at_an_existing_notebook():
    body, _ = split_page()
    links = notebook_links(body)
    assert len(links) >= 10, "the page should link the chapters that teach each call"
    missing = []
    for target in links:
        path = (PAGE.parent / target.split("#")[0]).resolve()
        if path.parent != (ROOT / "notebooks").resolve() or not path.is_file():
            missing.append(target)
    assert not missing, f"links to notebooks that do not exist: {missing}"


def test_links_cover_the_chapters_the_tools_replace():
    body, _ = split_page()
    linked = {Path(target.split("#")[0]).name[:2] for target in notebook_links(body)}
    assert {"02", "05", "07", "10"} <= linked, f"chapters linked: {sorted(linked)}"


def test_citations_and_sources_match_one_to_one():
    body, sources = split_page()
    entries = [int(n) for n in SOURCE_ENTRY.findall(sources)]
    assert entries == list(range(1, len(entries) + 1)), f"sources not numbered 1..n: {entries}"
    cited = cited_numbers(body)
    assert cited, "the page cites no source"
    assert cited - set(entries) == set(), f"cited without a source entry: {cited - set(entries)}"
    assert set(entries) - cited == set(), f"sources never cited: {set(entries) - cited}"


def test_every_source_has_an_address():
    _, sources = split_page()
    lines = [line for line in sources.splitlines() if SOURCE_ENTRY.match(line)]
    without = [line for line in lines if "https://" not in line]
    assert not without, f"source entries without a URL: {without}"


def test_the_page_names_each_tool():
    body, _ = split_page()
    for tool in ("Accelerate", "Lightning", "Fabric", "torchtitan"):
        assert tool in body, f"the page does not name {tool}"


def test_the_page_stays_within_its_length():
    body, _ = split_page()
    words = [token for token in body.split() if re.search(r"[A-Za-z0-9]", token)]
    assert len(words) <= MAX_WORDS, f"{len(words)} words, more than {MAX_WORDS}"
