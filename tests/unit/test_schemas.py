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

from argus.errors import SchemaError
from schemas import available_schemas, codec
from schemas.records import KernelBatch
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


def test_kernel_columns_are_packed_little_endian() -> None:
    b = kernel_batch(n=4)
    avro = b.to_avro()
    assert avro["start_ns"] == np.asarray(b.start_ns, dtype="<i8").tobytes()
    assert len(avro["name_idx"]) == 4 * 4 and len(avro["step"]) == 4 * 4


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
    bad = dict(good, duration_ns=np.array([1, 2, 3], dtype="<i8").tobytes())
    with pytest.raises(SchemaError, match="column duration_ns"):
        KernelBatch.decode(codec("kernel_batch").encode(bad))
    bad = dict(good, names=["only-one"], name_idx=np.array([0, 1, 0, 0], dtype="<u4").tobytes())
    with pytest.raises(SchemaError, match="outside"):
        KernelBatch.decode(codec("kernel_batch").encode(bad))
    bad = dict(good, duration_ns=np.array([1, -2, 3, 4], dtype="<i8").tobytes())
    with pytest.raises(SchemaError, match="negative"):
        KernelBatch.decode(codec("kernel_batch").encode(bad))
    with pytest.raises(SchemaError, match="does not match"):
        codec("step").encode({"job_id": "x"})


def test_trailing_bytes_rejected() -> None:
    with pytest.raises(SchemaError, match="trailing"):
        KernelBatch.decode(kernel_batch().encode() + b"\x00")


def test_findings_written_with_schema_v1_still_decode_with_no_impact() -> None:
    from schemas.codec import codec
    from schemas.records import Finding, Level

    f = Finding(finding_id="x", job_id="j", level=Level.L3, kind="kernel_degraded", ranks=(3,), steps=(),
                score=0.4, evidence_json="{}", time_ns=5, kernel="gemm", stream=7, impact_ns_per_step=8.0,
                impact_ns=80.0)
    assert Finding.decode(f.encode()) == f  # written with the newest (v2)
    v1 = {k: v for k, v in f.to_avro().items() if not k.startswith("impact")}
    old = Finding.decode(codec("finding").encode(v1, version=1))
    assert (old.impact_ns, old.impact_ns_per_step, old.ranks, old.kernel) == (0.0, 0.0, (3,), "gemm")
