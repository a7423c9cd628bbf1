"""The package's shape, kept so: layers import downward only, files and functions stay small.

Layers (`../shared/DESIGN.md`): cache -> sharding -> pipeline -> job, with the planner's core
knowing only the cache's statistics and its TorchRec adapter (`planner/torchrec/`) the sharding
layer. Every import counts, at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import distcache

PACKAGE = Path(distcache.__file__).resolve().parent
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
# layer (a subpackage, or a path below the package) -> the distcache layers it may import
ALLOWED = {
    "cache": {"cache", "errors"},
    "data": {"data", "errors", "planner"},
    "sharding": {"sharding", "cache", "errors"},
    "pipeline": {"pipeline", "sharding", "cache", "errors"},
    "planner": {"planner", "cache", "errors"},
    "planner/torchrec": {"planner", "sharding", "cache", "errors"},
}
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
    if layer is None:  # job/, train.py, the package root: may import every layer
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
