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
    for name in ppsync.__all__:  # loaded on first use (importing ppsync loads no torch)
        getattr(ppsync, name)
    public = {
        n for n, v in vars(ppsync).items()
        if not n.startswith("_") and not isinstance(v, type(importlib))
    }
    assert public == set(ppsync.__all__)


def test_the_names_type_checkers_see_are_the_public_table() -> None:
    """ppsync/__init__.py states its public names once, in ``_PUBLIC``; its
    imports under TYPE_CHECKING restate them for type checkers and must agree."""
    tree = ast.parse(Path(ppsync.__file__).read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If)
                and ast.unparse(n.test) == "_typing.TYPE_CHECKING"]
    typed = {alias.name: node.module for node in block.body
             if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert typed == ppsync._WHERE
    assert ppsync.__all__ == sorted(typed)


# harness, bench, debug, checks and probes are users of the library, like an
# engine; the benchmarks spawn their ranks with the harness's launcher, so
# bench sits above it; the checks and the probes may use both, and nothing but
# the cli uses a check.
LAYER = {
    "errors": 0, "schemas": 1, "core": 2, "compat": 3, "services": 3,
    "harness": 4, "debug": 4, "bench": 5, "checks": 6, "probes": 6, "cli": 7,
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


def _module_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _module_graph() -> dict[str, set[str]]:
    """Every module of ppsync -> the ppsync modules it imports, anywhere in
    it (inside a function too: an import moved there still ties the two).
    ``from pkg import name`` ties to ``pkg.name`` where that is a module."""
    root = Path(ppsync.__file__).parent
    modules = {_module_of(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.module in modules:
                subs = {f"{node.module}.{a.name}" for a in node.names}
                found = subs & modules.keys()
                out.update(found or {node.module})
                if found != subs:
                    out.add(node.module)
        out.discard(mod)
        graph[mod] = out
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_modules() -> None:
    assert _cycles(_module_graph()) == []


def test_cycle_finder_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# inside core, one concern per package, each importing only those below it:
# the rules and the wire know no other; the frame format knows the rules; the
# codec packs frames over the wire; the recorder records frames; the token
# path combines them all.
CORE_PACKAGES = {"rules": 0, "wire": 0, "frame": 1, "codec": 2, "recorder": 2, "path": 3}
# the kernel sets know no codec: of the codec package only the step records
KERNEL_SETS = ("cpu_kernels", "device_kernels")
KERNEL_SETS_MAY_IMPORT = ("steps", "released", *KERNEL_SETS)


def _core_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, imports in graph.items():
        parts = mod.split(".")
        if parts[:2] != ["ppsync", "core"] or len(parts) < 4:
            continue  # ppsync.core itself and its __init__ re-exports
        kernel_set = parts[2] == "codec" and len(parts) > 4 and parts[3] in KERNEL_SETS
        for other in imports:
            o = other.split(".")
            if o[:2] != ["ppsync", "core"] or len(o) < 3:
                continue
            if o[2] != parts[2]:
                upward = CORE_PACKAGES.get(o[2], 99) >= CORE_PACKAGES.get(parts[2], -1)
            else:
                upward = kernel_set and len(o) > 3 and o[3] not in KERNEL_SETS_MAY_IMPORT
            if upward:
                bad.append(f"{mod} imports {other}")
    return bad


def test_core_packages_import_only_downward() -> None:
    assert _core_violations(_module_graph()) == []


def test_core_layer_check_sees_an_upward_import_and_a_kernel_set_using_the_codec() -> None:
    graph = {"ppsync.core.frame.layout": {"ppsync.core.codec.protocol"},
             "ppsync.core.codec.cpu_kernels.numpy_set": {"ppsync.core.codec.host",
                                                          "ppsync.core.codec.steps"},
             "ppsync.core.path.token_path": {"ppsync.core.codec.protocol"}}
    assert _core_violations(graph) == [
        "ppsync.core.frame.layout imports ppsync.core.codec.protocol",
        "ppsync.core.codec.cpu_kernels.numpy_set imports ppsync.core.codec.host"]


def test_no_loose_module_at_the_root_of_core() -> None:
    """core/ holds its packages and its __init__.py only; every package is
    one that the layer order above names."""
    core = Path(ppsync.__file__).parent / "core"
    loose = sorted(p.name for p in core.glob("*.py") if p.name != "__init__.py")
    packages = sorted(p.name for p in core.iterdir()
                      if p.is_dir() and (p / "__init__.py").exists())
    assert loose == []
    assert packages == sorted(CORE_PACKAGES)


def test_every_module_is_under_400_lines() -> None:
    root = Path(ppsync.__file__).parent
    long = [f"{p.relative_to(root)}: {n}" for p in root.rglob("*.py")
            if (n := len(p.read_text().splitlines())) >= 400]
    assert long == []


def test_the_vllm_adapter_never_asks_where_frames_live() -> None:
    """The adapter calls the codec (step_drafts, check_draft_table,
    gather_drafts); a branch on ``on_device`` there would be a second choice."""
    root = Path(ppsync.__file__).parent / "compat"
    asking = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py")
              for i, line in enumerate(p.read_text().splitlines(), 1) if "on_device" in line]
    assert asking == []


SHARED_FILE_NAMES = {
    "__init__.py": "a package's own module, in every package",
    "__main__.py": "`python -m` of its package (ppsync, ppsync.cli)",
    "check.py": "an engine check's command: its cases and verdicts (checks/vllm, checks/sglang)",
    "engine.py": "an engine check's child process, one engine run (checks/vllm, checks/sglang)",
    "report.py": "an engine check's report of what it found (checks/vllm, checks/sglang)",
    "plugin.py": "an engine's plugin entry point (compat/vllm, compat/sglang)",
}
"""Module file names that occur more than once under ppsync/, each with the
job it has in every place: any other name says one thing only."""


def test_a_module_file_name_occurring_twice_has_one_job() -> None:
    root = Path(ppsync.__file__).parent
    places: dict[str, list[str]] = {}
    for p in sorted(root.rglob("*.py")):
        places.setdefault(p.name, []).append(p.relative_to(root).as_posix())
    shared = {name: where for name, where in places.items() if len(where) > 1}
    unlisted = {name: where for name, where in shared.items() if name not in SHARED_FILE_NAMES}
    assert unlisted == {}, "rename these, or list the one job they share in SHARED_FILE_NAMES"
    assert sorted(SHARED_FILE_NAMES) == sorted(shared), "SHARED_FILE_NAMES lists a name used once"
