"""The public names: ``ppsync.__all__`` is exactly what is importable."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import ppsync


def test_all_names_are_importable() -> None:
    for name in ppsync.__all__:
        assert getattr(ppsync, name) is not None, name


def test_all_lists_every_public_name() -> None:
    public = {
        n for n, v in vars(ppsync).items()
        if not n.startswith("_") and not isinstance(v, type(importlib))
    }
    assert public == set(ppsync.__all__)


# harness, bench and debug are users of the library, like an engine; the
# benchmarks spawn their ranks with the harness's launcher, so bench sits above it.
LAYER = {
    "errors": 0, "schemas": 1, "core": 2, "compat": 3, "services": 3,
    "harness": 4, "debug": 4, "bench": 5, "cli": 6,
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "ppsync" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYER else None


def test_layers_import_only_downward() -> None:
    root = Path(ppsync.__file__).parent
    bad = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).with_suffix("")
        mine = rel.parts[0]
        if mine not in LAYER:
            continue  # ppsync/__init__.py re-exports from every layer
        for mod in _imports(path):
            other = _layer_of(mod)
            if other is not None and other != mine and LAYER[other] >= LAYER[mine]:
                bad.append(f"{rel} imports {mod}")
    assert bad == []


def test_schemas_and_errors_do_not_import_torch() -> None:
    root = Path(ppsync.__file__).parent
    files = [root / "errors.py", *(root / "schemas").rglob("*.py")]
    offenders = [str(f) for f in files if any(m.split(".")[0] == "torch" for m in _imports(f))]
    assert offenders == []
