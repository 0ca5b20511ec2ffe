"""One frozen settings object for every argus process.

Precedence is explicit argument > environment (``ARGUS_<FIELD>``, upper case) > default. Values are
validated once, in :meth:`Settings.load`, so a bad setting fails at start-up with a :class:`ConfigError`
instead of half-way through a job. Credentials are :class:`Secret` values that never print.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from argus.errors import ConfigError

__all__ = ["ENV_PREFIX", "Secret", "Settings"]

ENV_PREFIX = "ARGUS_"


@dataclass(frozen=True)
class Secret:
    """A credential: its value is only available through :meth:`reveal`, never through ``repr``."""

    value: str = field(repr=False, default="")

    def reveal(self) -> str:
        return self.value

    def __str__(self) -> str:
        return "********" if self.value else ""


@dataclass(frozen=True)
class Settings:
    """Settings shared by the CLI, the rank-side publisher, the stream worker and the sink.

    Every field can be set as ``ARGUS_<NAME>`` in the environment, e.g. ``ARGUS_BOOTSTRAP_SERVERS``.
    Durations carry their unit in the name.
    """

    #: Kafka bootstrap servers, ``host:port[,host:port]``.
    bootstrap_servers: str = "127.0.0.1:19092"
    #: Prefix of every topic name, so several deployments can share a cluster.
    topic_prefix: str = "argus."
    #: Partitions of each topic created by ``argus topics``/``argus up``.
    partitions: int = 8
    #: Replication factor of created topics (1 for the local single-node broker).
    replication_factor: int = 1
    #: Retention of raw topics, long enough to replay a job for a postmortem (default 7 days).
    retention_ms: int = 7 * 24 * 3600 * 1000
    #: Directory for local state: chDB data, the local Kafka's data, pid and log files.
    home: Path = Path(".argus")
    #: Where downloaded Apache Kafka jars are cached (outside git).
    kafka_cache: Path = Path.home() / ".cache" / "argus" / "kafka"
    #: Apache Kafka version fetched from Maven Central for the local broker.
    kafka_version: str = "4.1.1"
    #: ClickHouse DSN: ``chdb://<dir>`` (embedded; empty dir = ``<home>/chdb``) or ``http(s)://host:port``.
    clickhouse_dsn: str = "chdb://"
    #: ClickHouse database holding argus tables.
    clickhouse_database: str = "argus"
    #: ClickHouse user for a server DSN.
    clickhouse_user: str = "default"
    #: ClickHouse password for a server DSN (``ARGUS_CLICKHOUSE_PASSWORD`` or ``..._FILE``).
    clickhouse_password: Secret = Secret()
    #: Loopback port on which the sink process answers SQL for the embedded chDB it owns.
    query_port: int = 18124
    #: Port of the Faust worker's web server (health checks).
    worker_web_port: int = 16066
    #: Faust application id (consumer group of the stream worker).
    app_id: str = "argus-streams"
    #: Consumer group of the ClickHouse sink.
    sink_group: str = "argus-sink"
    #: Event-time window of the compression agent, in nanoseconds (default 10 s).
    window_ns: int = 10_000_000_000
    #: How far behind a rank's newest event a window may still receive records (default 2 s).
    allowed_lateness_ns: int = 2_000_000_000
    #: KDE grid resolution (points) on log-durations.
    kde_grid_points: int = 512
    #: Minimum samples on each side of a KDE valley for it to split clusters.
    kde_min_samples: int = 5
    #: Minimum natural-log gap between neighbouring cluster boundaries.
    kde_min_log_gap: float = 0.15
    #: Least delay per step a finding must add to the job, as a fraction of the median step time, to be
    #: raised (default 0.01: 1 %; 0 raises every finding the detectors make).
    min_impact_fraction: float = 0.01
    #: Kernel events per Kafka message from the publisher.
    publisher_batch_events: int = 4096
    #: Bounded publisher queue, in messages; beyond it records are dropped and counted.
    publisher_queue_max: int = 1024
    #: Kafka compression of produced messages: ``zstd``, ``lz4`` or ``none``.
    compression: str = "zstd"
    #: Sink: most records gathered before one ClickHouse insert.
    sink_batch_max: int = 50_000
    #: Sink: longest wait before inserting a partial batch, in milliseconds.
    sink_flush_ms: int = 500
    #: Consumer session timeout in seconds (small values make tests join faster).
    session_timeout_s: float = 10.0
    #: Log level of argus processes.
    log_level: str = "INFO"

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from ``overrides`` > ``env`` (default ``os.environ``) > defaults.

        Raises:
            ConfigError: an unknown override, an unparsable environment value, or a failed check.
        """
        env = os.environ if env is None else env
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(overrides) - set(names)
        if unknown:
            raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {}
        for name, f in names.items():
            if name in overrides and overrides[name] is not None:
                values[name] = _coerce(name, f.type, overrides[name])
                continue
            key = ENV_PREFIX + name.upper()
            if key in env:
                values[name] = _coerce(name, f.type, env[key])
            elif name == "clickhouse_password" and key + "_FILE" in env:
                try:
                    values[name] = Secret(Path(env[key + "_FILE"]).read_text().strip())
                except OSError as exc:
                    raise ConfigError(f"cannot read {key}_FILE: {exc}") from exc
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        """Check ranges and formats; raises :class:`ConfigError` naming the setting."""
        positive = (
            "partitions", "replication_factor", "retention_ms", "window_ns", "kde_grid_points",
            "kde_min_samples", "publisher_batch_events", "publisher_queue_max", "sink_batch_max",
            "sink_flush_ms", "query_port", "worker_web_port",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.allowed_lateness_ns < 0:
            raise ConfigError("allowed_lateness_ns must be >= 0")
        if self.kde_min_log_gap < 0:
            raise ConfigError("kde_min_log_gap must be >= 0")
        if not 0.0 <= self.min_impact_fraction < 1.0:
            raise ConfigError(f"min_impact_fraction must be in [0, 1), got {self.min_impact_fraction!r}")
        if self.compression not in ("zstd", "lz4", "none"):
            raise ConfigError(f"compression must be zstd, lz4 or none, got {self.compression!r}")
        if not self.clickhouse_dsn.startswith(("chdb://", "http://", "https://")):
            raise ConfigError(f"clickhouse_dsn must start with chdb://, http:// or https://: {self.clickhouse_dsn!r}")
        if not self.bootstrap_servers or any(":" not in s for s in self.bootstrap_servers.split(",")):
            raise ConfigError(f"bootstrap_servers must be host:port[,host:port]: {self.bootstrap_servers!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level must be DEBUG, INFO, WARNING or ERROR: {self.log_level!r}")
        if self.session_timeout_s <= 0:
            raise ConfigError("session_timeout_s must be > 0")

    def replace(self, **changes: Any) -> Settings:
        """A validated copy with ``changes`` applied."""
        new = dataclasses.replace(self, **changes)
        new.validate()
        return new

    def to_env(self) -> dict[str, str]:
        """These settings as ``ARGUS_*`` environment variables, for child processes."""
        out: dict[str, str] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Secret):
                if not value.reveal():
                    continue
                value = value.reveal()
            elif isinstance(value, Path):
                value = value.resolve()
            out[ENV_PREFIX + f.name.upper()] = str(value)
        if self.chdb_path is not None:
            out[ENV_PREFIX + "CLICKHOUSE_DSN"] = f"chdb://{self.chdb_path}"
        return out

    @property
    def chdb_path(self) -> Path | None:
        """The embedded chDB directory (absolute), or ``None`` for a server DSN."""
        if not self.clickhouse_dsn.startswith("chdb://"):
            return None
        rest = self.clickhouse_dsn[len("chdb://"):]
        path = Path(rest) if rest else self.home / "chdb"
        return path.resolve()

    def topic(self, name: str) -> str:
        """The full topic name for a logical topic (e.g. ``kernels`` -> ``argus.kernels``)."""
        return f"{self.topic_prefix}{name}"


def _coerce(name: str, typ: Any, raw: Any) -> Any:
    type_name = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    try:
        if type_name == "int":
            return int(raw)
        if type_name == "float":
            return float(raw)
        if type_name == "Path":
            return Path(raw).expanduser()
        if type_name == "Secret":
            return raw if isinstance(raw, Secret) else Secret(str(raw))
        if type_name == "bool":
            if isinstance(raw, bool):
                return raw
            return str(raw).lower() in ("1", "true", "yes", "on")
        return str(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"setting {name}: cannot parse {raw!r} as {type_name}") from exc
