from __future__ import annotations

from pathlib import Path

import pytest

from argus.errors import ConfigError
from argus.settings import Secret, Settings


def test_precedence_argument_over_env_over_default() -> None:
    assert Settings.load(env={}).partitions == 8
    assert Settings.load(env={"ARGUS_PARTITIONS": "4"}).partitions == 4
    assert Settings.load(env={"ARGUS_PARTITIONS": "4"}, partitions=2).partitions == 2


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"ARGUS_PARTITIONS": "zero"}, "cannot parse"),
        ({"ARGUS_PARTITIONS": "0"}, "partitions must be > 0"),
        ({"ARGUS_CLICKHOUSE_DSN": "mysql://x"}, "clickhouse_dsn"),
        ({"ARGUS_COMPRESSION": "brotli"}, "compression"),
        ({"ARGUS_BOOTSTRAP_SERVERS": "localhost"}, "bootstrap_servers"),
    ],
)
def test_invalid_settings_fail_at_start(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Settings.load(env=env)


def test_unknown_override_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown"):
        Settings.load(env={}, nope=1)


def test_password_is_secret(tmp_path: Path) -> None:
    f = tmp_path / "pw"
    f.write_text("hunter2\n")
    s = Settings.load(env={"ARGUS_CLICKHOUSE_PASSWORD_FILE": str(f)})
    assert s.clickhouse_password.reveal() == "hunter2"
    assert "hunter2" not in repr(s) and str(Secret("x")) == "********"


def test_chdb_path_and_env_round_trip(tmp_path: Path) -> None:
    s = Settings.load(env={}, home=tmp_path)
    assert s.chdb_path == (tmp_path / "chdb").resolve()
    again = Settings.load(env=s.to_env())
    assert again.chdb_path == s.chdb_path and again.window_ns == s.window_ns
    assert Settings.load(env={}, clickhouse_dsn="http://ch:8123").chdb_path is None
