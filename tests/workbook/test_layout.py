"""The package's layers: the core never imports the labs or the authoring tools, no
module imports itself back through others, private PyTorch and Python names are reached
from one module only, and the launcher's parts stay small enough to read in one sitting."""

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
    for path in [*(PACKAGE / "labs").rglob("*.py"), *(PACKAGE / "exercises").rglob("*.py")]:
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


#: The rooms on each floor; a room may import its own floor's and the floors below.
FLOORS = (("runtime",), ("launcher", "measure", "data", "models"), ("parallel",),
          ("training",), ("planning",), ("viz",), CHAPTER_LAYERS)
FLOOR_OF = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}


def room_of(module: str) -> str | None:
    """The room of ``mgpu_helpers.<room>...``; None for the package's top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FLOOR_OF else None


def test_every_folder_of_the_package_is_a_room_on_a_floor():
    folders = {path.name for path in PACKAGE.iterdir()
               if path.is_dir() and (path / "__init__.py").exists()}
    assert folders == set(FLOOR_OF), (f"rooms without a floor: {sorted(folders - set(FLOOR_OF))}"
                                      f"; floors without a room: {sorted(set(FLOOR_OF) - folders)}")


def upward_imports() -> list[str]:
    found = []
    for name, targets in import_graph().items():
        room = room_of(name)
        if room is None:  # the package's top re-exports from any room
            continue
        for target in sorted(targets):
            other = room_of(target)
            if other is not None and FLOOR_OF[other] > FLOOR_OF[room] \
                    and not (room in CHAPTER_LAYERS and other in CHAPTER_LAYERS):
                found.append(f"{name} ({room}, floor {FLOOR_OF[room] + 1}) imports {target} "
                             f"({other}, floor {FLOOR_OF[other] + 1})")
    return found


def test_no_room_imports_a_room_on_a_floor_above():
    bad = upward_imports()
    assert not bad, ("imports run down the floors (docs/architecture.md): "
                     + "; ".join(bad) + ". Move the code both need down a floor")


def test_the_floor_check_sees_an_upward_import(monkeypatch):
    graph = {"mgpu_helpers.runtime.env": {"mgpu_helpers.training.train"},
             "mgpu_helpers.training.train": {"mgpu_helpers.runtime.ranks"},
             "mgpu_helpers.labs.zero": {"mgpu_helpers.exercises.core"}}
    monkeypatch.setitem(globals(), "import_graph", lambda: graph)
    assert upward_imports() == ["mgpu_helpers.runtime.env (runtime, floor 1) imports "
                                "mgpu_helpers.training.train (training, floor 4)"]


def test_every_launcher_part_is_short():
    lengths = {path.name: len(path.read_text().splitlines())
               for path in (PACKAGE / "launcher").glob("*.py")}
    assert len(lengths) >= 5
    assert max(lengths.values()) <= LAUNCHER_PART_MAX_LINES, lengths


# ------------------------------------------------------------------- import cycles


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """Which package modules each package module imports, anywhere in it (also inside
    functions and under TYPE_CHECKING). Importing ``x.y`` runs package ``x`` first, so
    that is an edge to ``x`` too, except where ``x`` encloses the importer: a module's
    own packages are always imported before it."""
    modules = package_modules()
    graph = {}
    for name, path in modules.items():
        found = imported_modules(path.read_text(), name, path.name == "__init__.py")
        graph[name] = {target for target in found if target in modules and target != name
                       and not name.startswith(target + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that starts and ends at the same module, or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_module_of_the_package_imports_itself_back_through_others():
    cycle = find_cycle(import_graph())
    assert cycle is None, ("import cycle: " + " -> ".join(cycle) + ". Imports run one way: "
                           "move what both need into a module of its own that both import")


# ---------------------------------------------------------------- private names

PRIVATE_HOME = PACKAGE / "runtime" / "private_apis.py"
#: Private PyTorch and Python names, reached only through mgpu_helpers/runtime/private_apis.py.
PRIVATE_NAMES = {"_device_count_nvml", "_is_in_bad_fork", "_dump_fr_trace", "_dump_nccl_trace",
                 "_get_ddp_logging_data", "_EventType", "_exit_function", "kineto_results",
                 "experimental_event_tree"}
PRIVATE_ATTRIBUTES_OF = {"threading": {"_shutdown"}}


def private_uses(source: str) -> set[str]:
    """The private names ``source`` reaches: as an attribute, an imported name, or a
    string (``getattr(torch.cuda, "_is_in_bad_fork")``)."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            if node.attr in PRIVATE_NAMES:
                used.add(node.attr)
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if node.attr in PRIVATE_ATTRIBUTES_OF.get(owner, ()):
                used.add(f"{owner}.{node.attr}")
        elif isinstance(node, ast.ImportFrom):
            used.update(alias.name for alias in node.names if alias.name in PRIVATE_NAMES)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            used.update(PRIVATE_NAMES.intersection(node.value.split(".")))
    return used


def notebook_code(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(cell["source"]) for cell in cells
                     if cell["cell_type"] == "code"
                     and not "".join(cell["source"]).lstrip().startswith(("%", "!")))


def sources_outside_the_private_home():
    for folder in ("mgpu_helpers", "scripts", "benchmarks", "tools", "solutions"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != PRIVATE_HOME:
                yield path, path.read_text()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        yield path, notebook_code(path)


def test_the_private_name_check_sees_attributes_imports_and_strings():
    assert private_uses("torch.cuda._is_in_bad_fork()") == {"_is_in_bad_fork"}
    assert private_uses("from torch._C._profiler import _EventType") == {"_EventType"}
    assert private_uses("getattr(m, '_get_ddp_logging_data')") == {"_get_ddp_logging_data"}
    assert private_uses("find(torch, '_C._profiler._EventType')") == {"_EventType"}
    assert private_uses("threading._shutdown()") == {"threading._shutdown"}
    assert private_uses("pool._shutdown = True") == set()  # not threading's
    assert private_uses(PRIVATE_HOME.read_text()) >= PRIVATE_NAMES - {"_dump_nccl_trace"}


def test_private_torch_and_python_names_are_reached_only_from_private_apis():
    users = {str(path.relative_to(ROOT)): sorted(used)
             for path, source in sources_outside_the_private_home()
             if (used := private_uses(source))}
    assert not users, (f"{users} reach private PyTorch or Python names directly: call the "
                       "guarded function of mgpu_helpers/runtime/private_apis.py instead (add one "
                       "there, saying why no public route exists)")


# ------------------------------------------------------- names crossing modules


def underscore_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The underscore names ``source`` imports from the package's other modules."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            origin = node.module or ""
            if node.level:
                base = package.split(".")
                origin = ".".join(base[:len(base) - node.level + 1] + ([origin] if origin else []))
            if origin.split(".")[0] == "mgpu_helpers":
                found += [f"{origin}.{alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_the_underscore_check_sees_relative_imports():
    found = underscore_imports("from .checks import _check_port, resolve_backend",
                               "mgpu_helpers.launcher.api")
    assert found == ["mgpu_helpers.launcher.checks._check_port"]
    assert underscore_imports("from torch.cuda import _lazy_init", "mgpu_helpers.x") == []


def test_names_imported_across_modules_are_public():
    crossing = {name: found for name, path in package_modules().items()
                if (found := underscore_imports(path.read_text(), name,
                                                path.name == "__init__.py"))}
    assert not crossing, (f"{crossing}: a name another module imports is part of the "
                          "package's internal API; give it a name without the underscore")
