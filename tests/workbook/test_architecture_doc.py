"""docs/architecture.md lists every module of the package, and nothing that is gone."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
EXERCISE_CHAPTER = re.compile(r"exercises/ch\d\d\.py")


def listed() -> set[str]:
    """The module paths the document names, as ``* `path.py`: ...`` entries."""
    return set(re.findall(r"^\* `([\w/]+\.py)`:", DOC.read_text(), re.MULTILINE))


def modules() -> set[str]:
    """Every module of the package, relative to it (``__init__``/``__main__`` left out),
    with the chapters' exercise modules as one entry, ``exercises/chNN.py``."""
    found = set()
    for path in (ROOT / "mgpu_helpers").rglob("*.py"):
        relative = path.relative_to(ROOT / "mgpu_helpers").as_posix()
        if path.stem in ("__init__", "__main__"):
            continue
        found.add("exercises/chNN.py" if EXERCISE_CHAPTER.fullmatch(relative) else relative)
    return found


def test_the_architecture_document_lists_every_module_and_only_those():
    missing, gone = sorted(modules() - listed()), sorted(listed() - modules())
    assert not missing, f"docs/architecture.md does not list {missing}: add a line to its room"
    assert not gone, f"docs/architecture.md lists {gone}, which no longer exist: remove them"


def test_the_check_reads_entries_and_catches_a_missing_one():
    assert "launcher/api.py" in listed() and "exercises/chNN.py" in listed()
    assert modules() - (listed() - {"launcher/api.py"}) == {"launcher/api.py"}


LINK = re.compile(r"\]\(([^)\s]+)\)")
PAGES = ["README.md", "docs/architecture.md", "docs/testing.md", "docs/gpu_and_cluster.md",
         "docs/launching.md"]


def test_every_relative_link_of_the_readme_and_the_maintainer_pages_exists():
    broken = []
    for page in PAGES:
        path = ROOT / page
        for link in LINK.findall(path.read_text()):
            target = link.split("#")[0]
            if link.startswith(("http://", "https://", "#")) or not target:
                continue
            if not (path.parent / target).exists():
                broken.append(f"{page}: {link}")
    assert not broken, broken


#: Test folders that are not rooms of the package: what spans the workbook, the tools,
#: the browser test, and the helpers and scripts the tests share.
OTHER_TEST_FOLDERS = {"workbook", "tools", "browser", "support", "launch_scripts"}


def test_the_tests_mirror_the_package_one_folder_a_room():
    rooms = {path.name for path in (ROOT / "mgpu_helpers").iterdir()
             if (path / "__init__.py").exists()}
    tests = ROOT / "tests"
    folders = {path.name for path in tests.iterdir()
               if path.is_dir() and not path.name.startswith((".", "__"))}
    assert not folders - rooms - OTHER_TEST_FOLDERS, (
        f"tests/ folders {sorted(folders - rooms - OTHER_TEST_FOLDERS)} are neither a room of "
        f"the package nor one of {sorted(OTHER_TEST_FOLDERS)}: see CONTRIBUTING.md, Tests")
    stray = sorted(path.name for path in tests.glob("test_*.py"))
    assert not stray, f"tests/{stray} sit at the top: move each into its room's folder"
    names = [path.name for path in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), "two test files share a name: pytest needs unique ones"
