"""The command line's edges: bad arguments, brokers that do not answer, unknown jobs, --version, the
settings table. Each is one clear line and an exit code, never a traceback."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from argus.cli import Exit, _needs_kafka, _parser, main
from argus.core.kafka_logs import RepeatFilter
from argus.core.settings import Settings
from argus.core.settings_doc import field_docs, settings_markdown

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [
    ["simulate", "--job", "x", "--dp", "0"],
    ["simulate", "--job", "x", "--dp", "-1"],
    ["simulate", "--job", "x", "--pp", "0"],
    ["simulate", "--job", "x", "--tp", "two"],
    ["simulate", "--job", ""],
    ["simulate", "--job", "   "],
    ["simulate", "--job", "x", "--hang-s", "nan"],
    ["findings", "--job", "x", "--wait", "-5"],
    ["findings", "--job", "a\nb"],
    ["export-trace", "--job", "x", "--rank", "-1", "--from-step", "0", "--to-step", "1", "--out", "t.json"],
    ["demo", "--steps", "0"],
    ["control", "--job", "x", "set", "no_such_setting=1"],
    ["control", "--job", "x", "set", "heartbeat_interval_s=0"],
    ["control", "--job", "x", "set", "heartbeat_interval_s"],
    ["control", "--job", "x", "sample-ranks", "-1"],
    ["control", "--job", "x", "--ranks", "two", "pause-kernels"],
    ["control", "--job", "x", "--ranks", "none", "pause-kernels"],  # would read as every rank on the wire
    ["control", "--job", "x"],
    ["--log-level", "LOUD", "status"],
    ["no-such-command"],
])
def test_bad_arguments_exit_2_with_one_message(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == Exit.USAGE
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_bad_setting_exits_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ARGUS_PARTITIONS", "zero")
    assert main(["status"]) == Exit.USAGE
    assert "configuration error" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("argus ")


def test_every_command_that_reads_kafka_checks_it_first() -> None:
    parser = _parser()
    needs = {cmd: _needs_kafka(parser.parse_args(argv)) for cmd, argv in {
        "topics": ["topics"], "simulate": ["simulate", "--job", "j"], "replay": ["replay", "--job", "j"],
        "import-kineto": ["import-kineto", "d", "--job", "j"], "stacks": ["stacks"],
        "follow": ["findings", "--follow"], "export": ["export-trace", "--job", "j", "--rank", "0",
                                                     "--from-step", "0", "--to-step", "1", "--out", "t"],
        "findings": ["findings", "--job", "j"], "status": ["status"], "sql": ["sql", "SELECT 1"],
        "export-summaries": ["export-trace", "--job", "j", "--rank", "0", "--from-step", "0", "--to-step", "1",
                             "--out", "t", "--summaries-only"],
        "control": ["control", "--job", "j", "--ranks", "0,2-3", "sample-ranks", "2"],
    }.items()}
    assert {c for c, n in needs.items() if n} == {"topics", "simulate", "replay", "import-kineto", "stacks",
                                                  "follow", "export", "control"}
    args = parser.parse_args(["control", "--job", "j", "--ranks", "0,2-3", "sample-ranks", "2"])
    assert (args.ranks, args.action, args.count) == ((0, 2, 3), "sample-ranks", 2)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_unreachable_broker_is_one_line_then_the_error(tmp_path: Path) -> None:
    """With nothing listening, each Kafka command says so once and exits 6 within the 10 s it allows (run side
    by side; librdkafka's own lines, which it writes to stderr unless given a logger, would start with %)."""
    env = {**os.environ, "ARGUS_BOOTSTRAP_SERVERS": f"127.0.0.1:{_closed_port()}", "ARGUS_HOME": str(tmp_path)}
    commands = [["topics"], ["findings", "--follow"], ["simulate", "--job", "j", "--steps", "2"],
                ["replay", "--job", "j"], ["stacks"], ["control", "--job", "j", "pause-kernels"]]
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "argus.cli", *argv], env=env, cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for argv in commands]
    for argv, proc in zip(commands, procs, strict=True):
        _, err = proc.communicate(timeout=120)
        lines = [line for line in err.splitlines() if line.strip()]
        assert proc.returncode == Exit.KAFKA_UNREACHABLE, (argv, err)
        assert not any(line.startswith("%") for line in lines), (argv, err)
        assert "Traceback" not in err and len(lines) <= 3, (argv, err)
        assert "cannot reach Kafka" in lines[-1] and "does not answer" in err, (argv, err)
    # 10 s each, side by side; generous for a busy machine, far under the minutes they took before.
    assert time.monotonic() - start < 90


def test_repeat_filter_lets_a_line_through_once_a_minute() -> None:
    now = [0.0]
    f = RepeatFilter(interval_s=60, clock=lambda: now[0])

    def rec(msg: str) -> logging.LogRecord:
        return logging.LogRecord("argus.librdkafka", logging.ERROR, __file__, 1, msg, None, None)

    assert f.filter(rec("Connect to ipv4#127.0.0.1:1 failed (after 0ms in state CONNECT)"))
    assert not f.filter(rec("Connect to ipv4#127.0.0.1:1 failed (after 3ms in state CONNECT)"))
    assert f.filter(rec("another line"))
    now[0] = 61.0
    again = rec("Connect to ipv4#127.0.0.1:1 failed (after 1ms in state CONNECT)")
    assert f.filter(again) and "1 more like it" in again.getMessage()


def test_settings_table_is_generated_and_complete() -> None:
    docs = field_docs()
    assert all(docs.values()), [k for k, v in docs.items() if not v]
    text = (ROOT / "docs" / "settings.md").read_text()
    assert text == settings_markdown(), "stale: python -m argus.core.settings_doc > docs/settings.md"
    assert str(Path.home()) not in text


def test_readme_points_to_every_setting() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "docs/settings.md" in readme


@pytest.mark.slow
def test_the_embedded_store_and_home_are_private(tmp_path: Path) -> None:
    """The home and chdb directories were created 0755 and the files 0644: other local users could read every
    table without the token."""
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)  # a home an older version created
    # No ARGUS_* of the test process (another test may have set one): the child's store is the home's chDB.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("ARGUS_")}
    env = {**inherited, "ARGUS_HOME": str(home), "ARGUS_BOOTSTRAP_SERVERS": f"127.0.0.1:{_closed_port()}"}
    proc = subprocess.run([sys.executable, "-m", "argus", "findings", "--job", "j"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == Exit.UNKNOWN_JOB, proc.stderr
    paths = [home, *home.rglob("*")]
    assert any(p.name == "chdb" for p in paths) and len(paths) > 5
    opened = [f"{p.relative_to(tmp_path)} {oct(p.stat().st_mode & 0o777)}" for p in paths
              if not p.is_symlink() and p.stat().st_mode & 0o077]
    assert opened == []


def test_the_demo_quotes_the_job_id_in_its_sql(monkeypatch: pytest.MonkeyPatch) -> None:
    """argus/demo.py built its SQL with the job id unquoted: a quote in the id changed the statement."""
    import argus.demo
    from argus.sinks.clickhouse import QueryResult

    seen: list[str] = []

    def query(settings: object, sql: str) -> QueryResult:
        seen.append(sql)
        return QueryResult(("a", "b", "c", "d"), [(1, 0, 1, 1)])

    monkeypatch.setattr(argus.demo, "run_query", query)
    argus.demo.wait_processed(Settings.load(env={}), "x' OR '1'='1", 1, 1, timeout_s=5)
    assert seen and "'x\\' OR \\'1\\'=\\'1'" in seen[0] and "= 'x' OR" not in seen[0], seen[0]
