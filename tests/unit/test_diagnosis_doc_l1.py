"""docs/diagnosis.md's L1 rule states the thresholds :class:`~argus.detectors.l1_iteration.L1Params` applies:
the effect-size gate ``min_shift`` and the drift allowance ``max_drift`` over ``drift_steps``, each with its
value."""

from __future__ import annotations

from pathlib import Path

from argus.detectors.l1_iteration import L1Params

ROOT = Path(__file__).resolve().parents[2]


def _l1_rule() -> str:
    text = (ROOT / "docs" / "diagnosis.md").read_text(encoding="utf-8")
    start = text.index("* **L1** (")
    return " ".join(text[start:text.index("\n* **L2**", start)].split())


def test_the_l1_rule_quotes_the_gate_and_the_drift_allowance() -> None:
    rule, p = _l1_rule(), L1Params()
    assert f"`l1.min_shift` ({p.min_shift:g}: {round((p.min_shift - 1) * 100):g} % above" in rule, rule
    assert (f"`l1.max_drift` ({p.max_drift:g}: {round(p.max_drift * 100):g} % over `l1.drift_steps`, "
            f"{p.drift_steps} steps," in rule), rule
    assert f"no shift under {round((p.min_shift - 1) * 100):g} % is ever raised" in rule, rule
