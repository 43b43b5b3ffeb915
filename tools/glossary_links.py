"""Link each key term, where the main line first uses it, to its glossary entry.

The main line is chapters 00, 01, ... in order (appendices aside); a use is the term in a
markdown cell's prose or a code span that is exactly the term (`torchrun`), not in a
heading, the navigation line, a fenced block, a link's text of another target, an HTML tag
or a formula. ``python tools/glossary_links.py`` links every first use that is not linked
yet (once: rerunning changes nothing); ``tests/workbook/test_glossary.py`` checks that it has been.
An authoring tool, not part of the helper package.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

GLOSSARY = "../docs/glossary.md"

# (pattern, glossary anchor): the terms a learner meets before their chapter defines them
TERMS = [
    (r"ranks?", "term-rank"),
    (r"world size", "term-world-size"),
    (r"local rank", "term-local-rank"),
    (r"process groups?", "term-process-group"),
    (r"backends?", "term-backend"),
    (r"NCCL", "term-nccl"),
    (r"gloo", "term-gloo"),
    (r"torchrun", "term-torchrun"),
    (r"collectives?", "term-collective"),
    (r"all-reduces?", "term-all-reduce"),
    (r"reduce-scatters?", "term-reduce-scatter"),
    (r"all-gathers?", "term-all-gather"),
    (r"buckets?", "term-bucket"),
    (r"micro-batch(?:es)?", "term-micro-batch"),
    (r"global batch(?:es)?", "term-global-batch"),
    (r"gradient accumulation", "term-gradient-accumulation"),
    (r"mixed precision", "term-mixed-precision"),
    (r"bubbles?", "term-bubble"),
    (r"FSDP", "term-fsdp"),
    (r"ZeRO(?:-[123])?", "term-zero"),
    (r"DTensors?", "term-dtensor"),
    (r"device mesh(?:es)?", "term-device-mesh"),
    (r"tensor parallelism", "term-tensor-parallelism"),
    (r"sequence parallelism", "term-sequence-parallelism"),
    (r"context parallelism", "term-context-parallelism"),
    (r"ring attention", "term-ring-attention"),
    (r"mixtures? of experts", "term-mixture-of-experts"),
    (r"expert parallelism", "term-expert-parallelism"),
    (r"pipeline parallelism", "term-pipeline-parallelism"),
    (r"activation checkpointing", "term-activation-checkpointing"),
    (r"MFU", "term-mfu"),
    (r"stragglers?", "term-straggler"),
]

# what is not prose: fenced blocks, headings and the navigation line, links (kept whole:
# their text is matched separately), code spans, HTML tags, formulas
_SKIPPED = re.compile(
    r"(?P<fence>```.*?```)|(?P<line>^(?:#|\*\*Navigate\*\*)[^\n]*)"
    r"|(?P<link>\[(?P<text>[^\]]*)\]\((?P<target>[^)]*)\))|(?P<code>`[^`\n]+`)"
    r"|(?P<html><[^>\n]+>)|(?P<math>\$[^$\n]+\$)", re.DOTALL | re.MULTILINE)


@dataclass(frozen=True)
class Use:
    """A term's first use: in which notebook and cell, where in the cell's source, and
    whether (and where to) it is linked already."""

    path: Path
    cell: int
    start: int
    end: int
    text: str
    linked_to: str | None  # the link's target when the use is a link's whole text


def _uses(source: str, pattern: re.Pattern):
    """(start, end, text, link target or None) of each use of ``pattern`` in ``source``."""
    position = 0
    for skipped in [*_SKIPPED.finditer(source), None]:
        stop = skipped.start() if skipped else len(source)
        for match in pattern.finditer(source, position, stop):
            yield match.start(), match.end(), match.group(), None
        if skipped is None:
            break
        if skipped["link"] and pattern.fullmatch(skipped["text"].strip("`")):
            yield skipped.start(), skipped.end(), skipped["text"], skipped["target"]
        elif skipped["code"] and pattern.fullmatch(skipped["code"][1:-1]):
            yield skipped.start(), skipped.end(), skipped["code"], None
        position = skipped.end()


def main_line(notebooks_dir: Path) -> list[Path]:
    return sorted(Path(notebooks_dir).glob("[0-9][0-9]_*.ipynb"))


def first_uses(notebooks_dir: Path) -> dict[str, Use]:
    """Each term's anchor -> its first use in the main line (terms never used: absent)."""
    found: dict[str, Use] = {}
    notebooks = [(path, json.loads(path.read_text())) for path in main_line(notebooks_dir)]
    for term, anchor in TERMS:
        pattern = re.compile(rf"\b{term}\b")
        for path, notebook in notebooks:
            for index, cell in enumerate(notebook["cells"]):
                if cell["cell_type"] != "markdown":
                    continue
                use = next(_uses("".join(cell["source"]), pattern), None)
                if use is not None:
                    found[anchor] = Use(path, index, *use)
                    break
            if anchor in found:
                break
    return found


def link_first_uses(notebooks_dir: Path) -> list[str]:
    """Link every first use not linked yet, one at a time (a link moves the text after
    it); returns the anchors linked now."""
    linked = []
    while True:
        todo = [(anchor, use) for anchor, use in first_uses(notebooks_dir).items()
                if use.linked_to is None]
        if not todo:
            return linked
        anchor, use = todo[0]
        notebook = json.loads(use.path.read_text())
        cell = notebook["cells"][use.cell]
        source = "".join(cell["source"])
        link = f"[{use.text}]({GLOSSARY}#{anchor})"
        cell["source"] = (source[:use.start] + link + source[use.end:]).splitlines(keepends=True)
        use.path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
        linked.append(anchor)


if __name__ == "__main__":
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parents[1] / "notebooks"
    for anchor in link_first_uses(folder):
        print(f"[glossary] linked the first use of {anchor}")
