"""Detector results as :class:`~argus.schemas.records.Finding` records, with deterministic ids.

Kinds are :class:`~argus.core.kinds.FindingKind` members, each of one level; the finding's ``kind`` field
carries the member and its value is what the topic, the table and the ``--json`` contract write.

``finding_id`` is the SHA-1 (hex) of the canonical JSON array ``[job_id, level, kind, ranks, phase,
kernel, stream, steps]``: the same diagnosis re-derived after a replay or a re-delivery gets the same id,
so the sink can deduplicate; the score, evidence and time do not enter it. ``evidence_json`` is the
result's evidence as compact JSON with sorted keys; numpy scalars become numbers, tuples lists, enums
their values, and NaN or infinite floats ``null``.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from argus.core.errors import DetectorError
from argus.detectors.hangs import HangResult
from argus.detectors.impact import Impact
from argus.detectors.l1_iteration import L1Result
from argus.detectors.l2_phases import L2Result
from argus.detectors.l3_kernels import L3Result
from argus.schemas.records import Finding

__all__ = ["DetectorResult", "evidence_json", "finding_id", "finding_json", "to_finding", "to_findings"]

#: Any detector's result.
DetectorResult = L1Result | L2Result | L3Result


def finding_id(job_id: str, level: str, kind: str, ranks: Iterable[int], phase: str | None, kernel: str | None,
               stream: int | None, steps: Iterable[int]) -> str:
    """SHA-1 hex digest of the canonical JSON of the finding's identity (see the module docstring)."""
    key = [job_id, level, kind, sorted(int(r) for r in ranks), phase, kernel, stream, [int(s) for s in steps]]
    return hashlib.sha1(json.dumps(key, separators=(",", ":")).encode("utf-8")).hexdigest()


def to_finding(job_id: str, result: DetectorResult | HangResult, time_ns: int, impact: Impact | None = None) -> Finding:
    """The :class:`Finding` of one detector result.

    ``time_ns``: the event time the finding refers to (the last analysed step's start, or the newest
    window end), integer ns since the Unix epoch. ``impact``: its GPU-time impact (see
    :mod:`argus.detectors.impact`; 0 when not given), also written to the evidence as ``delay_ms_per_step`` and
    ``impact_steps``. Raises :class:`DetectorError` for an empty ``job_id``,
    a negative ``time_ns``, a non-finite score or evidence that cannot be written as JSON.
    """
    if not job_id:
        raise DetectorError("job_id must not be empty")
    if time_ns < 0:
        raise DetectorError(f"time_ns must be >= 0, got {time_ns}")
    score = float(result.score)
    if not math.isfinite(score):
        raise DetectorError(f"{result.kind.value}: score must be finite, got {score}")
    ranks: tuple[int, ...] = () if isinstance(result, L1Result) else tuple(sorted(int(r) for r in result.ranks))
    phase = result.phase if isinstance(result, (L2Result, HangResult)) else None
    kernel = result.kernel if isinstance(result, L3Result) else None
    stream = int(result.stream) if isinstance(result, L3Result) else None
    steps = tuple(int(s) for s in result.steps)
    level, kind = result.level, result.kind.value
    extra = {} if impact is None else {"delay_ms_per_step": impact.delay_ns_per_step / 1e6,
                                       "impact_steps": impact.steps}
    try:
        evidence = evidence_json(_jsonable(result.evidence | extra))
    except (TypeError, ValueError) as exc:
        raise DetectorError(f"{kind}: evidence is not JSON-serializable: {exc}") from exc
    return Finding(
        finding_id=finding_id(job_id, level.value, kind, ranks, phase, kernel, stream, steps),
        job_id=job_id, level=level, kind=result.kind, ranks=ranks, steps=steps, score=score, evidence_json=evidence,
        time_ns=int(time_ns), phase=phase, kernel=kernel, stream=stream,
        impact_ns_per_step=0.0 if impact is None else float(impact.gpu_ns_per_step),
        impact_ns=0.0 if impact is None else float(impact.gpu_ns),
    )


def evidence_json(evidence: dict[str, Any]) -> str:
    """A finding's ``evidence_json``: keys sorted, compact, no NaN (raises ``ValueError`` for one,
    ``TypeError`` for a value JSON cannot hold)."""
    return json.dumps(evidence, sort_keys=True, allow_nan=False, separators=(",", ":"))


def to_findings(job_id: str, results: Iterable[DetectorResult | HangResult], time_ns: int) -> list[Finding]:
    """:func:`to_finding` of each result, in order."""
    return [to_finding(job_id, r, time_ns) for r in results]


def finding_json(f: Finding) -> dict[str, Any]:
    """A finding as the ``argus findings --json`` contract writes it (see :mod:`argus.sinks.findings_query`): also
    the message body of the JSON findings topic."""
    return {"job": f.job_id, "level": f.level.value, "kind": f.kind.value, "ranks": list(f.ranks), "phase": f.phase,
            "kernel": f.kernel, "stream": f.stream, "steps": list(f.steps), "score": f.score,
            "evidence": json.loads(f.evidence_json), "time_ns": f.time_ns,
            "impact_ns_per_step": f.impact_ns_per_step, "impact_ns": f.impact_ns,
            "detector_version": f.detector_version, "finding_id": f.finding_id, "hosts": list(f.hosts),
            "incident_id": f.incident, "gpus": list(f.gpus)}


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k.value if isinstance(k, enum.Enum) else k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset, np.ndarray)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else list(value)
        return [_jsonable(v) for v in items]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        f = float(value)
        return f if math.isfinite(f) else None
    return value
