"""The table of every setting, generated from :class:`~argus.core.settings.Settings` itself.

Each field's ``#:`` comment in ``settings.py`` is its description, so the table cannot fall behind the
settings: ``docs/settings.md`` is this module's output, and a unit test compares the two. Regenerate it with
``python -m argus.core.settings_doc > docs/settings.md``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
from pathlib import Path

from argus.core import settings as settings_module
from argus.core.settings import ENV_PREFIX, Secret, Settings

__all__ = ["field_docs", "settings_markdown"]

_HEADER = """# Settings

Every argus process (the rank side, the stream worker, the sink, the query service and the command line) reads
one settings object. Each setting is an environment variable `ARGUS_<NAME>`; an explicit argument (a command-line
option, or a keyword of `argus.attach` / `Settings.load`) wins over the environment, which wins over the default.
Values are checked once at start-up: a bad one stops the process with a message naming it. Credentials (marked
*secret*) never print; give them in a file with `ARGUS_<NAME>_FILE` (mode 0600) rather than in the environment.

This page is generated from `argus/core/settings.py` (`python -m argus.core.settings_doc > docs/settings.md`);
a test keeps it in sync.

| variable | default | what it sets |
|---|---|---|
"""


def field_docs() -> dict[str, str]:
    """Each field of :class:`Settings` and its ``#:`` comment (joined into one line; '' when it has none)."""
    source = inspect.getsource(settings_module)
    lines = source.splitlines()
    tree = ast.parse(source)
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == Settings.__name__]
    docs: dict[str, str] = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        comment: list[str] = []
        row = node.lineno - 2  # the line above the field, 0-based
        while row >= 0 and lines[row].strip().startswith("#:"):
            comment.insert(0, lines[row].strip()[2:].strip())
            row -= 1
        docs[node.target.id] = _markdown(" ".join(comment))
    return docs


def _markdown(text: str) -> str:
    """A ``#:`` comment's reStructuredText as Markdown: literals in single backticks, no Sphinx roles."""
    return re.sub(r":(?:class|func|meth|attr|mod|data):`~?([^`]+)`", r"`\1`", text).replace("``", "`")


def _default(f: dataclasses.Field[object]) -> str:
    value = f.default
    if isinstance(value, Secret):
        return "*secret*, unset"
    if isinstance(value, Path):
        home = str(Path.home())
        text = str(value)
        # The documented default, not this machine's home directory.
        return "`~" + text[len(home):] + "`" if text.startswith(home) else f"`{text}`"
    return f"`{value}`" if value != "" else "empty"


def settings_markdown() -> str:
    """``docs/settings.md``: one row per setting, in the order of :class:`Settings`."""
    docs = field_docs()
    rows = []
    for f in dataclasses.fields(Settings):
        env = ENV_PREFIX + f.name.upper()
        name = f"`{env}` (or `{env}_FILE`)" if isinstance(f.default, Secret) else f"`{env}`"
        text = docs.get(f.name, "").replace("|", "\\|")
        rows.append(f"| {name} | {_default(f)} | {text} |")
    return _HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(settings_markdown())
