"""The planner's core imports no TorchRec: `distcache/planner/*.py` plan and price without it
(seconds of import, and a CPU machine without FBGEMM); only `planner/torchrec/` may."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import distcache.planner

CORE = Path(distcache.planner.__file__).parent
FORBIDDEN = ("torchrec", "fbgemm_gpu", "torch.distributed")


def _core_modules() -> list[str]:
    return sorted(f"distcache.planner.{path.stem}" for path in CORE.glob("*.py"))


def test_there_is_a_core_to_check():
    assert {"distcache.planner.cost", "distcache.planner.solver"} <= set(_core_modules())


def test_importing_the_core_loads_no_torchrec():
    """In a fresh interpreter (this one may have TorchRec loaded by other tests)."""
    modules = ["distcache.planner", *_core_modules()]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torchrec', 'fbgemm_gpu'}))\n"
    )
    assert _fresh(code) == "[]"


def _fresh(code: str) -> str:
    """What `code` prints in a fresh interpreter that imports the distcache under test (not
    another installed copy)."""
    root = str(CORE.parents[1])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": path},
    )
    return out.stdout.strip()


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_no_core_module_imports_torchrec_or_torch_distributed():
    """By the source: `import torch` itself loads torch.distributed, so the interpreter's
    modules cannot tell whether the core uses it."""
    bad = [
        f"{path.name}: {name}"
        for path in sorted(CORE.glob("*.py"))
        for name in _imports(path)
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
    ]
    assert not bad, bad


def test_the_plan_command_imports_no_torch():
    """`python -m distcache plan` loads numpy, not torch (a second of a plan's time): the
    package's `__init__` loads the engine lazily and `CacheConfig` imports no torch."""
    code = (
        "import io, contextlib, sys\n"
        "from distcache.__main__ import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    code = main(['plan', '--preset', 'synthetic:tables=4', '--world-size', '2'])\n"
        "print(code, sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'torchrec'}))\n"
    )
    assert _fresh(code) == "0 []"
