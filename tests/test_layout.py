"""The package's layers: the core never imports the labs or the authoring tools, and the
launcher's parts stay small enough to read in one sitting."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mgpu_helpers"
TOOLS = sorted(path.stem for path in (ROOT / "tools").glob("*.py"))
LAUNCHER_PART_MAX_LINES = 250


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module ``source`` (the code of ``module``) imports, anywhere in it (also
    inside functions), relative imports resolved: ``from ..labs import x`` in
    ``mgpu_helpers.launcher.api`` gives ``mgpu_helpers.labs`` and ``mgpu_helpers.labs.x``."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            found.add(origin)
            found.update(f"{origin}.{alias.name}" for alias in node.names)
    return found


CHAPTER_LAYERS = ("labs", "exercises")  # chapter material: may import the labs


def core_modules() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py")
                  if not set(CHAPTER_LAYERS) & set(path.relative_to(PACKAGE).parts))


def forbidden_for_core(name: str) -> bool:
    return name.startswith("mgpu_helpers.labs") or name.split(".")[0] in TOOLS


def test_the_import_check_sees_relative_and_nested_imports():
    source = ("from ..labs import ablation\n"
              "def f():\n    import chapters\n    from . import checks\n")
    found = imported_modules(source, "mgpu_helpers.launcher.api")
    assert {"mgpu_helpers.labs", "mgpu_helpers.labs.ablation", "chapters",
            "mgpu_helpers.launcher.checks"} <= found
    assert [name for name in found if forbidden_for_core(name)]
    assert "mgpu_helpers.labs" in imported_modules("from .labs import x", "mgpu_helpers",
                                                   is_package=True)


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_core_modules_import_neither_labs_nor_tools(path):
    found = imported_modules(path.read_text(), module_name(path), path.name == "__init__.py")
    bad = sorted(name for name in found if forbidden_for_core(name))
    assert not bad, (f"{path.relative_to(ROOT)} is core (readers import it) but imports "
                     f"{', '.join(bad)}: move that code into the core, or this module into "
                     "mgpu_helpers/labs/ (a chapter's experiment) or tools/ (authoring)")


def test_labs_and_exercises_do_not_import_tools():
    for path in [*(PACKAGE / "labs").glob("*.py"), *(PACKAGE / "exercises").glob("*.py")]:
        found = imported_modules(path.read_text(), module_name(path),
                                 path.name == "__init__.py")
        assert not [name for name in found if name.split(".")[0] in TOOLS], path


def test_the_core_does_not_import_the_exercises_either():
    # mgpu_helpers.exercises is reached lazily (mh.exercises), never imported by the core
    for path in core_modules():
        found = imported_modules(path.read_text(), module_name(path),
                                 path.name == "__init__.py")
        assert not [name for name in found if name.startswith("mgpu_helpers.exercises")], path


def test_tools_are_not_in_the_package():
    assert TOOLS and not [name for name in TOOLS if (PACKAGE / f"{name}.py").exists()]


def test_every_launcher_part_is_short():
    lengths = {path.name: len(path.read_text().splitlines())
               for path in (PACKAGE / "launcher").glob("*.py")}
    assert len(lengths) >= 5
    assert max(lengths.values()) <= LAUNCHER_PART_MAX_LINES, lengths
