"""docs/design.md's layout (section 6) names every module under ppsync/, and
nothing else; every `core/...py`-style path design.md cites exists."""

from __future__ import annotations

import re
from pathlib import Path

import ppsync

ROOT = Path(ppsync.__file__).parent.parent
DESIGN = ROOT / "docs" / "design.md"


def _entry(token: str) -> bool:
    return token.endswith((".py", "/"))


def layout_paths(text: str) -> set[str]:
    """The paths section 6's tree names. A line whose first word ends in
    ``.py`` or ``/`` lists entries, every leading word that does, at depth
    indent // 2 under the folder last listed one level up; other lines are
    descriptions."""
    block = text.split("## 6. The layers", 1)[1].split("```", 2)[1]
    folders: list[str] = []
    paths: set[str] = set()
    for line in block.splitlines():
        words = line.split()
        if not words or not _entry(words[0]):
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        base = "".join(folders[:depth])
        for word in words:
            if not _entry(word):
                break
            paths.add(base + word)
            if word.endswith("/"):
                del folders[depth:]
                folders.append(word)
    return paths


def package_paths(root: Path) -> set[str]:
    """Every module and package under ``root`` (ppsync/), as the tree names
    them; a package's ``__init__.py`` is its folder."""
    out = {f"{root.name}/"}
    for p in root.rglob("*.py"):
        rel = p.relative_to(root.parent).as_posix()
        out.add(rel.removesuffix("__init__.py") if p.name == "__init__.py" else rel)
    for d in root.rglob("*"):
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")):
            out.add(d.relative_to(root.parent).as_posix() + "/")
    return out


def test_layout_names_every_module_and_only_those() -> None:
    named = layout_paths(DESIGN.read_text())
    real = package_paths(ROOT / "ppsync")
    assert sorted(real - named) == [], "modules missing from docs/design.md section 6"
    assert sorted(named - real) == [], "docs/design.md section 6 names what does not exist"


def test_cited_paths_exist() -> None:
    cited = re.findall(r"`((?:ppsync/)?(?:core|compat|services|harness|bench|checks|probes|debug"
                       r"|schemas)/[\w/]*\.py)", DESIGN.read_text())
    missing = [c for c in cited
               if not (ROOT / (c if c.startswith("ppsync/") else f"ppsync/{c}")).exists()]
    assert missing == []


def test_layout_parser_sees_a_missing_module(tmp_path: Path) -> None:
    pkg = tmp_path / "ppsync"
    (pkg / "core").mkdir(parents=True)
    for f in ("__init__.py", "core/__init__.py", "core/a.py", "core/b.py"):
        (pkg / f).write_text("")
    text = "## 6. The layers\n\n```\nppsync/\n  core/   words\n    a.py  words\n```\n"
    assert package_paths(pkg) - layout_paths(text) == {"ppsync/core/b.py"}
