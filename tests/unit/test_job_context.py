"""The job context shared between workers: conversions both ways, the merged rank aggregate, and the
table's keys and tombstones (the thread itself runs against the broker in tests/integration)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from argus.core.errors import ConfigError, SchemaError
from argus.core.settings import Settings
from argus.detectors.impact import StepClock
from argus.detectors.l3_ranks import KernelTotals
from argus.schemas import available_schemas, codec
from argus.schemas.job_context import CONTEXT_JOB_PART, JobContext, merge_context, split_context
from argus.schemas.records import ParallelGroup
from argus.streams.diagnosis import RankDiagnosis
from argus.streams.diagnosis_stats import DiagnosisStats
from argus.streams.job_context import (
    ContextPieces,
    ContextTable,
    context_clock,
    context_groups,
    context_key,
    context_messages,
    context_topology,
    context_totals,
    job_context,
    totals_context,
)
from tests.samples import samples


def test_the_job_agents_context_round_trips() -> None:
    topo = samples()["job_topology"]
    clock = StepClock((10, 20, 30), 10.0)
    ctx = job_context(topo.job_id, 99, topo, {17: ParallelGroup.TP, 7: ParallelGroup.DP}, {3, 1}, clock, True)
    back = JobContext.decode(ctx.encode())
    assert back.part == CONTEXT_JOB_PART and back.final and back.stragglers == (1, 3)
    assert context_topology(back) == topo and context_clock(back) == clock
    assert context_groups(back) == {7: ParallelGroup.DP, 17: ParallelGroup.TP}
    # Onsets and routed tokens (v3) travel too: the L3 parts elsewhere judge impacts and grouped GEMMs alike.
    rich = StepClock((10, 20, 30), 10.0, onsets=((3, 20),), expert_tokens=((0, 500), (1, 900)))
    moe = JobContext.decode(job_context("j", 1, None, {}, (), rich, False).encode())
    assert context_clock(moe) == rich
    empty = job_context("j", 0, None, {}, (), None, False)
    assert context_topology(empty) is None and context_clock(empty) is None and context_groups(None) == {}


def test_part_totals_round_trip_and_merge_into_the_jobs_rank_aggregate() -> None:
    a = [KernelTotals("gemm", 7, {0: 10.0, 1: 12.0}, {0: 2.0, 1: 2.0}), KernelTotals("ln", 7, {0: 1.0}, {0: 1.0})]
    b = [KernelTotals("gemm", 7, {0: 5.0, 2: 6.0}, {0: 1.0, 2: 1.0})]
    ctx_a = JobContext.decode(totals_context("j", 0, 50, a).encode())
    ctx_b = JobContext.decode(totals_context("j", 1, 70, b).encode())
    assert ctx_a.part == "l3/0" and context_totals(ctx_a) == sorted(a, key=lambda t: (t.kernel, t.stream))
    merged = RankDiagnosis("j")
    merged.add_totals(context_totals(ctx_a), ctx_a.time_ns)
    merged.add_totals(context_totals(ctx_b), ctx_b.time_ns)
    gemm = {(t.kernel, t.stream): t for t in merged.totals()}[("gemm", 7)]
    assert gemm.total_ns == {0: 15.0, 1: 12.0, 2: 6.0} and gemm.calls == {0: 3.0, 1: 2.0, 2: 1.0}
    assert merged.last_time_ns == 70


def test_the_table_keeps_the_newest_per_part_forgets_on_tombstones_and_is_bounded() -> None:
    table = ContextTable(Settings(), max_jobs=2)
    job = job_context("a/b", 1, None, {}, (), None, False)  # a job id with a slash
    table._take(context_key("a/b", CONTEXT_JOB_PART), job.encode())
    table._take(context_key("a/b", "l3/3"), totals_context("a/b", 3, 5, []).encode())
    assert set(table.get("a/b")) == {"job", "l3/3"}
    table._take(context_key("a/b", "l3/3"), None)
    assert set(table.get("a/b")) == {"job"}
    table._take(context_key("x", "job"), b"not a context")  # logged, ignored
    for j in ("c", "d"):
        table.put(job_context(j, 1, None, {}, (), None, False))
    assert table.get("a/b") == {} and set(table.get("d")) == {"job"}


# -- a part split into bounded messages (v4) ---------------------------------------------------------------------

_ints = st.integers(0, 2**31 - 1)
_times = st.integers(0, 2**62 - 1)


@st.composite
def contexts(draw: st.DrawFn) -> JobContext:
    """Any valid part: a topology's bytes, every sequence, totals with or without medians and moves."""
    n_entries = draw(st.integers(0, 4))
    rows = draw(st.lists(st.integers(0, 40), min_size=n_entries, max_size=n_entries))
    n_rows = sum(rows)
    medians, moves = draw(st.booleans()), draw(st.booleans())
    doubles = st.floats(allow_nan=False, allow_infinity=False, width=64)
    n_groups, n_onsets, n_tokens = (draw(st.integers(0, 30)) for _ in range(3))
    return JobContext(
        job_id=draw(st.sampled_from(["j", "a/b", "job-é"])),
        part=draw(st.sampled_from([CONTEXT_JOB_PART, "l3/0", "l3/13"])),
        time_ns=draw(_times),
        topology=draw(st.none() | st.binary(max_size=3000)),
        group_streams=tuple(draw(st.lists(st.integers(0, 2**40), min_size=n_groups, max_size=n_groups))),
        group_kinds=tuple(draw(st.lists(st.sampled_from(ParallelGroup), min_size=n_groups, max_size=n_groups))),
        stragglers=tuple(draw(st.lists(_ints, max_size=50))),
        step_starts_ns=tuple(draw(st.lists(_times, max_size=60))),
        median_step_ns=draw(doubles), final=draw(st.booleans()),
        totals_kernel=tuple(draw(st.lists(st.text(min_size=1, max_size=30), min_size=n_entries, max_size=n_entries,
                                          unique=True))),
        totals_stream=tuple(draw(st.lists(st.integers(0, 99), min_size=n_entries, max_size=n_entries))),
        totals_rows=tuple(rows),
        totals_rank=tuple(draw(st.lists(_ints, min_size=n_rows, max_size=n_rows))),
        totals_ns=tuple(draw(st.lists(doubles, min_size=n_rows, max_size=n_rows))),
        totals_calls=tuple(draw(st.lists(doubles, min_size=n_rows, max_size=n_rows))),
        totals_median_ns=tuple(draw(st.lists(doubles, min_size=n_rows, max_size=n_rows))) if medians else (),
        totals_moved_calls=tuple(draw(st.lists(doubles, min_size=n_rows, max_size=n_rows))) if moves else (),
        totals_moved_of=tuple(draw(st.lists(doubles, min_size=n_rows, max_size=n_rows))) if moves else (),
        onset_rank=tuple(draw(st.lists(_ints, min_size=n_onsets, max_size=n_onsets))),
        onset_ns=tuple(draw(st.lists(_times, min_size=n_onsets, max_size=n_onsets))),
        token_rank=tuple(draw(st.lists(_ints, min_size=n_tokens, max_size=n_tokens))),
        tokens=tuple(draw(st.lists(st.integers(0, 2**62), min_size=n_tokens, max_size=n_tokens))))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ctx=contexts(), max_bytes=st.integers(500, 4000), generation=st.integers(1, 2**63 - 1), data=st.data())
def test_any_split_read_in_any_order_with_copies_joins_into_the_same_part(
        ctx: JobContext, max_bytes: int, generation: int, data: st.DataObject) -> None:
    pieces = split_context(ctx, max_bytes, generation)
    wire = [p.encode() for p in pieces]
    assert all(len(w) <= max_bytes for w in wire)  # never over the bound
    want = replace(ctx, generation=generation)
    # At least once: every piece once, some twice, in any order; the part appears exactly when the last one
    # is read, and copies read after it change nothing.
    order = data.draw(st.permutations(range(len(wire))))
    copies = data.draw(st.lists(st.integers(0, len(wire) - 1), max_size=len(wire) + 2))
    reads = data.draw(st.permutations([*order, *copies]))
    joiner, table = ContextPieces(), ContextTable(Settings(), max_jobs=4)
    seen: set[int] = set()
    for i in reads:
        got = joiner.take(JobContext.decode(wire[i]))
        table._take(context_key(ctx.job_id, ctx.part, i), wire[i])
        first_complete = i not in seen and len(seen) == len(wire) - 1
        seen.add(i)
        assert got == (want if first_complete else None)
        assert table.get(ctx.job_id).get(ctx.part) == (want if len(seen) == len(wire) else None)
        assert joiner.incomplete(ctx.job_id) == ({} if len(seen) == len(wire) else {ctx.part: (len(seen), len(wire))})
    assert merge_context([JobContext.decode(w) for w in reversed(wire)]) == want


def _stamped(ctx: JobContext, max_bytes: int) -> tuple[JobContext, list[JobContext]]:
    whole, msgs = context_messages(ctx, max_bytes, partitions=8)
    assert len({p for _, _, p in msgs}) == 1 and msgs[0][0] == context_key(ctx.job_id, ctx.part)
    return whole, [JobContext.decode(v) for _, v, _ in msgs]


def test_a_newer_write_replaces_the_part_only_once_complete_and_older_pieces_never_come_back() -> None:
    a = totals_context("j", 2, 10, [KernelTotals("gemm", 7, {r: float(r) for r in range(300)}, {})])
    b = replace(a, time_ns=20, totals_ns=tuple(2.0 * r for r in range(300)))
    stats = DiagnosisStats()
    joiner = ContextPieces(stats)
    whole_a, pieces_a = _stamped(a, 2000)
    whole_b, pieces_b = _stamped(b, 2000)
    assert len(pieces_a) == len(pieces_b) > 2 and whole_a.generation != whole_b.generation
    for p in pieces_a:
        joiner.take(p)
    for p in pieces_b[:-1]:  # b partly read: a stays the part, b is counted as being assembled
        assert joiner.take(p) is None
    assert stats.context_parts_incomplete == 1 and joiner.incomplete("j") == {"l3/2": (len(pieces_b) - 1,
                                                                                       len(pieces_b))}
    assert joiner.take(pieces_b[-1]) == whole_b and stats.context_parts_incomplete == 0
    assert all(joiner.take(p) is None for p in pieces_a)  # re-read copies of a: already taken
    # A write that never completed (its writer died part way) is dropped, counted, once a newer one is in.
    c = replace(a, time_ns=30)
    _, pieces_c = _stamped(c, 2000)
    whole_d, pieces_d = _stamped(replace(a, time_ns=40), 2000)
    joiner.take(pieces_c[0])
    assert [joiner.take(p) for p in pieces_d][-1] == whole_d
    assert stats.context_generations_dropped == 1 and stats.context_parts_incomplete == 0


def test_the_writers_own_part_is_known_at_once_and_its_read_back_changes_nothing() -> None:
    table = ContextTable(Settings(), max_jobs=4)
    old = job_context("j", 1, None, {}, (1,), None, False)
    new = job_context("j", 2, None, {}, (1, 2), None, False)
    whole_old, pieces_old = _stamped(old, 20_000)
    whole_new, _ = _stamped(new, 20_000)
    table.put(whole_old)
    table.put(whole_new)
    for p in pieces_old:  # the older write read back after the newer was put here: still the newer
        table.put(p)
    assert table.get("j")["job"] == whole_new
    # The writer keeps its part as soon as its pieces are sent, while its reader may have read some of them
    # already: the whole is that same write, and the pieces read before or after it change nothing.
    stats = DiagnosisStats()
    racing = ContextTable(Settings(), max_jobs=4, stats=stats)
    big = totals_context("j", 1, 5, [KernelTotals("gemm", 7, {r: 1.0 for r in range(3000)}, {})])
    whole, msgs = context_messages(big, 16_384, 4)
    assert len(msgs) > 2
    racing.put(JobContext.decode(msgs[1][1]))
    assert racing.incomplete("j") == {"l3/1": (1, len(msgs))} and stats.context_parts_incomplete == 1
    racing.put(whole)
    for _, value, _ in msgs:
        racing.put(JobContext.decode(value))
    assert racing.get("j")["l3/1"] == whole and racing.incomplete("j") == {}
    assert (stats.context_parts_incomplete, stats.context_generations_dropped) == (0, 0)
    # Parts written before v4 (generation 0, one message) are taken whenever read, as before.
    table.put(old)
    table.put(new)
    assert table.get("j")["job"] == new


def test_a_102400_rank_jobs_totals_and_topology_fit_the_default_message_size() -> None:
    n = 102_400
    big = totals_context("j", 0, 1, [KernelTotals(k, 7, dict.fromkeys(range(n), 1.5e9), dict.fromkeys(range(n), 480.0),
                                                  dict.fromkeys(range(n), 1.4e9)) for k in ("gemm", "allreduce")])
    assert len(big.encode()) > Settings().context_max_bytes
    whole, msgs = context_messages(big, Settings().context_max_bytes, 4)
    assert len(msgs) > 1 and all(len(v) <= Settings().context_max_bytes for _, v, _ in msgs)
    assert merge_context([JobContext.decode(v) for _, v, _ in msgs]) == whole
    assert context_totals(whole) == context_totals(big)


def test_pieces_tombstones_and_bounds() -> None:
    table = ContextTable(Settings(), max_jobs=4)
    ctx = totals_context("a/b", 3, 5, [KernelTotals("gemm", 7, {r: 1.0 for r in range(2000)}, {})])
    whole, msgs = context_messages(ctx, 16_384, Settings().partitions)
    for key, value, _ in msgs:
        table._take(key, value)
    assert table.get("a/b")["l3/3"] == whole and len(msgs) > 1
    tombs = table.tombstones("a/b", ["l3/3", "job"])
    assert [k for k, _ in tombs] == [context_key("a/b", "l3/3", i) for i in range(len(msgs))] + [b"a/b/job"]
    assert {p for _, p in tombs[:-1]} == {msgs[0][2]}
    table._take(tombs[1][0], None)  # a piece's tombstone forgets the part too
    assert table.get("a/b") == {}
    with pytest.raises(SchemaError, match="do not hold"):
        split_context(ctx, 50, 1)
    with pytest.raises(SchemaError, match="does not fit"):
        split_context(replace(ctx, totals_kernel=("k" * 500,)), 400, 1)
    with pytest.raises(SchemaError, match="not 0"):
        merge_context(split_context(ctx, 2000, 1)[1:])
    with pytest.raises(ConfigError, match="context_max_bytes"):
        Settings(context_max_bytes=9_000_000).validate()


def test_a_part_written_before_v4_decodes_as_one_whole_piece() -> None:
    ctx = job_context("j", 1, None, {5: ParallelGroup.TP}, (3,), StepClock((10, 20), 10.0), True)
    fields = json.loads(available_schemas()["job_context"][3].read_text())["fields"]
    v3 = codec("job_context").encode({f["name"]: ctx.to_avro()[f["name"]] for f in fields}, version=3)
    back = JobContext.decode(v3)
    assert back == ctx and (back.generation, back.piece, back.pieces, back.totals_continued) == (0, 0, 1, False)
