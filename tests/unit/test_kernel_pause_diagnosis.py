"""A rank whose kernel records were paused for a stretch (argus control, sampling, a profiler) is missing data to
the diagnosis, never a fault: the simulated job, with one rank's kernels cut out of steps 8-19 as a pause
leaves them (the same batches, fewer events), gets no finding when healthy, and a real straggler on another
rank is still named with the same kinds as without the pause."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pytest

from argus.producers.faults import FaultSpec
from argus.producers.simulator import JobSimulator, JobSpec, SimRecord
from argus.schemas.records import KernelBatch, Record
from argus.streams.offline import diagnose_records

PAUSED, FROM, TO = 3, 8, 20


def paused(records: Iterable[SimRecord], rank: int, lo: int, hi: int) -> Iterator[Record]:
    """The records, ``rank``'s kernel events of steps ``[lo, hi)`` left out (its steps and phases kept)."""
    for r in records:
        rec = r.record
        if isinstance(rec, KernelBatch) and rec.rank == rank and len(rec):
            keep = ~((rec.step >= lo) & (rec.step < hi))
            if not keep.all():
                rec = KernelBatch(job_id=rec.job_id, rank=rec.rank, seq=rec.seq, names=rec.names,
                                  name_idx=rec.name_idx[keep], stream=rec.stream[keep], start_ns=rec.start_ns[keep],
                                  duration_ns=rec.duration_ns[keep], step=rec.step[keep], host=rec.host,
                                  dropped=rec.dropped, end_of_stream=rec.end_of_stream)
        yield rec


@pytest.mark.parametrize("seed", [0, 1])
def test_a_rank_paused_for_a_stretch_gives_no_finding(seed: int) -> None:
    spec = JobSpec(f"paused-{seed}", dp=8, steps=30, seed=seed)
    records = list(paused(JobSimulator(spec).records(), PAUSED, FROM, TO))
    cut = sum(len(r) for r in records if isinstance(r, KernelBatch) and r.rank == PAUSED)
    full = sum(len(r.record) for r in JobSimulator(spec).records()
               if isinstance(r.record, KernelBatch) and r.record.rank == PAUSED)
    assert cut < 0.7 * full  # the pause took a real share of the rank's kernels
    assert diagnose_records(records) == {spec.job_id: []}


def test_a_real_fault_is_still_named_beside_a_paused_rank() -> None:
    base = JobSpec("fault", dp=8, steps=30, seed=0)
    spec = JobSpec("fault", dp=8, steps=30, seed=0,
                   fault=FaultSpec.compute_straggler(JobSimulator(base).topology(), rank=5, onset_step=5))
    with_pause = diagnose_records(paused(JobSimulator(spec).records(), PAUSED, FROM, TO))["fault"]
    without = diagnose_records(r.record for r in JobSimulator(spec).records())["fault"]
    assert {(f.level, f.kind, f.ranks) for f in with_pause} == {(f.level, f.kind, f.ranks) for f in without}
    assert {r for f in with_pause for r in f.ranks} == {5}
