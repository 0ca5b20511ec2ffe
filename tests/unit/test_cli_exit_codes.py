"""The page :class:`argus.cli.Exit` sends its reader to exists and lists every exit code."""

from __future__ import annotations

import re
from pathlib import Path

from argus.cli import Exit

ROOT = Path(__file__).resolve().parents[2]


def test_exit_codes_are_listed_where_the_docstring_says() -> None:
    named = re.findall(r"docs/[\w/.-]+\.md", Exit.__doc__ or "")
    assert named, f"Exit's docstring names no page under docs/: {Exit.__doc__!r}"
    text = (ROOT / named[0]).read_text()
    paragraph = text[text.index("Exit codes:"):].split("\n\n")[0]
    listed = {int(n) for n in re.findall(r"(?<![\w.-])(\d+) ", paragraph)}
    assert {int(code) for code in Exit} <= listed, f"{named[0]} leaves out {set(map(int, Exit)) - listed}"
