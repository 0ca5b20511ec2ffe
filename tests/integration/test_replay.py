"""Postmortems through the real stack: `argus replay` of a finished job gives the live findings again, in a
namespace of its own; `argus findings --follow` and the JSON findings topic give the same findings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from argus.core.settings import Settings
from argus.topics import Topic
from tests.integration.conftest import _free_port

pytestmark = pytest.mark.integration


def argus(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "argus.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _json_topic(settings: Settings) -> list[dict[str, object]]:
    """Everything on the JSON findings topic, read as any Kafka client would (no argus code)."""
    topic = Topic.FINDINGS_JSON.full(settings)
    c = Consumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": "json-reader",
                  "enable.auto.commit": False})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts if ends[p] > 0])
        out: list[dict[str, object]] = []
        while len(out) < sum(ends.values()):
            msg = c.poll(10)
            assert msg is not None, f"JSON topic: {len(out)} of {sum(ends.values())} messages read"
            out.append(json.loads(msg.value()))
        return out
    finally:
        c.close()


def _identity(f: dict[str, object]) -> tuple[object, ...]:
    return (f["level"], f["kind"], tuple(f["ranks"]), f["phase"], f["kernel"], tuple(f["steps"]))  # type: ignore[arg-type]


def test_replay_of_a_live_job_finds_what_the_live_run_found(settings: Settings, tmp_path: Path) -> None:
    live = settings.replace(home=tmp_path / "home", query_port=_free_port(), worker_web_port=_free_port())
    env = {**os.environ, **live.to_env()}
    up = argus(env, "up")
    assert up.returncode == 0, up.stderr
    try:
        sim = argus(env, "simulate", "--job", "rj", "--dp", "4", "--tp", "2", "--pp", "1", "--steps", "24",
                    "--fault", "case1")
        assert sim.returncode == 0, sim.stderr
        res = argus(env, "findings", "--job", "rj", "--wait", "240", "--json")
        assert res.returncode == 0, res.stderr
        found = json.loads(res.stdout)
        assert found, "the live run found nothing: nothing to compare"
        versions = {f["detector_version"] for f in found}
        assert len(versions) == 1 and "+" in versions.pop()

        rep = argus(env, "replay", "--job", "rj", "--into", "pm1", "--json", "--timeout", "240")
        assert rep.returncode == 0, rep.stderr
        doc = json.loads(rep.stdout)
        assert doc["complete"] and doc["diff"]["identical"], json.dumps(doc["diff"], indent=1)[:3000]
        assert doc["replayed_findings"] == len(found) and doc["diff"]["same"] == len(found)
        assert doc["detector_versions"]["replay"] == doc["detector_versions"]["live"]
        assert doc["copied"]["kernels"] > 0 and doc["copied"]["steps"] == 8 * 24 and doc["copied"]["lifecycle"] == 2
        # The live tables are untouched: the replay wrote its own database and topics.
        assert doc["database"] == "pm1" and doc["topic_prefix"] == f"{settings.topic_prefix}pm1."
        rows = argus(env, "sql", f"SELECT count() AS n FROM `{settings.clickhouse_database}`.jobs FINAL "
                                 "WHERE job_id = 'rj' AND event = 'DIAGNOSED'", "--json")
        assert rows.returncode == 0, rows.stderr
        assert json.loads(rows.stdout)[0]["n"] == 1 + settings.partitions  # the live run's parts only

        # (The text form of the same result: tests/unit/test_replay_parts.py.)
        # A time range with nothing of the job in it is refused with a clear error.
        empty = argus(env, "replay", "--job", "rj", "--into", "pm3", "--from-time", "2999-01-01T00:00:00Z")
        assert empty.returncode == 1 and "no retained" in empty.stderr
        bad = argus(env, "replay", "--job", "rj", "--into", "no-dashes")
        assert bad.returncode == 1 and "namespace" in bad.stderr

        # Followers see the same findings, from the Avro topic and from the JSON one.
        follow = argus(env, "findings", "--follow", "--from-beginning", "--job", "rj", "--json",
                       "--idle-timeout", "5")
        assert follow.returncode == 0, follow.stderr
        followed = [json.loads(line) for line in follow.stdout.splitlines()]
        assert sorted(map(_identity, followed)) == sorted(map(_identity, found))
        on_json = [f for f in _json_topic(live) if f["job"] == "rj"]
        assert {_identity(f) for f in on_json} == {_identity(f) for f in found}
        assert {"impact_ns", "evidence", "detector_version", "ranks"} <= set(on_json[0])
        pager = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "examples" / "consume_findings.py"),
                                "--bootstrap", live.bootstrap_servers, "--topic", Topic.FINDINGS_JSON.full(live),
                                "--from-beginning", "--min-gpu-s", "0", "--max-messages", str(len(on_json))],
                               capture_output=True, text=True, timeout=120)
        assert pager.returncode == 0, pager.stderr
        assert len(pager.stdout.splitlines()) == len(found) and all(
            line.startswith("PAGE job=rj") for line in pager.stdout.splitlines())
    finally:
        down = argus(env, "down", "--keep-kafka")
    assert down.returncode == 0, down.stderr
