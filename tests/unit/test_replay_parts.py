"""The pure parts of `argus replay` and the progress meter of the long commands."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from argus.cli import replay_lines
from argus.core.errors import ArgusError
from argus.core.settings import Settings
from argus.progress import Meter
from argus.replay import ReplayResult, diff_findings, finding_identity, namespace_settings, parse_time_ms


def _f(kind: str = "compute_straggler", ranks: tuple[int, ...] = (5,), score: float = 2.0,
       impact: float = 1e9, version: str = "0.1.0+aaaaaaaaaaaa") -> dict[str, Any]:
    return {"job": "j", "level": "L2", "kind": kind, "ranks": list(ranks), "phase": "forward", "kernel": None,
            "stream": None, "steps": [], "score": score, "evidence": {}, "time_ns": 1,
            "impact_ns_per_step": impact / 10, "impact_ns": impact, "detector_version": version}


def test_diff_names_what_only_one_side_found_and_what_changed() -> None:
    live = [_f(), _f(kind="phase_straggler", ranks=(3,)), _f(ranks=(7,))]
    replay = [_f(version="0.2.0+bbbbbbbbbbbb"), _f(kind="phase_straggler", ranks=(3,), score=2.5), _f(ranks=(9,))]
    d = diff_findings(live, replay)
    assert not d.identical and d.same == 1  # a new detector version alone is no difference
    assert [f["ranks"] for f in d.only_live] == [[7]] and [f["ranks"] for f in d.only_replay] == [[9]]
    assert [(a["score"], b["score"]) for a, b in d.changed] == [(2.0, 2.5)]
    assert d.as_dict()["changed"][0]["replay"]["score"] == 2.5
    assert diff_findings(live, list(reversed(live))).identical


def test_the_text_form_says_identical_or_lists_each_difference(tmp_path: Path) -> None:
    target = namespace_settings(Settings.load(env={}, home=tmp_path), "pm1")
    live = [_f(), _f(kind="phase_straggler", ranks=(3,))]
    same = ReplayResult("j", "pm1", {"kernels": 9}, live, [_f(version="0.2.0+bbbbbbbbbbbb"), live[1]],
                        diff_findings(live, list(reversed(live))), True, target)
    lines = replay_lines(same)
    assert lines[0].startswith("replay of job j into namespace pm1 (topics ") and "2 live finding(s), 2 replayed" \
        in lines[0] and "INCOMPLETE" not in lines[0]
    assert lines[1] == "detectors: live 0.1.0+aaaaaaaaaaaa; replay 0.1.0+aaaaaaaaaaaa, 0.2.0+bbbbbbbbbbbb"
    assert lines[2:] == ["findings identical (2)"]
    replay = [_f(score=3.0), _f(ranks=(9,))]
    other = ReplayResult("j", "pm1", {}, live, replay, diff_findings(live, replay), False, target)
    lines = replay_lines(other)
    assert "(replayed diagnosis INCOMPLETE)" in lines[0] and not any("identical" in x for x in lines)
    assert [x[:13] for x in lines[2:]] == ["- live only  ", "+ replay only", "~ changed    "]
    assert "phase_straggler" in lines[2] and "  9  " in lines[3] and lines[4].endswith("->  impact 1.000 score 3.00")


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.lists(st.integers(0, 7), max_size=3),
                          st.floats(0.1, 10)), max_size=12))
def test_diff_of_a_list_with_itself_is_identical_and_counts_each_finding_once(items: list[Any]) -> None:
    found = [_f(kind=k, ranks=tuple(r), score=s) for k, r, s in items]
    unique = {finding_identity(f) for f in found}
    d = diff_findings(found, found)
    assert d.identical and d.same == len(unique)
    gone = diff_findings(found, [])
    assert len(gone.only_live) == len(unique) and gone.same == 0


def test_namespace_settings_keep_the_live_data_apart(tmp_path: Path) -> None:
    live = Settings.load(env={}, home=tmp_path)
    ns = namespace_settings(live, "pm_1")
    assert ns.topic_prefix == "argus.pm_1." and ns.clickhouse_database == "pm_1"
    assert ns.app_id != live.app_id and ns.sink_group != live.sink_group
    assert ns.chdb_path == (tmp_path / "replay" / "pm_1" / "chdb").resolve() != live.chdb_path
    assert {ns.query_port, ns.worker_web_port}.isdisjoint({live.query_port, live.worker_web_port})
    assert (ns.window_ns, ns.min_impact_fraction, ns.bootstrap_servers) == (
        live.window_ns, live.min_impact_fraction, live.bootstrap_servers)
    server = namespace_settings(live.replace(clickhouse_dsn="http://127.0.0.1:8123"), "pm_2")
    assert server.clickhouse_dsn == "http://127.0.0.1:8123" and server.clickhouse_database == "pm_2"
    for bad in ("", "1abc", "a-b", "a.b", "x" * 64, "argus"):
        with pytest.raises(ArgusError):
            namespace_settings(live, bad)


def test_times_are_iso_8601_or_epoch_seconds() -> None:
    assert parse_time_ms("2026-12-01T10:00:00Z") == parse_time_ms("2026-12-01T10:00:00") == 1_796_119_200_000
    assert parse_time_ms("2026-12-01T11:00:00+01:00") == 1_796_119_200_000
    assert parse_time_ms("1796119200.5") == 1_796_119_200_500
    for bad in ("yesterday", "-5", "nan", "inf"):
        with pytest.raises(ArgusError):
            parse_time_ms(bad)


def test_meter_writes_plain_lines_off_a_terminal_and_a_bar_on_one() -> None:
    out = io.StringIO()
    with Meter("copying", total=10, unit="msg", stream=out, interval_s=0.0, tty=False) as m:
        m(4)
        m.say("halfway")
        m(10, 10)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("  · copying: 4/10 msg") and "ETA" in lines[0]
    assert "halfway" in lines[1] and "10/10 msg done" in lines[-1]
    bar = io.StringIO()
    with Meter("copying", total=10, unit="msg", stream=bar, tty=True) as m:
        m(10)
    assert "10/10" in bar.getvalue() and "msg/s" in bar.getvalue()
