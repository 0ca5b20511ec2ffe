"""Avro encoding of argus records on Kafka.

Wire format of every argus message value: one magic byte ``0xA7``, one byte with the writer's schema
version, then the Avro *schemaless* binary body. Readers resolve the writer's version against the newest
schema they know (Avro schema resolution), so old messages stay readable after a schema evolves — this is
what lets a postmortem replay a topic written months ago. There is no schema registry to run.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import fastavro

from argus.core.errors import SchemaError

__all__ = ["MAGIC", "SCHEMA_DIR", "AvroCodec", "available_schemas", "codec"]

MAGIC = 0xA7
SCHEMA_DIR = Path(__file__).resolve().parent
_FILE = re.compile(r"^(?P<name>[a-z_]+)\.v(?P<version>\d+)\.avsc$")


def available_schemas() -> dict[str, dict[int, Path]]:
    """Every ``<name>.v<N>.avsc`` in the schema folder, as ``{name: {version: path}}``."""
    found: dict[str, dict[int, Path]] = {}
    for path in sorted(SCHEMA_DIR.glob("*.avsc")):
        m = _FILE.match(path.name)
        if m is None:
            raise SchemaError(f"schema file name must be <name>.v<N>.avsc: {path.name}")
        found.setdefault(m["name"], {})[int(m["version"])] = path
    return found


@dataclass(frozen=True)
class AvroCodec:
    """Encoder/decoder of one record type, across all of its schema versions."""

    name: str
    versions: dict[int, Any]

    @property
    def latest(self) -> int:
        return max(self.versions)

    def encode(self, record: dict[str, Any], version: int | None = None) -> bytes:
        """Encode ``record`` with the newest schema (or ``version``).

        Raises:
            SchemaError: the record does not match the schema.
        """
        v = self.latest if version is None else version
        buf = io.BytesIO()
        buf.write(bytes((MAGIC, v)))
        try:
            fastavro.schemaless_writer(buf, self.versions[v], record, strict_allow_default=True)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            raise SchemaError(f"{self.name}.v{v}: record does not match schema: {exc}") from exc
        return buf.getvalue()

    def decode(self, payload: bytes) -> dict[str, Any]:
        """Decode a message value written with any known version of this schema.

        Raises:
            SchemaError: wrong magic byte, unknown version, or a truncated/corrupt body.
        """
        if len(payload) < 2 or payload[0] != MAGIC:
            raise SchemaError(f"{self.name}: not an argus Avro message (missing magic byte 0xA7)")
        v = payload[1]
        writer = self.versions.get(v)
        if writer is None:
            raise SchemaError(f"{self.name}: unknown schema version {v} (known: {sorted(self.versions)})")
        buf = io.BytesIO(payload)
        buf.seek(2)
        try:
            out = fastavro.schemaless_reader(buf, writer, self.versions[self.latest])
        except (EOFError, ValueError, TypeError, IndexError, KeyError, UnicodeDecodeError, OverflowError,
                MemoryError) as exc:
            raise SchemaError(f"{self.name}.v{v}: corrupt body: {exc}") from exc
        if buf.tell() != len(payload):
            raise SchemaError(f"{self.name}.v{v}: {len(payload) - buf.tell()} trailing bytes after the record")
        if not isinstance(out, dict):
            raise SchemaError(f"{self.name}.v{v}: body is not a record")
        return out


@cache
def codec(name: str) -> AvroCodec:
    """The codec of record type ``name`` (e.g. ``"kernel_batch"``), loading every version of it.

    Raises:
        SchemaError: no such schema, or a schema file that does not parse.
    """
    files = available_schemas().get(name)
    if not files:
        raise SchemaError(f"no schema named {name!r}")
    versions: dict[int, Any] = {}
    for v, path in files.items():
        try:
            versions[v] = fastavro.parse_schema(json.loads(path.read_text()))
        except (ValueError, fastavro.schema.SchemaParseException) as exc:
            raise SchemaError(f"{path.name}: invalid Avro schema: {exc}") from exc
    return AvroCodec(name, versions)
