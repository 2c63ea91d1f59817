"""The code's shape, checked from its syntax trees (ast; nothing is imported):

- no private name (`_x`, or a name from a private module `_x.py`) is imported across a package
  boundary (titan_audit.<package>);
- dependencies point down the layers of DESIGN.md section 2 (cli > demo, bench, report,
  portability > rl > trainer > golden, audit, data, models > batch_invariant, deterministic);
- no module imports a module that imports it back (a caller and its callee), lazy imports included;
- the two loops stay readable: trainer/train.py and rl/loop.py under 300 lines each, no function
  in either over 80 lines.
Each check has a negative control on a made-up module, so a check that cannot fail would show.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "titan_audit"
LAYERS = {
    "cli": 6,
    "demo": 5,
    "bench": 5,
    "report": 5,
    "portability": 5,
    "rl": 4,
    "trainer": 3,
    "golden": 2,
    "audit": 2,
    "data": 2,
    "models": 2,
    "batch_invariant": 1,
    "deterministic": 1,
}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = ast.parse(path.read_text(), str(path))
    return out


def _imports(tree: ast.Module) -> list[tuple[str, str, int]]:
    """(module, imported name or '', line) of every titan_audit import, lazy ones included."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("titan_audit"):
            found += [(node.module, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.startswith("titan_audit")]
    return found


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def private_imports(modules: dict[str, ast.Module]) -> list[str]:
    bad = []
    for name, tree in modules.items():
        for target, imported, line in _imports(tree):
            if _package(target) == _package(name):
                continue
            private_module = any(p.startswith("_") and not p.startswith("__") for p in target.split("."))
            private_name = imported.startswith("_") and not imported.startswith("__")
            if private_module or private_name:
                bad.append(f"{name}:{line}: from {target} import {imported}")
    return bad


def upward_imports(modules: dict[str, ast.Module]) -> list[str]:
    bad = []
    for name, tree in modules.items():
        here = LAYERS.get(_package(name))
        for target, _, line in _imports(tree):
            there = LAYERS.get(_package(target))
            if here is not None and there is not None and there > here:
                bad.append(f"{name}:{line}: imports {target} (a layer above)")
    return bad


def mutual_imports(modules: dict[str, ast.Module]) -> list[str]:
    edges: dict[str, set[str]] = {}
    for name, tree in modules.items():
        targets = set()
        for target, imported, _ in _imports(tree):
            full = f"{target}.{imported}"
            targets.add(full if full in modules else target)
        edges[name] = {t for t in targets if t in modules and t != name}
    # a package's __init__ and its own submodules re-export each other by design
    nested = lambda a, b: a.startswith(b + ".") or b.startswith(a + ".")  # noqa: E731
    return sorted(
        f"{a} <-> {b}" for a in edges for b in edges[a] if a < b and a in edges.get(b, ()) and not nested(a, b)
    )


def long_functions(tree: ast.Module, limit: int) -> list[str]:
    return [
        f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > limit
    ]


@pytest.fixture(scope="module")
def modules():
    return _modules()


def test_no_private_name_crosses_a_package_boundary(modules):
    assert private_imports(modules) == []
    control = {"titan_audit.rl.x": ast.parse("from titan_audit.trainer.train import _rank\n")}
    assert private_imports(control) == ["titan_audit.rl.x:1: from titan_audit.trainer.train import _rank"]
    control = {"titan_audit.cli.x": ast.parse("from titan_audit.batch_invariant.cpu._lib import Error\n")}
    assert len(private_imports(control)) == 1
    same_package = {"titan_audit.rl.x": ast.parse("from titan_audit.rl.loop import _private\n")}
    assert private_imports(same_package) == []


def test_dependencies_point_down_the_layers(modules):
    assert upward_imports(modules) == []
    control = {"titan_audit.trainer.x": ast.parse("def f():\n    from titan_audit.rl.loop import rl_train\n")}
    assert upward_imports(control) == ["titan_audit.trainer.x:2: imports titan_audit.rl.loop (a layer above)"]


def test_no_module_imports_its_own_caller(modules):
    assert mutual_imports(modules) == []
    control = {
        "titan_audit.trainer.a": ast.parse("from titan_audit.trainer.b import f\n"),
        "titan_audit.trainer.b": ast.parse("def g():\n    from titan_audit.trainer.a import h\n"),
    }
    assert mutual_imports(control) == ["titan_audit.trainer.a <-> titan_audit.trainer.b"]


@pytest.mark.parametrize("path", ["trainer/train.py", "rl/loop.py"])
def test_the_loops_read_top_to_bottom(path):
    text = (ROOT / path).read_text()
    assert len(text.splitlines()) < 300, f"{path}: {len(text.splitlines())} lines"
    assert long_functions(ast.parse(text), 80) == []
    control = ast.parse("def f():\n" + "    x = 1\n" * 80)
    assert long_functions(control, 80) == ["f: 81 lines"]
