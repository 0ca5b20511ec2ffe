"""README.md stays a user's page: short, every link resolving, every page of docs/ reachable from it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Words (whitespace-separated tokens, code included) the README may hold; the rest belongs in docs/.
MAX_WORDS = 1800
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _links(page: Path) -> set[Path]:
    """The local files ``page`` links to (web addresses left out)."""
    text = page.read_text(encoding="utf-8")
    return {(page.parent / target).resolve() for target in _LINK.findall(text) if "://" not in target}


def test_the_readme_is_short() -> None:
    words = len((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert words <= MAX_WORDS, f"README.md has {words} words (at most {MAX_WORDS}): move detail into docs/"


def test_every_link_resolves() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [f"{p.relative_to(ROOT)} -> {t.relative_to(ROOT) if t.is_relative_to(ROOT) else t}"
              for p in pages for t in _links(p) if not t.exists()]
    assert not broken, f"links to missing files: {broken}"


def test_every_doc_is_reachable_from_the_readme() -> None:
    """A page moved out of the README must stay findable from it (through links, directly or not)."""
    seen: set[Path] = set()
    todo = [(ROOT / "README.md").resolve()]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.exists():
            continue
        seen.add(page)
        todo.extend(_links(page))
    lost = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in seen)
    assert not lost, f"docs/ pages no link from README.md leads to: {lost}"
