"""The repository explains itself: no doc, docstring or comment points at a
tracker's issue by number ("issue 20's targets"); it says what is meant."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ISSUE = re.compile(r"\bissue\s+#?\d+", re.IGNORECASE)


def files() -> list[Path]:
    """README.md, docs/*.md and every module under ppsync/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
            *sorted((REPO / "ppsync").rglob("*.py"))]


def issue_refs(path: Path) -> list[str]:
    """``path:line: text`` for each line of ``path`` that cites an issue number."""
    rel = path.relative_to(REPO)
    return [f"{rel}:{no}: {line.strip()}"
            for no, line in enumerate(path.read_text().splitlines(), 1) if ISSUE.search(line)]


def test_no_doc_or_module_cites_an_issue_number() -> None:
    found = [ref for path in files() for ref in issue_refs(path)]
    assert found == []


def test_an_issue_number_is_caught() -> None:
    assert ISSUE.search("the targets (Issue 20's)") is not None
    assert ISSUE.search("see issue #7") is not None
    assert ISSUE.search("issued in issue order, 3 ranks") is None
    assert len(files()) > 50
