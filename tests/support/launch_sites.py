"""Every `launch(...)` call in the chapters, scripts, benchmarks and the package, read
from the source (no GPU needed): what it asks for, and what it runs.

Used by test_gpu_rule.py to check the workbook's GPU rule: a launch is either a CPU
check pinned to gloo with a comment saying why, or GPU-capable (backend "auto" or the
plan's, nprocs from the plan, a function that computes on ``mh.device()``).
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLAN = "plan"  # a value taken from `plan = mh.describe().plan`


@dataclass(frozen=True)
class LaunchSite:
    where: str              # "notebooks/04_...ipynb cell 7", "scripts/train_ddp.py"
    line: int               # line of the call within the cell or file
    target: str             # source text of the launched function expression
    backend: object         # "auto" (omitted), a literal, PLAN, or ("parameter", name)
    nprocs: object          # an int, None (omitted), PLAN, or ("parameter", name)
    commented: bool         # a comment on the call's lines or the line above
    target_source: str | None  # the launched function's source, where it can be found


def _is_launch(call: ast.Call, aliases: set[str]) -> bool:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id == "launch"
    return (isinstance(func, ast.Attribute) and func.attr == "launch"
            and isinstance(func.value, ast.Name) and func.value.id in aliases)


def _constants(trees: list[ast.AST]) -> dict[str, object]:
    """Module-level `NAME = <literal>` assignments (later ones win, as when run in order)."""
    found = {}
    for tree in trees:
        for node in getattr(tree, "body", []):
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, ast.Constant)):
                found[node.targets[0].id] = node.value.value
    return found


def _value(node: ast.AST | None, constants: dict, parameters: set[str], default):
    if node is None:
        return default
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id == "plan" and node.attr in ("nprocs", "backend"):
        return PLAN
    if isinstance(node, ast.Name):
        if node.id in parameters:
            return ("parameter", node.id)
        if node.id in constants:
            return constants[node.id]
    return ("expression", ast.unparse(node))


def _enclosing_parameters(tree: ast.AST, call: ast.Call) -> set[str]:
    for node in ast.walk(tree):
        # the line range first: walking every function's body for every call is slow
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.lineno <= call.lineno and call.end_lineno <= node.end_lineno \
                and any(inner is call for inner in ast.walk(node)):
            args = node.args
            return {a.arg for a in args.args + args.kwonlyargs + args.posonlyargs}
    return set()


def _segment(lines: list[str], node: ast.AST) -> str:
    """ast.get_source_segment(source, node) for ``lines`` of the source (as ast splits
    them), without splitting the whole source again for each node."""
    chunk = lines[node.lineno - 1:node.end_lineno]
    chunk[-1] = chunk[-1].encode()[:node.end_col_offset].decode()
    chunk[0] = chunk[0].encode()[node.col_offset:].decode()
    return "".join(chunk)


def _functions(trees: list[ast.AST], sources: list[str]) -> dict[str, str]:
    """name -> source of every top-level function defined in these sources."""
    found = {}
    for tree, source in zip(trees, sources, strict=True):
        lines = io.StringIO(source, newline="").readlines()  # \n, \r\n or \r, as ast does
        for node in getattr(tree, "body", []):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found[node.name] = _segment(lines, node)
    return found


def _imported(trees: list[ast.AST]) -> dict[str, str]:
    """Local name -> dotted path, for `import x as y` and `from x import y`."""
    names = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    names[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _with_local_callees(source: str, functions: dict) -> str:
    """A function's source, followed by the sources of the functions of the same notebook
    or file that it calls (one level): `run()` calling `step()` computes where step does."""
    called = {node.func.id for node in ast.walk(ast.parse(source))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    return "\n\n".join([source] + [functions[name] for name in sorted(called)
                                    if name in functions and functions[name] != source])


def _resolve_source(target: ast.AST, functions: dict, imported: dict) -> str | None:
    import importlib

    dotted = ast.unparse(target)
    if isinstance(target, ast.Name) and target.id in functions:
        return _with_local_callees(functions[target.id], functions)
    head, _, rest = dotted.partition(".")
    if head not in imported:
        return None
    path = imported[head] + (f".{rest}" if rest else "")
    module_name, _, attribute = path.rpartition(".")
    try:
        return textwrap.dedent(inspect.getsource(
            getattr(importlib.import_module(module_name), attribute)))
    except (ImportError, AttributeError, TypeError, OSError):
        return None


def _commented(lines: list[str], call: ast.Call) -> bool:
    """A comment on the call's lines, or above it in the same paragraph (the lines up to
    the previous blank line): one comment may explain a group of launches."""
    first = call.lineno - 1
    while first > 0 and lines[first - 1].strip():
        first -= 1
    return any("#" in line for line in lines[first:call.end_lineno])


def sites_in(sources: list[str], labels: list[str]) -> list[LaunchSite]:
    """Launch calls in a sequence of sources that run in one namespace (a notebook's
    cells in order, or one file)."""
    if not any("launch" in source for source in sources):
        return []  # nothing to parse: a launch call names `launch`
    trees = []
    for source in sources:
        try:
            trees.append(ast.parse(source))
        except SyntaxError:
            trees.append(ast.Module(body=[], type_ignores=[]))
    imported = _imported(trees)
    aliases = {name for name, path in imported.items() if path == "mgpu_helpers"}
    constants, functions = _constants(trees), _functions(trees, sources)
    found = []
    for tree, source, label in zip(trees, sources, labels, strict=True):
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and _is_launch(node, aliases) and node.args):
                continue
            keywords = {k.arg: k.value for k in node.keywords}
            parameters = _enclosing_parameters(tree, node)
            found.append(LaunchSite(
                where=label, line=node.lineno, target=ast.unparse(node.args[0]),
                backend=_value(keywords.get("backend"), constants, parameters, "auto"),
                nprocs=_value(keywords.get("nprocs"), constants, parameters, None),
                commented=_commented(source.splitlines(), node),
                target_source=_resolve_source(node.args[0], functions, imported)))
    return found


def notebook_sites(path: Path) -> list[LaunchSite]:
    cells = [(i, c) for i, c in enumerate(json.loads(Path(path).read_text())["cells"])
             if c["cell_type"] == "code"]
    return sites_in(["".join(c["source"]) for _, c in cells],
                    [f"{Path(path).relative_to(ROOT)} cell {i}" for i, _ in cells])


def file_sites(path: Path) -> list[LaunchSite]:
    return sites_in([Path(path).read_text()], [str(Path(path).relative_to(ROOT))])


def chapter_paths() -> list[Path]:
    """The chapters and the appendices: every notebook the tests run."""
    notebooks = ROOT / "notebooks"
    return [*sorted(notebooks.glob("[0-9][0-9]_*.ipynb")),
            *sorted(notebooks.glob("appendix_*.ipynb"))]


def code_paths() -> list[Path]:
    """Scripts, benchmarks and the package, except the launcher itself."""
    paths = [*sorted((ROOT / "scripts").glob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py")),
             *sorted((ROOT / "mgpu_helpers").rglob("*.py"))]
    return [p for p in paths if p.name != "launch.py"]


def all_sites() -> list[LaunchSite]:
    sites = [site for path in chapter_paths() for site in notebook_sites(path)]
    return sites + [site for path in code_paths() for site in file_sites(path)]


def computes_on_device(source: str | None) -> bool:
    """Does this function put its work on the rank's device (``mh.device()``, the
    package's ``rank_device()``, or an explicit ``"cuda..."`` device)?"""
    if source is None:
        return False
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(
                node.func, "id", "")
            if name in ("device", "rank_device") and not node.args:
                return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith("cuda"):
            return True
    return False
