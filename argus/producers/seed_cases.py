"""The ARGUS paper's five fail-slow case studies, once: their CLI names, layouts, faults and what argus must find.

Everything that runs a seed case takes it from here: :func:`paper_case` (the job of a case at the paper's
layout, for tests and benchmarks), ``argus demo`` / ``argus simulate --fault caseN`` (the case's fault on any
layout, :meth:`SeedCase.fault_on`), and the end-to-end tests (:attr:`SeedCase.expect`).

Details and reasoning: docs/internals/producers.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from argus.core.kinds import FindingKind
from argus.producers.faults import Fault, FaultSpec
from argus.producers.sim_workload import GradSync
from argus.producers.simulator import JobSpec
from argus.producers.topology import build_topology
from argus.schemas.records import JobTopology

__all__ = ["SEED_CASES", "SeedCase", "paper_case", "seed_case"]


@dataclass(frozen=True)
class SeedCase:
    """One case study.

    ``name``: its CLI name (``case1`` ...). ``dp``, ``pp``, ``microbatches``, ``grad_sync``: the paper's layout.
    ``step_time_ns``: the healthy step time (a host stall is a spike only against short steps). ``fault_on``:
    the case's fault at its defaults on a topology. ``expect``: the finding kinds that must name the fault,
    and ``ranks``: the ranks they name at the paper's layout (empty: job-wide findings only, no rank).
    """

    name: str
    fault: Fault
    dp: int
    make_fault: Callable[[JobTopology], FaultSpec]
    expect: frozenset[FindingKind]
    ranks: frozenset[int]
    pp: int = 1
    microbatches: int = 4
    grad_sync: GradSync = GradSync.ALL_REDUCE
    step_time_ns: int = 200_000_000

    def fault_on(self, topology: JobTopology) -> FaultSpec:
        """The case's fault at its defaults on ``topology``. Raises ValueError when it does not fit."""
        return self.make_fault(topology)

    def spec(self, job_id: str | None = None, steps: int = 40, seed: int = 0) -> JobSpec:
        """The case's job at the paper's layout (job id ``case-<fault>`` unless given)."""
        jid = job_id or f"case-{self.fault.value.lower().replace('_', '-')}"
        topo = build_topology(jid, self.dp, pp=self.pp)
        return JobSpec(jid, self.dp, pp=self.pp, steps=steps, seed=seed, microbatches=self.microbatches,
                       grad_sync=self.grad_sync, step_time_ns=self.step_time_ns, fault=self.fault_on(topo))


K = FindingKind
SEED_CASES: tuple[SeedCase, ...] = (
    SeedCase("case1", Fault.COMPUTE_STRAGGLER, 8, FaultSpec.compute_straggler,
             frozenset({K.STEP_REGRESSION, K.COMPUTE_STRAGGLER}), frozenset({5})),
    SeedCase("case2", Fault.LINK_DEGRADATION, 4, FaultSpec.link_degradation, frozenset({K.LINK_DEGRADED}),
             frozenset({4, 5, 6, 7}), pp=2, grad_sync=GradSync.DISTRIBUTED),
    SeedCase("case3", Fault.PP_LAST_STAGE_SLOW, 1, FaultSpec.pp_last_stage_slow, frozenset({K.PP_STAGE_SLOW}),
             frozenset({3}), pp=4, microbatches=8),
    SeedCase("case4", Fault.HOST_JIT_STALL, 4, FaultSpec.host_jit_stall, frozenset({K.ITERATION_SPIKE}),
             frozenset(), step_time_ns=40_000_000),
    SeedCase("case5", Fault.COMPUTE_STRAGGLER_SHORT_COLLECTIVES, 8, FaultSpec.compute_straggler_short_collectives,
             frozenset({K.COMPUTE_STRAGGLER, K.LATE_ARRIVAL}), frozenset({5}), grad_sync=GradSync.DISTRIBUTED),
)
_BY_KEY: dict[str | Fault, SeedCase] = {**{c.name: c for c in SEED_CASES}, **{c.fault: c for c in SEED_CASES}}


def seed_case(key: str | Fault) -> SeedCase:
    """The case named ``key`` (``case1`` ...) or of fault ``key``. Raises KeyError for another."""
    try:
        return _BY_KEY[key]
    except KeyError:
        raise KeyError(f"no seed case {key!r}; the cases are {', '.join(c.name for c in SEED_CASES)}") from None


def paper_case(fault: Fault, job_id: str | None = None, steps: int = 40, seed: int = 0) -> JobSpec:
    """The job of the case study of ``fault`` at the paper's layout (see the module's table)."""
    return seed_case(fault).spec(job_id, steps, seed)
