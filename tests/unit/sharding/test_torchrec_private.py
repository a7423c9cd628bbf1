"""`distcache/sharding/torchrec_private.py` is the one module that touches TorchRec's and torch's
private attributes it covers: no other module of the package names them, on any object but its
own (`self`, `cls`), as an attribute or as a `getattr`/`hasattr`/`setattr` string."""

from __future__ import annotations

import ast
from pathlib import Path

import distcache
from distcache.sharding import torchrec_private

PACKAGE = Path(distcache.__file__).resolve().parent
COMPAT = Path(torchrec_private.__file__).resolve()
OWN = {"self", "cls"}
BY_NAME = {"getattr", "hasattr", "setattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _touched(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each private name the module reaches on an object not its own."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in OWN):
                found.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in BY_NAME
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and not (isinstance(node.args[0], ast.Name) and node.args[0].id in OWN)
        ):
            found.append((node.lineno, node.args[1].value))
    return found


def _covered() -> set[str]:
    """The private names the compat module reaches (what it is the one home of)."""
    return {name for _, name in _touched(ast.parse(COMPAT.read_text()))}


def test_the_compat_module_covers_what_it_was_written_for() -> None:
    assert {
        "_config",
        "_pg",
        "_in_backward_optimizers",
        "_env",
        "_device",
        "_rank",
        "_emb_dim_per_rank_per_feature",
        "_grouped_embedding_configs",
        "_grouped_embedding_configs_per_rank",
        "_codecs",
        "_callbacks",
        "_values",
        "_jt_dict",
        "_init_from_local_shards_and_global_metadata",
    } <= _covered()


def test_no_other_module_touches_the_covered_private_names() -> None:
    covered = _covered()
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.resolve() == COMPAT:
            continue
        for line, name in _touched(ast.parse(path.read_text())):
            if name in covered:
                offenders.append(f"{path.relative_to(PACKAGE.parent).as_posix()}:{line} {name}")
    assert not offenders, (
        f"TorchRec/torch private names reached outside sharding/torchrec_private.py: {offenders}"
    )


def test_the_scan_sees_each_form_of_access() -> None:
    source = (
        "x._pg\n"
        "self._pg\n"
        "getattr(out, '_codecs', None)\n"
        "getattr(self, '_codecs', None)\n"
        "k._values = v\n"
    )
    assert sorted(name for _, name in _touched(ast.parse(source))) == ["_codecs", "_pg", "_values"]
