"""Test-session defaults shared by every tier.

Property tests draw the same examples on every run (Hypothesis' ``derandomize``): a suite that must pass on
a clean clone cannot depend on the luck of a draw. To explore new examples, run
``pytest --hypothesis-profile explore`` (random draws, failures kept in ``.hypothesis``).
"""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("deterministic", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("deterministic")
