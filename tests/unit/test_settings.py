from __future__ import annotations

from pathlib import Path

import pytest

from argus.core.errors import ConfigError
from argus.core.settings import Secret, Settings


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
        ({"ARGUS_MAX_EVENT_SKEW_NS": "1000"}, "max_event_skew_ns"),
        ({"ARGUS_MAX_EVENT_SKEW_NS": str(2**62)}, "max_event_skew_ns"),
        ({"ARGUS_WINDOW_NS": str(2 * 86_400_000_000_000)}, "window_ns must be <="),
        ({"ARGUS_MAX_KERNEL_NAMES": "0"}, "max_kernel_names"),
        ({"ARGUS_L3_MAX_WINDOWS": "2"}, "l3_max_windows"),
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


def test_bounds_have_defaults_and_come_from_the_environment() -> None:
    s = Settings.load(env={})
    assert (s.max_event_skew_ns, s.max_kernel_names, s.l3_max_windows) == (3_600_000_000_000, 4096, 64)
    s = Settings.load(env={"ARGUS_MAX_EVENT_SKEW_NS": "60000000000", "ARGUS_MAX_KERNEL_NAMES": "10",
                           "ARGUS_L3_MAX_WINDOWS": "5"})
    assert (s.max_event_skew_ns, s.max_kernel_names, s.l3_max_windows) == (60_000_000_000, 10, 5)


def test_credentials_reach_child_processes_as_files_never_as_values(tmp_path: Path) -> None:
    """Secrets passed to child processes in environment variables (seen in /proc/<pid>/environ, ps e, crash
    dumps); now each is a 0600 file of the home named by ARGUS_<NAME>_FILE."""
    s = Settings.load(env={}, home=tmp_path, kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_mechanism="PLAIN",
                      kafka_sasl_username="u", kafka_sasl_password="hunter2", clickhouse_password="ch-pw")
    env = s.child_env({"PATH": "/bin", "ARGUS_KAFKA_SASL_PASSWORD": "hunter2", "ARGUS_CLICKHOUSE_PASSWORD": "x"})
    assert "hunter2" not in "".join(env.values()) and "ch-pw" not in "".join(env.values())
    assert "ARGUS_KAFKA_SASL_PASSWORD" not in env and env["PATH"] == "/bin"
    path = Path(env["ARGUS_KAFKA_SASL_PASSWORD_FILE"])
    assert path.read_text() == "hunter2" and path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    again = Settings.load(env=env)
    assert again.kafka_sasl_password.reveal() == "hunter2" and again.clickhouse_password.reveal() == "ch-pw"
