"""Every link between README.md and docs/*.md leads somewhere: the file
exists and, where the link names a section (``page.md#anchor``), that page
has a heading with that anchor (GitHub's slugs: lower case, punctuation
dropped, spaces to hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings (outside code blocks)."""
    out: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*)", line)):
            out.add(slug(m.group(1)))
    return out


def broken(page: Path, root: Path = REPO) -> list[str]:
    """``page: target`` (``page`` relative to ``root``) for each relative link
    of ``page`` that leads nowhere."""
    bad = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md"
                                 and anchor not in anchors(dest)):
            bad.append(f"{page.relative_to(root)}: {target}")
    return bad


def test_every_doc_link_leads_somewhere() -> None:
    assert [b for page in DOCS for b in broken(page)] == []


def test_a_broken_anchor_is_caught(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A page\n\n## The `make venv` step\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#the-make-venv-step) [no](a.md#the-make-step) [gone](c.md)\n")
    assert [b.split(": ", 1)[1] for b in broken(page, tmp_path)] == [
        "a.md#the-make-step", "c.md"]

