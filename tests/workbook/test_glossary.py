"""docs/glossary.md: every required term has an entry, entries are short and in order, and
every link leads somewhere that exists.

Links into a notebook may name a section: `05_distributed_data_parallel.ipynb#1.-The-recipe`.
JupyterLab 4 gives each rendered Markdown heading the id `textContent.replace(/ /g, "-")`
(`createHeaderId` in @jupyterlab/rendermime), and nbconvert's HTML export the same text with
spaces as "-", then URL-quoted (`_convert_header_id` in nbconvert.filters.strings). So a
fragment is a heading's rendered text (code spans, emphasis and links reduced to their text)
with every space replaced by "-". Fragments are also required to need no quoting (no
non-ASCII character, no space), so that the one link works in both.
"""

import html
import json
import re
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

ROOT = Path(__file__).resolve().parents[2]
GLOSSARY = ROOT / "docs" / "glossary.md"
MAX_WORDS = 80

# The terms the glossary must define (issue 33), by anchor id, with a word the entry's bold
# title must contain.
REQUIRED = {
    "term-rank": "rank",
    "term-world-size": "world size",
    "term-local-rank": "local rank",
    "term-node": "node",
    "term-process-group": "process group",
    "term-backend": "backend",
    "term-gloo": "gloo",
    "term-nccl": "nccl",
    "term-rendezvous": "rendezvous",
    "term-store": "store",
    "term-launcher": "launcher",
    "term-torchrun": "torchrun",
    "term-mh-launch": "mh.launch",
    "term-srun": "srun",
    "term-collective": "collective",
    "term-broadcast": "broadcast",
    "term-all-reduce": "all-reduce",
    "term-reduce-scatter": "reduce-scatter",
    "term-all-gather": "all-gather",
    "term-all-to-all": "all-to-all",
    "term-point-to-point": "point-to-point",
    "term-ring": "ring",
    "term-bucket": "bucket",
    "term-gradient-accumulation": "gradient accumulation",
    "term-micro-batch": "micro-batch",
    "term-global-batch": "global batch",
    "term-dataparallel": "dataparallel",
    "term-ddp": "ddp",
    "term-fsdp": "fsdp",
    "term-fsdp1": "fsdp1",
    "term-fsdp2": "fsdp2",
    "term-zero-1": "zero-1",
    "term-zero-2": "zero-2",
    "term-zero-3": "zero-3",
    "term-psi": "ψ",
    "term-shard": "shard",
    "term-dtensor": "dtensor",
    "term-placement": "placement",
    "term-shard-placement": "shard(dim)",
    "term-replicate": "replicate",
    "term-partial": "partial",
    "term-device-mesh": "device mesh",
    "term-tensor-parallelism": "tensor parallelism",
    "term-sequence-parallelism": "sequence parallelism",
    "term-pipeline-parallelism": "pipeline parallelism",
    "term-stage": "stage",
    "term-bubble": "bubble",
    "term-1f1b": "1f1b",
    "term-activation-checkpointing": "activation checkpointing",
    "term-mixed-precision": "mixed precision",
    "term-autocast": "autocast",
    "term-gradscaler": "gradscaler",
    "term-bfloat16": "bfloat16",
    "term-dcp": "dcp",
    "term-mfu": "mfu",
    "term-nccl-channel": "nccl channel",
    "term-straggler": "straggler",
    "term-hang": "hang",
    "term-timeout": "timeout",
    "term-flight-recorder": "flight recorder",
}

# Terms no chapter teaches yet: their entry says so and links documentation instead.
NOT_IN_A_CHAPTER = {"term-fsdp1"}

ANCHOR = re.compile(r'<a id="([^"]+)"></a>')
# [text](target), where target may hold one level of balanced parentheses
LINK = re.compile(r"\[([^\]]*)\]\(((?:[^()\s]|\([^()\s]*\))+)\)")


def glossary_text() -> str:
    return GLOSSARY.read_text(encoding="utf-8")


def entries(text: str) -> dict[str, str]:
    """Anchor id -> the entry's Markdown: from its anchor to the next anchor or heading."""
    found = {}
    lines = text.splitlines()
    current = None
    for line in lines:
        anchor = ANCHOR.fullmatch(line.strip())
        if anchor:
            current = anchor.group(1)
            found[current] = ""
        elif line.startswith("#"):
            current = None
        elif current is not None:
            found[current] += line + "\n"
    return found


def visible_words(markdown: str) -> list[str]:
    """The words a reader sees: link targets and HTML tags dropped, link texts kept."""
    text = LINK.sub(lambda m: m.group(1), markdown)
    text = re.sub(r"<[^>]+>", " ", text)
    return [w for w in text.split() if re.search(r"\w", w)]


def inline_text(markdown: str) -> str:
    """What a heading's Markdown renders to as text: code spans, emphasis, links and HTML
    reduced to their text."""
    parts = re.split(r"(`+)(.+?)\1", markdown)
    out = []
    for i in range(0, len(parts), 3):
        chunk = parts[i]
        chunk = LINK.sub(lambda m: m.group(1), chunk)
        chunk = re.sub(r"<[^>]+>", "", chunk)
        chunk = re.sub(r"(\*{1,3})([^*\s](?:[^*]*?[^*\s])?)\1", r"\2", chunk)
        chunk = re.sub(r"(?<!\w)(_{1,3})([^_\s](?:[^_]*?[^_\s])?)\1(?!\w)", r"\2", chunk)
        out.append(html.unescape(chunk))
        if i + 2 < len(parts):
            out.append(parts[i + 2].strip() if parts[i + 2].strip() else parts[i + 2])
    return "".join(out)


def heading_sources(notebook: Path) -> list[str]:
    """The Markdown of every ATX heading in a notebook's Markdown cells, outside fences."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    headings = []
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        source = "".join(cell["source"])
        fence = None
        for line in source.splitlines():
            opening = re.match(r" {0,3}(`{3,}|~{3,})", line)
            if opening:
                marker = opening.group(1)
                if fence is None:
                    fence = marker
                elif marker[0] == fence[0] and len(marker) >= len(fence):
                    fence = None
                continue
            if fence is not None:
                continue
            match = re.match(r" {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", line)
            if match:
                headings.append(match.group(1))
    return headings


def heading_anchor(markdown: str) -> str:
    return inline_text(markdown).replace(" ", "-")


_anchor_cache: dict[Path, list[str]] = {}


def notebook_anchors(notebook: Path) -> list[str]:
    if notebook not in _anchor_cache:
        _anchor_cache[notebook] = [heading_anchor(h) for h in heading_sources(notebook)]
    return _anchor_cache[notebook]


def links(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in LINK.finditer(text)]


def index_section(text: str) -> str:
    start = text.index("## By topic")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def test_every_required_term_has_an_entry():
    found = entries(glossary_text())
    missing = sorted(set(REQUIRED) - set(found))
    assert not missing, f"glossary entries missing for: {missing}"
    for anchor, word in REQUIRED.items():
        title = re.search(r"\*\*(.+?)\*\*", found[anchor])
        assert title, f"{anchor}: the entry does not start its text with a **bold** term"
        assert word in title.group(1).replace("`", "").lower(), (
            f"{anchor}: its bold title {title.group(1)!r} does not name {word!r}")


def test_anchor_ids_are_unique_and_well_formed():
    ids = ANCHOR.findall(glossary_text())
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    assert not duplicates, f"anchor ids used twice: {duplicates}"
    malformed = [i for i in ids if not re.fullmatch(r"term-[a-z0-9]+(-[a-z0-9]+)*", i)]
    assert not malformed, f"anchor ids not of the form term-word-word: {malformed}"


def test_entries_are_short():
    long_ones = {a: len(visible_words(e)) for a, e in entries(glossary_text()).items()
                 if len(visible_words(e)) > MAX_WORDS}
    assert not long_ones, f"entries over {MAX_WORDS} words: {long_ones}"


def sort_key(anchor: str) -> str:
    return anchor.removeprefix("term-").replace("-", "")


def test_entries_are_alphabetical_under_their_letter():
    text = glossary_text()
    order = ANCHOR.findall(text)
    assert order == sorted(order, key=sort_key), "entries are not in alphabetical order"
    letter = None
    for line in text[text.index("\n## ", text.index("## By topic") + 1):].splitlines():
        heading = re.fullmatch(r"## (.+)", line)
        if heading:
            letter = heading.group(1)
        anchor = ANCHOR.fullmatch(line.strip())
        if anchor:
            first = sort_key(anchor.group(1))[0]
            expected = "0–9" if first.isdigit() else first.upper()
            assert letter == expected, f"{anchor.group(1)} sits under '## {letter}'"


def test_the_topic_index_lists_every_entry_and_only_entries():
    text = glossary_text()
    index_targets = {t[1:] for _, t in links(index_section(text)) if t.startswith("#")}
    ids = set(ANCHOR.findall(text))
    assert not index_targets - ids, f"index links to no entry: {sorted(index_targets - ids)}"
    assert not ids - index_targets, f"entries missing from the index: {sorted(ids - index_targets)}"


def test_every_entry_links_to_where_it_is_taught():
    for anchor, entry in entries(glossary_text()).items():
        targets = [t for _, t in links(entry)]
        if anchor in NOT_IN_A_CHAPTER:
            assert any(t.startswith("https://") for t in targets), anchor
            assert re.search(r"[Nn]o chapter teaches", entry), anchor
        else:
            assert any(t.startswith("../notebooks/") for t in targets), (
                f"{anchor}: no link to the chapter that teaches it")


def test_every_link_resolves():
    text = glossary_text()
    ids = set(ANCHOR.findall(text))
    problems = []
    for label, target in links(text):
        if target.startswith(("https://", "http://")):
            continue
        if target.startswith("#"):
            if target[1:] not in ids:
                problems.append(f"[{label}]({target}): no such entry")
            continue
        path, _, fragment = target.partition("#")
        file = (GLOSSARY.parent / path).resolve()
        if not file.is_file():
            problems.append(f"[{label}]({target}): {path} does not exist")
            continue
        if not fragment:
            continue
        if quote(fragment, safe="?/:@!$&'()*+,;=") != fragment:
            problems.append(f"[{label}]({target}): the fragment would need URL-quoting")
        if file.suffix != ".ipynb":
            problems.append(f"[{label}]({target}): a fragment into a non-notebook")
            continue
        count = notebook_anchors(file).count(fragment)
        if count != 1:
            problems.append(f"[{label}]({target}): {count} headings in {file.name} have "
                            f"that anchor")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("heading, anchor", [
    ("## 4. Inside `backward()`: buckets, hooks and overlap",
     "4.-Inside-backward():-buckets,-hooks-and-overlap"),
    ("## 3. Proof: 2 ranks with batch *b* = 1 process with batch *2b*",
     "3.-Proof:-2-ranks-with-batch-b-=-1-process-with-batch-2b"),
    ("### Exercise 02.1 · `DistributedSampler` from scratch",
     "Exercise-02.1-·-DistributedSampler-from-scratch"),
    ("## A **bold** [link](x.md) &amp; `a_b_c` ##", "A-bold-link-&-a_b_c"),
])
def test_heading_anchor_rule(heading, anchor):
    assert heading_anchor(re.sub(r"^#+ ", "", heading).removesuffix(" ##")) == anchor


def test_heading_parser_skips_fenced_code(tmp_path):
    notebook = tmp_path / "n.ipynb"
    cell = "## Real\n```bash\n# a shell comment\n```\n### Also *real*\n"
    notebook.write_text(json.dumps({"cells": [
        {"cell_type": "markdown", "source": [cell]},
        {"cell_type": "code", "source": ["# not markdown\n"]}]}))
    assert notebook_anchors(notebook) == ["Real", "Also-real"]


def test_anchor_rule_agrees_with_a_markdown_renderer():
    """Cross-check the small parser above against mistune (nbconvert's renderer), where it
    is installed, on every heading of every notebook the glossary links to."""
    mistune = pytest.importorskip("mistune")
    linked = {(GLOSSARY.parent / t.partition("#")[0]).resolve()
              for _, t in links(glossary_text()) if ".ipynb" in t}
    for notebook in sorted(n for n in linked if n.is_file()):
        cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
        rendered = []
        for cell in cells:
            if cell["cell_type"] == "markdown":
                page = mistune.html("".join(cell["source"]))
                for match in re.finditer(r"<h([1-6])[^>]*>(.*?)</h\1>", page, re.S):
                    text = html.unescape(re.sub(r"<[^>]+>", "", match.group(2)))
                    rendered.append(text.replace(" ", "-"))
        assert notebook_anchors(notebook) == rendered, notebook.name


def test_each_key_terms_first_use_in_the_main_line_links_its_entry():
    sys.path.insert(0, str(ROOT / "tools"))
    import glossary_links

    anchors = set(re.findall(r"<a id=\"(term-[a-z0-9-]+)\"></a>", GLOSSARY.read_text()))
    uses = glossary_links.first_uses(ROOT / "notebooks")
    assert {anchor for _, anchor in glossary_links.TERMS} <= anchors
    assert len(uses) >= 20, sorted(uses)
    for anchor, use in uses.items():
        assert use.linked_to == f"../docs/glossary.md#{anchor}", (
            f"{use.path.name}, cell {use.cell}: the first use of {use.text!r} is not linked "
            "to the glossary; run `python tools/glossary_links.py`")
