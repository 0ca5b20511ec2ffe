"""Round trip, backward compatibility and documentation rules of every Avro schema."""

from __future__ import annotations

import copy
import io
import json
import re
from pathlib import Path

import fastavro
import numpy as np
import pytest

from argus.core.errors import SchemaError
from argus.schemas import available_schemas, codec
from argus.schemas.column_packing import HEADER_BYTES, PackMethod, pack_column
from argus.schemas.records import KernelBatch
from tests.samples import kernel_batch, samples

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"
NAMES = sorted(available_schemas())


def test_every_schema_has_a_sample() -> None:
    assert sorted(samples()) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_round_trip(name: str) -> None:
    rec = samples()[name]
    again = type(rec).decode(rec.encode())
    assert again.to_avro() == rec.to_avro()


@pytest.mark.parametrize("name", NAMES)
def test_golden_messages_still_decode(name: str) -> None:
    """Messages written by earlier releases (checked in as bytes) must decode with today's schemas."""
    for path in sorted(GOLDEN.glob(f"{name}.v*.bin")):
        rec = samples()[name]
        assert type(rec).decode(path.read_bytes()).to_avro() == rec.to_avro(), path.name
    assert list(GOLDEN.glob(f"{name}.v*.bin")), f"no golden message for {name}"


@pytest.mark.parametrize("name", NAMES)
def test_added_field_with_default_is_backward_compatible(name: str) -> None:
    """A v1 message read with a hypothetical v2 that adds a defaulted field resolves to the default."""
    c = codec(name)
    v1 = json.loads(next(iter(available_schemas()[name].values())).read_text())
    v2 = copy.deepcopy(v1)
    v2["fields"].append({"name": "added_in_v2", "type": ["null", "string"], "default": None, "doc": "test"})
    payload = c.encode(samples()[name].to_avro())
    out = fastavro.schemaless_reader(io.BytesIO(payload[2:]), c.versions[1], fastavro.parse_schema(v2))
    assert isinstance(out, dict) and out["added_in_v2"] is None


@pytest.mark.parametrize("name", NAMES)
def test_every_field_documented_with_unit(name: str) -> None:
    for path in available_schemas()[name].values():
        schema = json.loads(path.read_text())
        assert schema.get("doc")
        for f in schema["fields"]:
            assert f.get("doc"), f"{path.name}: field {f['name']} has no doc"
            if f["name"].endswith("_ns"):
                assert re.search(r"nanosecond", f["doc"]), f"{path.name}: {f['name']} doc must give the unit"


def test_kernel_columns_are_packed_and_v1_messages_still_decode() -> None:
    b = kernel_batch(n=4)
    avro = b.to_avro()
    assert avro["packed"] and avro["start_ns"][0] == PackMethod.GAP and avro["step"][0] == PackMethod.OFFSET
    assert len(avro["name_idx"]) == HEADER_BYTES + 4 * avro["name_idx"][1]
    # A v1 message (plain little-endian arrays, no ``packed`` field) reads as the same batch.
    v1 = {k: v for k, v in avro.items() if k not in ("packed", *KernelBatch.GRAPH_COLUMNS)}
    v1.update({c: np.asarray(getattr(b, c), dtype=d).tobytes() for c, d in KernelBatch.COLUMNS.items()})
    payload = codec("kernel_batch").encode(v1, version=1)
    assert payload[1] == 1 and len(payload) > len(b.encode())
    old = KernelBatch.decode(payload)
    for c, d in KernelBatch.COLUMNS.items():
        assert getattr(old, c).dtype == np.dtype(d) and np.array_equal(getattr(old, c), getattr(b, c))


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", "magic"),
        (b"{}", "magic"),
        (b"\xa7\x09", "unknown schema version"),
        (b"\xa7\x01\x02", "corrupt"),
    ],
)
def test_malformed_payloads_raise_schema_error(payload: bytes, reason: str) -> None:
    with pytest.raises(SchemaError, match=reason):
        KernelBatch.decode(payload)


def test_semantic_checks() -> None:
    good = kernel_batch(n=4).to_avro()
    bad = dict(good, duration_ns=pack_column([1, 2, 3]))
    with pytest.raises(SchemaError, match="column duration_ns"):
        KernelBatch.decode(codec("kernel_batch").encode(bad))
    bad = dict(good, names=["only-one"], name_idx=pack_column([0, 1, 0, 0]))
    with pytest.raises(SchemaError, match="outside"):
        KernelBatch.decode(codec("kernel_batch").encode(bad))
    bad = dict(good, name_idx=pack_column([0, 2**32, 0, 0]))
    with pytest.raises(SchemaError, match="name_idx: value 4294967296 outside <u4"):
        KernelBatch.decode(codec("kernel_batch").encode(bad))
    bad = dict(good, duration_ns=pack_column([1, -2, 3, 4]))
    with pytest.raises(SchemaError, match="duration_ns value -2 outside"):
        KernelBatch.decode(codec("kernel_batch").encode(bad))
    with pytest.raises(SchemaError, match="does not match"):
        codec("step").encode({"job_id": "x"})


def test_trailing_bytes_rejected() -> None:
    with pytest.raises(SchemaError, match="trailing"):
        KernelBatch.decode(kernel_batch().encode() + b"\x00")


def test_findings_of_older_schemas_decode_with_no_impact_no_detector_version_no_hosts_no_incident() -> None:
    from argus.schemas.codec import codec
    from argus.schemas.records import Finding, Level

    f = Finding(finding_id="x", job_id="j", level=Level.L3, kind="kernel_degraded", ranks=(3,), steps=(),
                score=0.4, evidence_json="{}", time_ns=5, kernel="gemm", stream=7, impact_ns_per_step=8.0,
                impact_ns=80.0, detector_version="0.1.0+0123456789ab", hosts=("node0000",), incident_id="lead",
                gpus=("GPU-1",))
    assert codec("finding").latest == 4
    assert Finding.decode(f.encode()) == f  # written with the newest (v4)
    assert f.incident == "lead"
    v3 = {k: v for k, v in f.to_avro().items() if k not in ("hosts", "incident_id", "gpus")}
    old3 = Finding.decode(codec("finding").encode(v3, version=3))
    assert (old3.hosts, old3.incident_id, old3.gpus, old3.detector_version) == ((), "", (), f.detector_version)
    assert old3.incident == "x"  # a finding written before incidents is its own incident
    v2 = {k: v for k, v in v3.items() if k != "detector_version"}
    old2 = Finding.decode(codec("finding").encode(v2, version=2))
    assert (old2.impact_ns, old2.detector_version, old2.hosts, old2.incident) == (80.0, "", (), "x")
    v1 = {k: v for k, v in v2.items() if not k.startswith("impact")}
    old = Finding.decode(codec("finding").encode(v1, version=1))
    assert (old.impact_ns, old.impact_ns_per_step, old.ranks, old.kernel) == (0.0, 0.0, (3,), "gemm")
    assert (old.detector_version, old.hosts, old.incident_id) == ("", (), "")


def test_finding_hosts_must_be_sorted_distinct_names() -> None:
    from argus.schemas.records import Finding, Level

    for hosts in (("b", "a"), ("a", "a"), ("",)):
        bad = Finding(finding_id="x", job_id="j", level=Level.L3, kind="rank_degraded", ranks=(3,), steps=(),
                      score=0.4, evidence_json="{}", time_ns=5, hosts=hosts)
        with pytest.raises(SchemaError, match="hosts must be distinct, sorted"):
            Finding.decode(bad.encode())  # a reader refuses it


def test_lifecycle_abandoned_round_trips_and_old_versions_decode_with_defaults() -> None:
    """v4 adds ABANDONED with ``reason`` and ``last_step``; v1-v3 messages decode with ``""`` and ``-1``."""
    from argus.schemas.records import JobLifecycle, LifecycleEvent

    ab = JobLifecycle("j", LifecycleEvent.ABANDONED, 5, 32, source="streams", reason="idle 600 s", last_step=41)
    assert JobLifecycle.decode(ab.encode()) == ab
    c = codec("job_lifecycle")
    assert c.latest == 4
    end = JobLifecycle("j", LifecycleEvent.END, 5, 32, steps=10)
    for version in (1, 2, 3):
        fields = {f["name"] for f in json.loads(available_schemas()["job_lifecycle"][version].read_text())["fields"]}
        old = JobLifecycle.decode(c.encode({k: v for k, v in end.to_avro().items() if k in fields}, version=version))
        steps = 10 if version > 1 else None  # v1 had no step count
        assert (old.event, old.reason, old.last_step, old.steps) == (LifecycleEvent.END, "", -1, steps)
    with pytest.raises(SchemaError):  # an older schema has no ABANDONED symbol
        c.encode(ab.to_avro(), version=3)
    with pytest.raises(SchemaError, match="last_step"):
        JobLifecycle.decode(c.encode(dict(ab.to_avro(), last_step=-2)))


def test_heartbeat_round_trip_idle_and_in_flight() -> None:
    from argus.schemas.records import Heartbeat, ParallelGroup, PhaseKind

    idle = Heartbeat("j", 3, 10)
    assert Heartbeat.decode(idle.encode()) == idle
    assert (idle.step, idle.phase, idle.phase_kind, idle.collective, idle.seq, idle.in_flight_since_ns) == (
        -1, "", None, None, -1, -1) and not idle.in_flight
    busy = Heartbeat("j", 3, 10, 7, "dp-allreduce", PhaseKind.ALL_REDUCE, PhaseKind.ALL_REDUCE, ParallelGroup.DP,
                     2, 9, 4)
    assert Heartbeat.decode(busy.encode()) == busy and busy.in_flight
    with pytest.raises(SchemaError, match="not a collective"):
        Heartbeat("j", 3, 10, collective=PhaseKind.FORWARD).check()
    with pytest.raises(SchemaError, match="seq"):
        Heartbeat.decode(Heartbeat("j", 3, 10, seq=-2).encode())


def test_heartbeats_are_stored_in_their_table() -> None:
    from argus.schemas.records import Heartbeat
    from argus.sinks.tables import TABLE_OF_TOPIC, rows_to_arrow
    from argus.topics import RECORD_OF, Topic

    table = TABLE_OF_TOPIC[Topic.HEARTBEATS]
    assert RECORD_OF[Topic.HEARTBEATS] is Heartbeat and table.name == "heartbeats"
    rows = list(table.rows(samples()["heartbeat"])) + list(table.rows(Heartbeat("j", 0, 1)))
    arrow = rows_to_arrow(table, rows)
    assert arrow.column("collective").to_pylist() == ["ALL_REDUCE", ""]
    assert arrow.column("in_flight_since_ns").to_pylist()[1] == -1
    assert table.order_by == ("job_id", "rank", "time_ns")
