"""The paper's five cases, from their one table (argus.producers.seed_cases): each found as the table says
through the in-process pipeline; the CLI's names and layouts come from the same table."""

from __future__ import annotations

import pytest

from argus.core.kinds import FindingKind
from argus.demo import FAULTS, build_spec
from argus.producers.faults import Fault
from argus.producers.seed_cases import SEED_CASES, SeedCase, paper_case, seed_case
from argus.producers.simulator import JobSimulator
from argus.streams.offline import diagnose_records


@pytest.mark.parametrize("case", SEED_CASES, ids=lambda c: c.name)
def test_each_case_is_found_as_its_table_says(case: SeedCase) -> None:
    spec = paper_case(case.fault, steps=40)
    [(_job, findings)] = diagnose_records(r.record for r in JobSimulator(spec).records()).items()
    named = [f for f in findings if f.kind in case.expect]
    assert named, [(f.kind, f.ranks) for f in findings]
    assert {r for f in findings for r in f.ranks} == set(case.ranks)
    assert FindingKind.LINK_DEGRADED not in {f.kind for f in findings} or case.fault is Fault.LINK_DEGRADATION


def test_cli_names_and_layouts_come_from_the_table() -> None:
    assert [FAULTS[c.name] for c in SEED_CASES] == [c.fault for c in SEED_CASES]
    assert seed_case("case4") is seed_case(Fault.HOST_JIT_STALL)
    # A case's fault on another layout, at the case's step time.
    spec = build_spec("j", 4, 2, 1, 10, "case4")
    assert spec.step_time_ns == seed_case("case4").step_time_ns == 40_000_000 and spec.fault is not None
    assert build_spec("j", 8, 2, 2, 10, "case1").step_time_ns == 200_000_000
    with pytest.raises(KeyError, match="no seed case 'case9'"):
        seed_case("case9")
