"""The package's shape, kept so: layers import downward only, no import runs in a circle, files
and functions stay small.

Layers (`../shared/DESIGN.md`): cache -> sharding -> pipeline -> job -> tools, with the planner's
core knowing only the cache's statistics and its TorchRec adapter (`planner/torchrec/`) the
sharding layer. The tools (`distcache/tools/`: they measure machines and compare plans) use the
job's pieces; the job, and everything below it, imports no tool. `errors.py` and
`constants.py`, at the package root, sit below every layer. Every import counts, at module
level, inside a function or under `if TYPE_CHECKING:`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import distcache

PACKAGE = Path(distcache.__file__).resolve().parent
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
# Modules at the package root that every layer may import: they import no other layer.
BASE = ("errors", "constants", "arguments")
# layer (a subpackage, or a path below the package) -> the distcache layers it may import
ALLOWED = {
    "cache": {"cache", *BASE},
    "data": {"data", "planner", *BASE},
    "sharding": {"sharding", "cache", *BASE},
    "pipeline": {"pipeline", "sharding", "cache", *BASE},
    "planner": {"planner", "cache", *BASE},
    "planner/torchrec": {"planner", "sharding", "cache", *BASE},
    "job": {"job", "pipeline", "sharding", "planner", "data", "cache", *BASE},
    "tools": {"tools", "job", "pipeline", "sharding", "planner", "data", "cache", *BASE},
}
# Import circles known and kept for now, each with its reason. A circle not listed fails the
# test, and so does a listed one that is gone (then delete its entry).
KNOWN_CIRCLES: set[frozenset[str]] = set()
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _layer(path: Path) -> str | None:
    rel = path.relative_to(PACKAGE).as_posix()
    return max((k for k in ALLOWED if rel.startswith(k + "/")), key=len, default=None)


def _imported_layers(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        else:
            continue
        names |= {m.split(".")[1] for m in modules if m.startswith("distcache.")}
    return names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_imports_go_downward(path: Path) -> None:
    layer = _layer(path)
    if layer is None:  # train.py, __main__.py, the package root: may import every layer
        return
    upward = _imported_layers(ast.parse(path.read_text())) - ALLOWED[layer]
    assert not upward, f"{layer} imports {sorted(upward)}; allowed: {sorted(ALLOWED[layer])}"


def test_files_and_functions_stay_small() -> None:
    long_files, long_functions = [], []
    for path in SOURCES:
        text = path.read_text()
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{rel}:{node.lineno} {node.name}: {length} lines")
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def test_the_job_imports_no_tool() -> None:
    """`distcache/job/` and `train.py` are the training job: the tools use them, never the
    other way round (a tool the job needs belongs in the job or a layer below)."""
    job = [p for p in SOURCES if _layer(p) == "job" or p == PACKAGE / "train.py"]
    assert job, "no job modules found"
    offenders = [
        p.relative_to(PACKAGE).as_posix()
        for p in job
        if "tools" in _imported_layers(ast.parse(p.read_text()))
    ]
    assert not offenders, f"the job imports distcache.tools in {offenders}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (`from a.b import c` imports `a.b.c` where
    that is a module, else `a.b`, whose `__init__` runs)."""
    modules = {_module_name(p): p for p in SOURCES}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    edges.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
        graph[name] = {m for m in edges if m in modules and m != name}
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def test_no_import_runs_in_a_circle() -> None:
    graph = _import_graph()
    reach = {m: _reachable(graph, m) for m in graph}
    circles = {
        frozenset({m} | {o for o in reach[m] if m in reach[o]}) for m in graph if m in reach[m]
    }
    new = [sorted(c) for c in circles - KNOWN_CIRCLES]
    gone = [sorted(c) for c in KNOWN_CIRCLES - circles]
    assert not new, f"imports that run in a circle (each list, one circle): {new}"
    assert not gone, f"known circles that are gone: delete them from KNOWN_CIRCLES: {gone}"
