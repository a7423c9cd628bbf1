"""distcache raises its own error types: every `raise` of a built-in exception class in the
package is a finding (a caller catching `DistcacheError` would miss it). The typed errors subclass
the built-in they replace (`DistcacheConfigError` is a `ValueError`), so callers catching those
still do."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

import distcache
from distcache import errors

PACKAGE = Path(distcache.__file__).resolve().parent
BUILTIN_ERRORS = {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}
# Protocol, not errors: (enclosing function, exception) that Python's data model asks for.
ALLOWED = {
    ("__getattr__", "AttributeError"),  # a module's lazy attributes
    ("progress", "StopIteration"),  # TorchRec's pipelines end so
    ("batch", "IndexError"),  # Trace.batch(b)
}


def builtin_raises(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """`file:line name` of each `raise Name(...)` / `raise Name` of a built-in exception."""
    found: list[str] = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BUILTIN_ERRORS:
                if (function, exc.id) not in ALLOWED:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {exc.id}")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(path.read_text()), "")
    return found


@pytest.mark.parametrize("layer", ["cache", "sharding", "pipeline", "data", "planner", "job"])
def test_layers_raise_only_distcache_errors(layer: str) -> None:
    found = [
        hit for path in sorted((PACKAGE / layer).rglob("*.py")) for hit in builtin_raises(path)
    ]
    assert not found, "built-in exceptions raised:\n" + "\n".join(found)


def test_every_error_is_a_distcache_error_and_its_builtin() -> None:
    typed = [
        value
        for value in vars(errors).values()
        if isinstance(value, type)
        and issubclass(value, Exception)
        and value.__module__ == errors.__name__
    ]
    assert len(typed) >= 8
    for cls in typed:
        assert issubclass(cls, errors.DistcacheError), cls
        if cls is not errors.DistcacheError:
            assert any(base in vars(builtins).values() for base in cls.__mro__[2:]), cls


def test_the_scan_finds_a_builtin_raise(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f():\n    raise ValueError('x')\n"
        "def __getattr__(name):\n    raise AttributeError(name)\n"
        "def g():\n    def batch():\n        raise IndexError\n    raise KeyError\n"
    )
    assert builtin_raises(probe, tmp_path) == ["probe.py:2 ValueError", "probe.py:8 KeyError"]
