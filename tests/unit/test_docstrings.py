"""Every module of argus says in its docstring, in at most 15 lines, what it is for (reasoning: docs/)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 15


def _docstring_lines(path: Path) -> int | None:
    """Lines of the module docstring, quotes included; None without one."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    if not body or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Constant) \
            or not isinstance(body[0].value.value, str):
        return None
    end = body[0].end_lineno
    assert end is not None
    return end - body[0].lineno + 1


def _modules() -> list[Path]:
    return sorted((ROOT / "argus").rglob("*.py"))


def test_every_module_has_a_short_docstring() -> None:
    assert len(_modules()) > 100  # the whole package, stages included
    missing = [str(p.relative_to(ROOT)) for p in _modules() if _docstring_lines(p) is None]
    long = {str(p.relative_to(ROOT)): n for p in _modules()
            if (n := _docstring_lines(p)) is not None and n > MAX_LINES}
    assert not missing, f"modules without a docstring: {missing}"
    assert not long, f"module docstrings over {MAX_LINES} lines (move the reasoning to docs/): {long}"
