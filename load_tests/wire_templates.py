"""Argus messages built from pre-encoded pieces, for benchmarks that must publish faster than records encode.

A :class:`WireTemplate` is one record's Avro message cut around the fields that change from message to message
(longs, ints, arrays of longs): a message is then the template's constant bytes joined with those fields'
encodings (:func:`avro_long`, :func:`avro_longs`), byte for byte what ``Record.encode`` writes for the same
values (:meth:`WireTemplate.check` compares them). A 10,240-rank job sends 20,480 Step and PhaseBatch
messages per step: encoding them as records costs seconds a step here, joining them tens of milliseconds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["WireTemplate", "avro_long", "avro_longs"]

#: One sentinel per varying field: large negative longs whose encodings (9 bytes) do not occur by chance.
_SENTINEL = -(2**61) - 987_654_321


def avro_long(value: int) -> bytes:
    """Avro's encoding of an int or long: zigzag, then 7 bits a byte, low first."""
    n = (value << 1) ^ (value >> 63)
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def avro_longs(values: Iterable[int]) -> bytes:
    """Avro's encoding of an array of ints or longs: one block (its count, the items), then the end (0)."""
    items = [avro_long(v) for v in values]
    return avro_long(len(items)) + b"".join(items) + b"\x00" if items else b"\x00"


class WireTemplate:
    """``record``'s message with ``varying`` fields (ints/longs, or arrays of them) left open.

    Raises:
        ValueError: a field's encoding could not be found exactly once in the message.
    """

    def __init__(self, record: Any, varying: Sequence[str]) -> None:
        self.record, self.varying = record, tuple(varying)
        marks: dict[str, bytes] = {}
        values: dict[str, Any] = {}
        for i, name in enumerate(self.varying):
            value = _SENTINEL - 7919 * i
            array = isinstance(getattr(record, name), tuple | list) or hasattr(getattr(record, name), "shape")
            values[name] = (value,) if array else value
            marks[name] = avro_longs((value,)) if array else avro_long(value)
        wire = dataclasses.replace(record, **values).encode()
        cuts = []
        for name in self.varying:
            at = wire.find(marks[name])
            if at < 0 or wire.find(marks[name], at + 1) >= 0:
                raise ValueError(f"{type(record).__name__}.{name}: its encoding is not found once in the message")
            cuts.append((at, at + len(marks[name]), name))
        cuts.sort()
        self.order = tuple(name for _, _, name in cuts)
        self.pieces: list[bytes] = []
        at = 0
        for start, end, _ in cuts:
            self.pieces.append(wire[at:start])
            at = end
        self.pieces.append(wire[at:])

    def bind(self, **encoded: bytes) -> WireTemplate:
        """This template with some varying fields fixed (e.g. a rank's), the rest still open."""
        bound = object.__new__(WireTemplate)
        bound.record, bound.varying = self.record, tuple(n for n in self.varying if n not in encoded)
        pieces, order = [self.pieces[0]], []
        for name, piece in zip(self.order, self.pieces[1:], strict=True):
            if name in encoded:
                pieces[-1] += encoded[name] + piece
            else:
                order.append(name)
                pieces.append(piece)
        bound.order, bound.pieces = tuple(order), pieces
        return bound

    def join(self, **encoded: bytes) -> bytes:
        """The message with each varying field's encoding (``avro_long(v)`` / ``avro_longs(vs)``)."""
        out = [self.pieces[0]]
        for name, piece in zip(self.order, self.pieces[1:], strict=True):
            out.append(encoded[name])
            out.append(piece)
        return b"".join(out)

    def check(self, **values: Any) -> None:
        """Raise ``AssertionError`` unless :meth:`join` of ``values`` equals the record's own encoding."""
        encoded = {n: avro_longs(v) if isinstance(v, tuple | list) else avro_long(v) for n, v in values.items()}
        want = dataclasses.replace(self.record, **values).encode()
        if self.join(**encoded) != want:
            raise AssertionError(f"{type(self.record).__name__}: the template's message differs from encode()")
