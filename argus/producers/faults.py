"""Fail-slow faults the simulator can inject: the five case studies of the ARGUS paper.

A :class:`FaultSpec` is generic: every factor multiplies the matching kernels of the listed ranks from
``onset_step`` on, whatever the :class:`Fault` label says. The class methods give the paper's defaults:
see docs/internals/producers.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from argus.producers.topology import groups_of, stage_ranks
from argus.schemas.records import JobTopology, ParallelGroup

__all__ = ["Fault", "FaultSpec"]

_MS = 1_000_000


class Fault(enum.Enum):
    """The paper's five fail-slow case studies."""

    COMPUTE_STRAGGLER = "COMPUTE_STRAGGLER"
    LINK_DEGRADATION = "LINK_DEGRADATION"
    PP_LAST_STAGE_SLOW = "PP_LAST_STAGE_SLOW"
    HOST_JIT_STALL = "HOST_JIT_STALL"
    COMPUTE_STRAGGLER_SHORT_COLLECTIVES = "COMPUTE_STRAGGLER_SHORT_COLLECTIVES"
    #: Liveness faults (not fail-slow): a hung collective, a rank that goes silent, a job without END.
    HANG = "HANG"
    SILENT_RANK = "SILENT_RANK"
    CRASH = "CRASH"
    #: All GPUs of one host slower alike (beyond the paper's cases).
    SLOW_HOST = "SLOW_HOST"


@dataclass(frozen=True)
class FaultSpec:
    """One injected fault.

    Attributes:
        fault: which case study this is (a label; the factors below do the work).
        ranks: global ranks the fault hits.
        onset_step: first step (0-based) the factors apply to.
        attention_factor: multiplies the compute kernels of self_attention sub-phases (forward and backward).
        mlp_factor: multiplies the compute kernels of mlp sub-phases (forward and backward).
        backward_factor: multiplies every backward compute kernel.
        all_reduce_factor, all_gather_factor, reduce_scatter_factor: multiply the transfer time of the
            collectives of that type in every group holding one of ``ranks``.
        stall_ns: host stall before each of ``stall_steps``, integer nanoseconds (the GPU idles meanwhile).
        stall_steps: steps preceded by a host stall (independent of ``onset_step``).
        hang_ns: ``HANG`` / ``SILENT_RANK``: how long the blocked ranks keep heartbeating, integer ns.
        resume: ``HANG``: whether the job resumes after ``hang_ns`` (else it goes quiet, without END).
    """

    fault: Fault
    ranks: tuple[int, ...]
    onset_step: int = 0
    attention_factor: float = 1.0
    mlp_factor: float = 1.0
    backward_factor: float = 1.0
    all_reduce_factor: float = 1.0
    all_gather_factor: float = 1.0
    reduce_scatter_factor: float = 1.0
    stall_ns: int = 0
    stall_steps: tuple[int, ...] = ()
    hang_ns: int = 0
    resume: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(sorted(set(self.ranks))))
        object.__setattr__(self, "stall_steps", tuple(sorted(set(self.stall_steps))))
        if not self.ranks or min(self.ranks) < 0:
            raise ValueError(f"fault {self.fault.value}: ranks must be non-empty and >= 0, got {self.ranks}")
        factors = (self.attention_factor, self.mlp_factor, self.backward_factor, self.all_reduce_factor,
                   self.all_gather_factor, self.reduce_scatter_factor)
        if min(factors) <= 0:
            raise ValueError(f"fault {self.fault.value}: factors must be > 0, got {factors}")
        if self.stall_ns < 0 or self.onset_step < 0 or self.hang_ns < 0:
            raise ValueError(f"fault {self.fault.value}: stall_ns, onset_step and hang_ns must be >= 0")

    @property
    def liveness(self) -> bool:
        """A liveness fault (hang, silent rank, crash) rather than a fail-slow one."""
        return self.fault in (Fault.HANG, Fault.SILENT_RANK, Fault.CRASH)

    def active(self, step: int) -> bool:
        """Whether the kernel factors apply at ``step``."""
        return step >= self.onset_step

    def stall_at(self, step: int) -> int:
        """Host stall before ``step`` on each of :attr:`ranks`, integer nanoseconds (0 if none)."""
        return self.stall_ns if step in self.stall_steps else 0

    def check(self, topology: JobTopology) -> None:
        """Raise :class:`ValueError` if a fault rank is outside ``topology``."""
        if max(self.ranks) >= topology.world_size:
            raise ValueError(f"fault {self.fault.value}: rank {max(self.ranks)} outside world_size "
                             f"{topology.world_size}")

    # -- the paper's cases ------------------------------------------------------------------------

    @classmethod
    def compute_straggler(cls, topology: JobTopology, rank: int = 5, onset_step: int = 15,
                          attention_factor: float = 25.0, mlp_factor: float = 20.0) -> FaultSpec:
        """Case 1: one rank's self_attention / mlp compute x25 / x20 from step 15."""
        spec = cls(Fault.COMPUTE_STRAGGLER, (rank,), onset_step, attention_factor=attention_factor,
                   mlp_factor=mlp_factor)
        spec.check(topology)
        return spec

    @classmethod
    def slow_host(cls, topology: JobTopology, host: str | None = None, factor: float = 1.3,
                  onset_step: int = 0) -> FaultSpec:
        """Every rank of ``host`` (default: the host of the job's last rank) runs its self_attention and mlp
        compute ``factor`` times slower from ``onset_step``. Raises ValueError for a host the job does not run on."""
        host = host if host is not None else topology.host[-1]
        ranks = tuple(r for r, h in zip(topology.rank, topology.host, strict=True) if h == host)
        if not ranks:
            raise ValueError(f"fault SLOW_HOST: no rank runs on host {host!r}")
        spec = cls(Fault.SLOW_HOST, ranks, onset_step, attention_factor=factor, mlp_factor=factor)
        spec.check(topology)
        return spec

    @classmethod
    def link_degradation(cls, topology: JobTopology, ranks: tuple[int, ...] = (4, 5, 6, 7),
                         all_reduce_factor: float = 8.0, all_gather_factor: float = 12.0,
                         reduce_scatter_factor: float = 20.0, onset_step: int = 0) -> FaultSpec:
        """Case 2: a group's collectives x8 (AllReduce) / x12 (AllGather) / x20 (ReduceScatter).

        Raises:
            ValueError: ``ranks`` is not a union of whole DP groups or of whole TP groups (a degraded link
                would then slow healthy members' collectives too).
        """
        spec = cls(Fault.LINK_DEGRADATION, ranks, onset_step, all_reduce_factor=all_reduce_factor,
                   all_gather_factor=all_gather_factor, reduce_scatter_factor=reduce_scatter_factor)
        spec.check(topology)
        wanted = set(spec.ranks)
        for kind in (ParallelGroup.DP, ParallelGroup.TP):
            groups = [set(m) for m in groups_of(topology, kind).values() if len(m) > 1]
            whole = all(g <= wanted or not g & wanted for g in groups)
            if groups and whole and any(g <= wanted for g in groups):
                return spec
        raise ValueError(f"link degradation ranks {spec.ranks} are not whole DP or TP groups of "
                         f"dp={topology.dp_size} tp={topology.tp_size} pp={topology.pp_size}")

    @classmethod
    def pp_last_stage_slow(cls, topology: JobTopology, backward_factor: float = 1.9,
                           onset_step: int = 0) -> FaultSpec:
        """Case 3: the last pipeline stage's backward compute x1.9. Raises ``ValueError`` if pp < 2."""
        if topology.pp_size < 2:
            raise ValueError("pp_last_stage_slow needs pp >= 2")
        ranks = tuple(stage_ranks(topology, topology.pp_size - 1))
        return cls(Fault.PP_LAST_STAGE_SLOW, ranks, onset_step, backward_factor=backward_factor)

    @classmethod
    def host_jit_stall(cls, topology: JobTopology, steps: tuple[int, ...] = (12, 27),
                       stall_ns: int = 80 * _MS) -> FaultSpec:
        """Case 4: a host-side stall (JIT compile) of ``stall_ns`` on every rank before ``steps``."""
        return cls(Fault.HOST_JIT_STALL, tuple(range(topology.world_size)), stall_ns=stall_ns,
                   stall_steps=steps)

    @classmethod
    def compute_straggler_short_collectives(cls, topology: JobTopology, ranks: tuple[int, ...] = (5,),
                                            mlp_factor: float = 3.0, onset_step: int = 0) -> FaultSpec:
        """Case 5: slow mlp compute; the straggler's ReduceScatter looks shorter than its peers'."""
        spec = cls(Fault.COMPUTE_STRAGGLER_SHORT_COLLECTIVES, ranks, onset_step, mlp_factor=mlp_factor)
        spec.check(topology)
        return spec

    # -- liveness faults --------------------------------------------------------------------------

    @classmethod
    def hang(cls, topology: JobTopology, rank: int = 5, step: int = 10, hang_ns: int = 20_000_000_000,
             resume: bool = True) -> FaultSpec:
        """``rank`` never enters a DP collective of ``step``; its DP peers block in it for ``hang_ns``.

        Raises:
            ValueError: ``rank`` is outside the topology or alone in its DP group.
        """
        spec = cls(Fault.HANG, (rank,), step, hang_ns=hang_ns, resume=resume)
        spec.check(topology)
        dp = topology.dp_group[topology.rank.index(rank)]
        if topology.dp_group.count(dp) < 2:
            raise ValueError(f"hang: rank {rank} has no DP peers (dp={topology.dp_size})")
        return spec

    @classmethod
    def silent_rank(cls, topology: JobTopology, rank: int = 5, step: int = 10,
                    hang_ns: int = 20_000_000_000) -> FaultSpec:
        """``rank`` publishes nothing from ``step``; the others complete it, then block for ``hang_ns``."""
        spec = cls(Fault.SILENT_RANK, (rank,), step, hang_ns=hang_ns, resume=False)
        spec.check(topology)
        return spec

    @classmethod
    def crash(cls, topology: JobTopology, step: int | None = None) -> FaultSpec:
        """The job stops before ``step`` (after its last step if ``None``) and never sends END."""
        spec = cls(Fault.CRASH, (0,), step if step is not None else 2**31 - 1, resume=False)
        spec.check(topology)
        return spec
