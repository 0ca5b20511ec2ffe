"""docs/diagnosis.md: its thresholds table is generated from the Params and kept in sync; it covers every kind."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from argus.core.kinds import FindingKind
from argus.params_doc import BEGIN, END, field_texts, main, param_rows, params_markdown, with_table

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "diagnosis.md"


class _Mode(enum.Enum):
    FAST = "fast"


@dataclass(frozen=True)
class _InnerParams:
    """Knobs of the inner test (defaults in brackets).

    ``ratio``: how much slower counts [1.3]. ``low``, ``high``: the band kept [0.1, 0.9].
    Significance: at least ``sigmas`` [4.0] noise levels.

    Attributes:
        window_ns: how far back to look, ns
            (continued on a second line).
    """

    ratio: float = 1.3
    low: float = 0.1
    high: float = 0.9
    sigmas: float = 4.0
    window_ns: int = 2_000_000_000


@dataclass(frozen=True)
class _OuterParams:
    """A root of Params."""

    #: Steps between runs [5].
    every: int = 5
    #: Groups sampled, and members of each [6, 3].
    groups: int = 6
    members: int = 3

    lonely: int = 1
    modes: tuple[_Mode, ...] = (_Mode.FAST,)
    timeout_s: float = field(default=2.5, metadata={"doc": "Give up after this long."})
    inner: _InnerParams = field(default_factory=_InnerParams)


def test_the_committed_table_is_current() -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert with_table(text) == text, "stale: run python -m argus.params_doc"


def test_every_threshold_is_documented() -> None:
    """A Params field added without a ``#:`` comment, metadata or docstring entry would show an empty row."""
    blank = [line for line in params_markdown().splitlines() if line.endswith("|  |")]
    assert not blank, f"document these Params fields (a #: comment above each): {blank}"


def test_the_page_explains_every_kind() -> None:
    text = PAGE.read_text(encoding="utf-8")
    missing = [k.value for k in FindingKind if f"### `{k.value}`" not in text]
    assert not missing, f"docs/diagnosis.md has no section for {missing}"


def test_fields_are_walked_generically() -> None:
    """Nested Params, every way a field is documented, units from names, and later fields need no code."""
    rows = {r.path: r for r in param_rows(_OuterParams())}
    assert list(rows) == ["every", "groups", "members", "lonely", "modes", "timeout_s", "inner.ratio", "inner.low",
                          "inner.high", "inner.sigmas", "inner.window_ns"]
    assert rows["every"].text == "Steps between runs."  # the default in brackets is the value column's
    assert rows["members"].text == rows["groups"].text == "Groups sampled, and members of each."
    assert rows["lonely"].text == ""  # a blank line above: no shared comment
    assert rows["timeout_s"].text == "Give up after this long." and rows["timeout_s"].unit == "s"
    assert rows["inner.ratio"].text == "how much slower counts."
    assert rows["inner.low"].text == rows["inner.high"].text == "the band kept."
    assert rows["inner.sigmas"].text == "at least `sigmas` noise levels."
    assert rows["inner.window_ns"].text == "how far back to look, ns (continued on a second line)."
    assert rows["inner.window_ns"].unit == "ns" and rows["inner.window_ns"].value == 2_000_000_000
    assert set(field_texts(_InnerParams)) == {f.name for f in dataclasses.fields(_InnerParams)}


def test_every_diagnosis_param_is_in_the_table() -> None:
    from argus.streams.diagnosis import DiagnosisParams

    table = params_markdown()
    for row in param_rows(DiagnosisParams()):
        assert f"| `{row.path}` |" in table


def test_check_and_rewrite(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"# Page\n\n{BEGIN}\nold table\n{END}\n\nafter\n", encoding="utf-8")
    assert main(["--check", str(page)]) == 1
    assert main([str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert "old table" not in text and text.endswith(f"{END}\n\nafter\n") and "| `l3.links.ratio` |" in text
    assert main(["--check", str(page)]) == 0
    with pytest.raises(ValueError, match="needs the lines"):
        with_table("# no markers\n")
