"""Hostile Kineto files: each is refused with a ProducerError naming the file and the event (or key), and never
crashes the interpreter, recurses without bound or takes memory out of proportion to the file."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tracemalloc
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from argus.core.errors import ProducerError
from argus.core.settings import Settings
from argus.producers import kineto_parse
from argus.producers.kineto import import_kineto
from argus.producers.kineto_groups import PhaseGroups
from argus.producers.kineto_parse import (
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_NUMBER_DIGITS,
    MAX_WORLD_SIZE,
    StreamPG,
    parse_rank,
    to_ns,
)
from argus.producers.topology import build_topology
from argus.schemas.records import ParallelGroup, PhaseKind
from tests.samples import RecordingPublisher

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000_000_000
HEAD = '{"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": ['
RAW = '"@raw@"'


def event(name: str, ts: Any = T0, cat: str = "kernel", raw: str = "", **args: Any) -> str:
    """One event as JSON text; the value ``RAW`` (in ``ts`` or an arg) is replaced by ``raw`` as written."""
    return json.dumps({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": 1, "args": {"stream": 7, **args}}
                      ).replace(RAW, raw)


def bad_event(field: str, name: str = "bad") -> str:
    """A kernel event whose ``ts`` is written as ``field`` (raw JSON text)."""
    return event(name, ts="@raw@", raw=field)


GOOD = event("good")


def trace(tmp_path: Path, *events: str, head: str = HEAD, tail: str = "]}", name: str = "rank0.json") -> Path:
    path = tmp_path / name
    path.write_text(head + ", ".join([GOOD, *events]) + tail)
    return path


def refused(path: Path, match: str, **kw: Any) -> ProducerError:
    with pytest.raises(ProducerError, match=match) as exc:
        parse_rank(path, spill_dir=path.parent, **kw).close()
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no spill file left
    return exc.value


# -- numbers --------------------------------------------------------------------------------------------


def test_an_integer_over_pythons_conversion_limit_is_refused_not_a_segfault(tmp_path: Path) -> None:
    # ijson's C backend dereferences the NULL of a failed int conversion (over 4,300 digits): the interpreter
    # dies with SIGSEGV, so the parse runs in a child process.
    path = trace(tmp_path, bad_event("9" * 5000))
    code = ("import sys; from pathlib import Path; from argus.core.errors import ProducerError\n"
            "from argus.producers.kineto_parse import parse_rank\n"
            "try:\n    parse_rank(Path(sys.argv[1])).close()\nexcept ProducerError as e:\n    print(e)\n")
    run = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert (f"rank0.json: refused: a number with more than {MAX_NUMBER_DIGITS} digits in a row, "
            f"in traceEvents[1] (name 'bad'), at byte ") in run.stdout


@pytest.mark.parametrize("field", ["-" + "1" * 200, "1." + "5" * 200, "1" * 101 + "e2", "0." + "0" * 150 + "1"])
def test_long_digit_runs_are_refused_in_any_part_of_a_number(tmp_path: Path, field: str) -> None:
    refused(trace(tmp_path, bad_event(field)), r"digits in a row, in traceEvents\[1\] \(name 'bad'\)")


def test_a_number_at_the_limit_and_long_digit_strings_are_fine(tmp_path: Path) -> None:
    digits = "9" * MAX_NUMBER_DIGITS
    path = trace(tmp_path, bad_event(digits), bad_event("1." + "0" * MAX_NUMBER_DIGITS, name="frac"),
                 bad_event("1", name="x" + "7" * 5000 + '\\"[[[' + "1e999999"))
    with parse_rank(path) as t:
        assert t.kernel_events == 3 and t.skipped["invalid_ts"] == 1  # 10^100 µs is no time


@pytest.mark.parametrize("field", ["1e999999999", "1E+" + "9" * 30, "-2.5e-" + "9" * 20, "1e00001"])
def test_huge_exponents_are_refused(tmp_path: Path, field: str) -> None:
    # Before: decimal.Overflow from the ns conversion, or decimal.InvalidOperation from the parser itself.
    refused(trace(tmp_path, bad_event(field)), r"rank0\.json: refused: a number with more than 4 exponent digits, "
                                                r"in traceEvents\[1\] \(name 'bad'\), at byte ")


def test_exponents_within_the_limit_are_out_of_range_times_skipped() -> None:
    assert to_ns(Decimal("1e9999")) is None and to_ns(Decimal("-1e9999")) is None
    assert to_ns(Decimal("1e-9999")) == 0 and to_ns(Decimal("1.5e3")) == 1_500_000


def test_a_huge_number_in_the_header_or_after_the_events_names_the_key(tmp_path: Path) -> None:
    head = '{"distributedInfo": {"rank": 0, "world_size": ' + "1" * 200 + '}, "traceEvents": ['
    refused(trace(tmp_path, head=head), r"digits in a row, in top-level key 'distributedInfo'")
    tail = '], "baseTimeNanoseconds": 1e77777777}'
    refused(trace(tmp_path, tail=tail), r"exponent digits, in top-level key 'baseTimeNanoseconds'")


def test_a_profiler_step_number_over_the_int_conversion_limit_is_skipped(tmp_path: Path) -> None:
    step = event("ProfilerStep#" + "9" * 5000, cat="user_annotation")
    with parse_rank(trace(tmp_path, step)) as t:
        assert t.steps == [] and t.skipped["invalid_step"] == 1


# -- nesting --------------------------------------------------------------------------------------------


def test_deep_nesting_after_the_events_is_refused_not_a_recursion_error(tmp_path: Path) -> None:
    tail = '], "distributedInfo": {"rank": 0, "deep": ' + "[" * 1000 + "]" * 1000 + "}}"
    head = '{"traceEvents": ['
    refused(trace(tmp_path, head=head, tail=tail),
            rf"rank0\.json: refused: nesting deeper than {MAX_DEPTH} levels, in top-level key 'distributedInfo'")


def test_deep_nesting_in_an_event_is_refused_in_little_memory(tmp_path: Path) -> None:
    # 10,000 levels: 60 KB, which took 250 MB of parser prefixes before (30,000: 2.2 GiB).
    deep = event("deep", cat="cpu_op", x="@raw@", raw="[" * 10_000 + "]" * 10_000)
    path = trace(tmp_path, deep)
    tracemalloc.start()
    try:
        err = refused(path, r"nesting deeper than 64 levels, in traceEvents\[1\] \(name 'deep'\)")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak
    assert "at byte" in str(err)


def test_nesting_at_the_limit_and_brackets_in_strings_are_fine(tmp_path: Path) -> None:
    def nested(levels: int) -> str:  # ``levels`` deep in all: object, traceEvents, event, args, dict, lists
        lists = json.loads("[" * (levels - 5) + "]" * (levels - 5))
        return event("ok", x={"s": "[[[{{{" * 200 + '\\"' + "]]" * 50, "v": lists})

    with parse_rank(trace(tmp_path, nested(MAX_DEPTH))) as t:
        assert t.kernel_events == 2
    refused(trace(tmp_path, nested(MAX_DEPTH + 1)), r"nesting deeper than 64 levels, in traceEvents\[1\] \(name 'ok'\)")


def test_a_bare_array_with_a_deep_event_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "rank3.json"
    path.write_text("[" + GOOD + ", " + GOOD + ', {"name": "k", "args": ' + "[" * 100 + "]" * 100 + "}]")
    refused(path, r"nesting deeper than 64 levels, in traceEvents\[2\] \(name 'k'\)")


# -- sizes ----------------------------------------------------------------------------------------------


def test_a_file_over_max_file_bytes_is_refused_counting_decompressed_bytes(tmp_path: Path) -> None:
    assert MAX_FILE_BYTES == 2 * 2**30
    pad = json.dumps({"ph": "i", "name": "x" * 1000})
    text = HEAD + ", ".join([GOOD] + [pad] * 2000) + "]}"  # 2 MB, 30 KB compressed
    path = tmp_path / "rank0.json.gz"
    path.write_bytes(gzip.compress(text.encode()))
    assert path.stat().st_size < 100_000
    refused(path, r"rank0\.json\.gz: refused: more than max_file_bytes=1,000,000 bytes \(after decompression",
            max_file_bytes=1_000_000)
    with parse_rank(path, max_file_bytes=len(text)) as t:
        assert t.kernel_events == 1


def test_a_string_over_the_limit_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kineto_parse, "MAX_STRING_BYTES", 4096)
    long = event("long", cat="cpu_op", s='ab\\"' * 1100)
    refused(trace(tmp_path, long), r"a string longer than 4,096 bytes, in traceEvents\[1\] \(name 'long'\)")
    fine = event("fine", cat="cpu_op", s="a" * 4096)
    with parse_rank(trace(tmp_path, fine)) as t:
        assert t.kernel_events == 1


def test_violations_across_chunk_boundaries_are_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kineto_parse, "_CHUNK", 7)  # every token split over several reads
    for field, match in [("9" * 150, "digits in a row"), ("3.0e+123456", "exponent digits")]:
        refused(trace(tmp_path, bad_event(field)), match + r", in traceEvents\[1\] \(name 'bad'\)")
    escaped = event('q\\"[', cat="cpu_op", s="\\\\", t='\\"{')
    with parse_rank(trace(tmp_path, escaped, bad_event("1e308", name="big"))) as t:
        assert t.kernel_events == 1 and t.skipped["invalid_ts"] == 1


# -- ranks ----------------------------------------------------------------------------------------------


def test_a_huge_rank_is_refused_before_any_job_is_built(tmp_path: Path) -> None:
    # Before: a MemoryError (or the OOM killer) building a 300-million-rank topology in the import.
    path = trace(tmp_path, head='{"distributedInfo": {"rank": 300000000}, "traceEvents": [')
    refused(path, r"rank0\.json: refused: rank 300,000,000 \(distributedInfo\.rank\) is outside the largest world "
                  r"size 1,048,576")
    trace(tmp_path, head='{"distributedInfo": {"rank": ' + str(MAX_WORLD_SIZE + 5) + '}, "traceEvents": [')
    out = RecordingPublisher()
    with pytest.raises(ProducerError, match=r"rank0\.json: refused: rank 1,048,581"):
        import_kineto(Settings(), tmp_path, "job", publisher=out)
    assert out.records == []


@pytest.mark.parametrize("info, name, match", [
    (f'{{"rank": 0, "world_size": {MAX_WORLD_SIZE + 1}}}', "rank0.json", r"world_size 1,048,577 is over"),
    ('{"rank": 4, "world_size": 4}', "rank0.json", r"rank 4 \(distributedInfo\.rank\) is outside world_size 4"),
    ("{}", f"rank{MAX_WORLD_SIZE}.json", r"rank 1,048,576 \(the rank in the file name\) is outside the largest"),
])
def test_ranks_and_world_sizes_out_of_bounds_are_refused(tmp_path: Path, info: str, name: str, match: str) -> None:
    head = '{"distributedInfo": ' + info + ', "traceEvents": ['
    refused(trace(tmp_path, head=head, name=name), match)


def test_the_largest_world_is_accepted(tmp_path: Path) -> None:
    info = {"rank": MAX_WORLD_SIZE - 1, "world_size": MAX_WORLD_SIZE}
    head = '{"distributedInfo": ' + json.dumps(info) + ', "traceEvents": ['
    with parse_rank(trace(tmp_path, head=head)) as t:
        assert (t.rank, t.world_size) == (MAX_WORLD_SIZE - 1, MAX_WORLD_SIZE)


def test_times_beyond_2_62_once_the_base_is_added_are_refused(tmp_path: Path) -> None:
    """A 349-byte trace whose base time and step times are near 2^62 ended the importer in an OverflowError."""
    near = (2**62 - 10**7) // 1000  # µs, just under 2^62 ns on the trace's own clock
    head = ('{"distributedInfo": {"rank": 0, "world_size": 1}, "baseTimeNanoseconds": '
            f'{2**62 - 10**6}, "traceEvents": [')
    step = json.dumps({"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": near, "dur": 5000})
    path = tmp_path / "rank0.json"
    path.write_text(head + ", ".join([step, event("k", ts=near + 1)]) + "]}")
    refused(path, "beyond 2\\^62 ns")
    # A kernel whose end alone passes 2^62 (its start and duration each under it), with no base.
    refused(trace(tmp_path, json.dumps({"ph": "X", "cat": "kernel", "name": "long", "ts": near, "dur": near,
                                        "args": {"stream": 7}})), "beyond 2\\^62 ns")


def test_a_trace_with_nothing_kept_is_an_error_not_an_empty_job(tmp_path: Path) -> None:
    """Every event out of range: nothing to import, said so with the reasons, instead of exit 0 and no job."""
    (tmp_path / "rank0.json").write_text(HEAD.replace('"world_size": 2', '"world_size": 1')
                                         + ", ".join([bad_event("1e300"), bad_event(str(2**62))]) + "]}")
    with pytest.raises(ProducerError, match=r"nothing to import.*invalid_ts 2"):
        import_kineto(Settings.load(env={}), tmp_path, "j", publisher=RecordingPublisher())


def _peak(fn: Any) -> int:
    """Peak bytes Python (and numpy) allocated while ``fn`` ran."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _gz_trace(path: Path, events: Any, world: int = 1) -> int:
    """Write a gzipped trace of ``events`` (JSON texts); returns its decompressed size, bytes."""
    body = ('{"distributedInfo": {"rank": 0, "world_size": ' + str(world) + '}, "traceEvents": ['
            + json.dumps({"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": T0, "dur": 10**9})
            + "".join("," + e for e in events) + "," + GOOD + "]}").encode()
    path.write_bytes(gzip.compress(body, 9))
    return len(body)


@pytest.mark.slow
def test_annotations_and_process_groups_keep_memory_in_proportion_to_the_input(tmp_path: Path) -> None:
    """1.07 MB gzipped of annotations took 2 GB, 138 KB gzipped of process-group rank lists 1.1 GB: kept
    memory is now a small multiple of the decompressed input (the budget: 20x, plus a fixed allowance)."""
    allowance = 32 << 20
    annotations = (json.dumps({"ph": "X", "cat": "user_annotation", "name": "forward", "ts": T0 + i, "dur": 1})
                   for i in range(60_000))
    size = _gz_trace(tmp_path / "rank0.json.gz", annotations)
    assert _peak(lambda: import_kineto(Settings(), tmp_path, "j", publisher=RecordingPublisher())) \
        < 20 * size + allowance
    (tmp_path / "rank0.json.gz").unlink()
    members = list(range(20_000))
    groups = (json.dumps({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": T0 + s, "dur": 1,
                          "args": {"stream": s, "Process Group Name": str(s), "Process Group Ranks": members}})
              for s in range(40))
    size = _gz_trace(tmp_path / "rank0.json.gz", groups, world=20_000)
    assert _peak(lambda: parse_rank(tmp_path / "rank0.json.gz", spill_dir=tmp_path).close()) < 20 * size + allowance


def test_an_import_over_its_memory_setting_is_refused_naming_the_file(tmp_path: Path) -> None:
    names = (json.dumps({"ph": "X", "cat": "user_annotation", "name": f"phase {i} " + "x" * 1000, "ts": T0 + i,
                         "dur": 1}) for i in range(3000))
    _gz_trace(tmp_path / "rank0.json.gz", names)
    out = RecordingPublisher()
    with pytest.raises(ProducerError, match=r"rank0\.json\.gz: refused: .* more than 2 MiB in memory "
                                            r"\(ARGUS_IMPORT_MAX_MEMORY_MB\)"):
        import_kineto(Settings(import_max_memory_mb=2), tmp_path, "j", publisher=out)
    assert out.records == []
    import_kineto(Settings(import_max_memory_mb=64), tmp_path, "j", publisher=out)  # within a larger budget
    assert out.records


@pytest.mark.slow
def test_a_world_whose_topology_exceeds_a_message_is_refused_before_publishing(tmp_path: Path) -> None:
    """A 200-byte file declaring rank 2^20 - 1 took 59.5 s and 1.66 GB and made a 25 MB topology record."""
    info = {"rank": MAX_WORLD_SIZE - 1, "world_size": MAX_WORLD_SIZE}
    trace(tmp_path, head='{"distributedInfo": ' + json.dumps(info) + ', "traceEvents": [')
    out = RecordingPublisher()
    with pytest.raises(ProducerError, match=r"topology of 1,048,576 ranks encodes to [\d,]+ bytes, over the "
                                            r"8,000,000-byte message limit"):
        import_kineto(Settings(), tmp_path, "j", publisher=out)
    assert out.records == []


def test_phase_groups_are_built_for_the_ranks_that_ask_only() -> None:
    """Groups were built for every rank of the world (4 dicts of a million entries for one traced rank)."""
    topo = build_topology("j", 1024, 4, 2)
    groups = PhaseGroups(topo)
    pg = StreamPG("0", "", tuple(r for r in topo.rank if topo.tp_group[r] == topo.tp_group[5]))
    assert groups.stream_group(5, pg) is ParallelGroup.TP
    [peer] = [r for r in topo.rank if topo.pp_group[r] == topo.pp_group[0] and topo.pp_stage[r] == 1]
    assert groups.phase(0, f"nccl:send 0->{peer}", PhaseKind.SEND_RECV, ParallelGroup.NONE) == (
        "nccl:send next", ParallelGroup.PP)
    assert len(groups._groups) == 3  # the DP and TP groups of rank 5 (tried in order), the PP group of rank 0
