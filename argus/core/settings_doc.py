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

from argus.core.settings import ENV_PREFIX, Secret, Settings

__all__ = ["comment_docs", "field_docs", "rst_markdown", "settings_markdown"]

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
    return comment_docs(Settings)


def comment_docs(cls: type, *, shared: bool = False) -> dict[str, str]:
    """Each annotated field of the class ``cls`` (defined at the top of its module) and the ``#:`` comment above
    it, joined into one line of Markdown; '' when it has none. ``shared``: a field without a comment of its own
    right below another field (no blank line between) shares that field's comment (``a: int``/``b: int`` under
    one comment)."""
    source = inspect.getsource(sys.modules[cls.__module__])
    lines = source.splitlines()
    tree = ast.parse(source)
    [node_cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    docs: dict[str, str] = {}
    previous: tuple[int, str] | None = None  # the last field's end line (1-based) and name
    for node in node_cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            previous = None
            continue
        comment: list[str] = []
        row = node.lineno - 2  # the line above the field, 0-based
        while row >= 0 and lines[row].strip().startswith("#:"):
            comment.insert(0, lines[row].strip()[2:].strip())
            row -= 1
        name = node.target.id
        if not comment and shared and previous is not None and previous[0] == node.lineno - 1:
            docs[name] = docs[previous[1]]
        else:
            docs[name] = rst_markdown(" ".join(comment))
        previous = (node.end_lineno or node.lineno, name)
    return docs


def rst_markdown(text: str) -> str:
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
