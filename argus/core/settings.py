"""One frozen settings object for every argus process.

Precedence is explicit argument > environment (``ARGUS_<FIELD>``, upper case) > default. Values are
validated once, in :meth:`Settings.load`, so a bad setting fails at start-up with a :class:`ConfigError`
instead of half-way through a job. Credentials are :class:`Secret` values that never print.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from argus.core.errors import ConfigError
from argus.core.private_files import write_private

__all__ = ["ENV_PREFIX", "MAX_LOCAL_BROKERS", "ClickHouseSettings", "DetectorSettings", "KafkaSettings", "Secret",
           "Settings", "WorkerSettings", "check_identifier"]

ENV_PREFIX = "ARGUS_"
_P = TypeVar("_P")
#: Most brokers ``argus up`` runs on loopback (``brokers``): each is a JVM of a 512 MB heap.
MAX_LOCAL_BROKERS = 9
#: Longest event-time window (1 day): window ends must stay far inside int64 (see ``argus.schemas.records``).
_MAX_WINDOW_NS = 86_400_000_000_000
_KAFKA_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
#: A ClickHouse cluster or database name argus writes into cluster DDL: inside backquotes, inside string
#: literals and inside the replicas' Keeper path, so no quote, backslash, slash, brace (a macro) or space.
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,127}")


class _Part(Generic[_P]):
    """A part of :class:`Settings` as an attribute: ``settings.kafka`` is the :class:`KafkaSettings` of its
    fields (built on each read: the parts are small and Settings is frozen)."""

    def __init__(self, cls: type[_P]) -> None:
        self.cls = cls

    def __get__(self, settings: Any, owner: Any = None) -> _P:
        # A part's field is the Settings field of its name, or the one its metadata names (parts drop prefixes).
        fields = dataclasses.fields(self.cls)  # type: ignore[arg-type]  # every part is a dataclass
        return self.cls(**{f.name: getattr(settings, f.metadata.get("from", f.name)) for f in fields})


@dataclass(frozen=True)
class Secret:
    """A credential: its value is only available through :meth:`reveal`, never through ``repr``."""

    value: str = field(repr=False, default="")

    def reveal(self) -> str:
        return self.value

    def __str__(self) -> str:
        return "********" if self.value else ""


@dataclass(frozen=True)
class KafkaSettings:
    """What every Kafka client takes (part of :class:`Settings`: ``settings.kafka``): the brokers, the topics,
    TLS/SASL and the producers' compression. Fields as the ``kafka_*`` settings without their prefix."""

    bootstrap_servers: str
    topic_prefix: str
    partitions: int
    replication_factor: int
    retention_ms: int
    security_protocol: str = field(metadata={"from": "kafka_security_protocol"})
    sasl_mechanism: str = field(metadata={"from": "kafka_sasl_mechanism"})
    sasl_username: str = field(metadata={"from": "kafka_sasl_username"})
    sasl_password: Secret = field(metadata={"from": "kafka_sasl_password"})
    ssl_ca_file: str = field(metadata={"from": "kafka_ssl_ca_file"})
    ssl_cert_file: str = field(metadata={"from": "kafka_ssl_cert_file"})
    ssl_key_file: str = field(metadata={"from": "kafka_ssl_key_file"})
    compression: str = field(metadata={"from": "compression"})
    session_timeout_s: float = field(metadata={"from": "session_timeout_s"})

    def topic(self, name: str) -> str:
        """The full topic name for a logical topic (e.g. ``kernels`` -> ``argus.kernels``)."""
        return f"{self.topic_prefix}{name}"


@dataclass(frozen=True)
class ClickHouseSettings:
    """What the ClickHouse store and the sink take (``settings.clickhouse``): where, as whom, into which
    database and cluster, the sink's consumer group and batching, the port of the sink's query endpoint
    (the way into an embedded chDB that the sink owns) and the query service's address and credentials."""

    dsn: str = field(metadata={"from": "clickhouse_dsn"})
    database: str = field(metadata={"from": "clickhouse_database"})
    user: str = field(metadata={"from": "clickhouse_user"})
    password: Secret = field(metadata={"from": "clickhouse_password"})
    cluster: str = field(metadata={"from": "clickhouse_cluster"})
    sink_group: str = field(metadata={"from": "sink_group"})
    sink_batch_max: int = field(metadata={"from": "sink_batch_max"})
    sink_flush_ms: int = field(metadata={"from": "sink_flush_ms"})
    #: argus's own directory: an embedded chDB without a directory in its DSN lives in ``home/chdb``.
    home: Path = field(metadata={"from": "home"})
    query_port: int = field(metadata={"from": "query_port"})
    #: The query service (``argus query-service``): where it listens, and the user and password it asks for.
    query_service_host: str = field(metadata={"from": "query_service_host"})
    query_service_port: int = field(metadata={"from": "query_service_port"})
    query_user: str = field(metadata={"from": "query_user"})
    query_password: Secret = field(metadata={"from": "query_password"})

    @property
    def chdb_path(self) -> Path | None:
        """The embedded chDB directory (absolute), or ``None`` for a server DSN."""
        if not self.dsn.startswith("chdb://"):
            return None
        rest = self.dsn[len("chdb://"):]
        path = Path(rest) if rest else self.home / "chdb"
        return path.resolve()


@dataclass(frozen=True)
class WorkerSettings:
    """What the stream worker's agents take (``settings.worker``): its identity, event-time windows, the bounds
    of its state, liveness and its web server."""

    app_id: str
    home: Path
    window_ns: int
    allowed_lateness_ns: int
    max_event_skew_ns: int
    max_kernel_names: int
    job_idle_timeout_s: float
    max_open_jobs: int
    max_ranks_per_job: int
    l3_max_windows: int
    context_max_bytes: int
    heartbeat_interval_s: float
    metrics_host: str
    web_port: int = field(metadata={"from": "worker_web_port"})


@dataclass(frozen=True)
class DetectorSettings:
    """The detector parameters that are settings (``settings.detector``): the KDE compression of durations
    and the least impact a finding must have to be raised."""

    kde_grid_points: int
    kde_min_samples: int
    kde_min_log_gap: float
    min_impact_fraction: float


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
    #: Replication factor of created topics (1 for the local single-node broker; with ``brokers`` > 1 and not
    #: set, it follows: min(3, brokers)). Topics get ``min.insync.replicas`` = :attr:`min_insync_replicas`.
    replication_factor: int = 1
    #: Brokers of the local Kafka that ``argus up`` runs (``ARGUS_BROKERS``, ``argus up --brokers N``; 1..9,
    #: default 1). Above 1, a KRaft cluster on loopback, one combined broker+controller node per broker:
    #: ``bootstrap_servers`` lists them all (one entry ``host:P`` given expands to ``P, P+2, ...``; each
    #: node's controller listens on its port + 1).
    brokers: int = 1
    #: Retention of raw topics, long enough to replay a job for a postmortem (default 7 days).
    retention_ms: int = 7 * 24 * 3600 * 1000
    #: Directory for local state: chDB data, the local Kafka's data, pid and log files.
    home: Path = Path(".argus")
    #: Where downloaded Apache Kafka jars are cached (outside git).
    kafka_cache: Path = Path.home() / ".cache" / "argus" / "kafka"
    #: Apache Kafka version fetched from Maven Central for the local broker.
    kafka_version: str = "4.1.1"

    # -- Kafka security, for every client (see ``argus.core.kafka_security``) --
    #: ``PLAINTEXT``, ``SSL`` (TLS), ``SASL_PLAINTEXT`` or ``SASL_SSL`` (SASL over TLS).
    kafka_security_protocol: str = "PLAINTEXT"
    #: SASL mechanism with a ``SASL_*`` protocol: ``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512``.
    kafka_sasl_mechanism: str = ""
    #: SASL user name (required with a ``SASL_*`` protocol).
    kafka_sasl_username: str = ""
    #: SASL password (``ARGUS_KAFKA_SASL_PASSWORD`` or ``..._FILE``; required with a ``SASL_*`` protocol).
    kafka_sasl_password: Secret = Secret()
    #: PEM file of the CA(s) that sign the brokers' certificates (``SSL``/``SASL_SSL``; empty: system CAs).
    kafka_ssl_ca_file: str = ""
    #: PEM client certificate for mutual TLS (with ``kafka_ssl_key_file``; empty: none).
    kafka_ssl_cert_file: str = ""
    #: PEM private key of ``kafka_ssl_cert_file`` (unencrypted; keep it 0600).
    kafka_ssl_key_file: str = ""
    #: ``argus up --secure``: the local broker takes SASL/SCRAM (``SASL_PLAINTEXT``) with one user per role
    #: (admin, rank, worker, sink, reader; passwords generated into ``<home>/secrets/``) and Kafka ACLs (see
    #: ``argus.kafka_acls``); each process of the stack runs as its role's user, and commands run against this
    #: home take the user their work needs. Needs one broker (``brokers`` = 1). Default off.
    kafka_secure: bool = False
    #: ClickHouse DSN: ``chdb://<dir>`` (embedded; empty dir = ``<home>/chdb``) or ``http(s)://host:port``.
    clickhouse_dsn: str = "chdb://"
    #: ClickHouse database holding argus tables.
    clickhouse_database: str = "argus"
    #: ClickHouse user for a server DSN.
    clickhouse_user: str = "default"
    #: ClickHouse password for a server DSN (``ARGUS_CLICKHOUSE_PASSWORD`` or ``..._FILE``).
    clickhouse_password: Secret = Secret()
    #: ClickHouse cluster (a name in the servers' ``remote_servers``) to create argus's tables on, for a
    #: server DSN only. Set: every table ``T`` is ``T_local`` (``ReplicatedReplacingMergeTree`` on each
    #: replica of each shard) plus ``T`` (``Distributed`` over them, sharded by job and rank), all DDL
    #: ``ON CLUSTER``; inserts and queries keep using ``T`` (``argus ddl`` prints the statements). Empty
    #: (default): tables on the one server or the embedded chDB. A letter or ``_``, then letters, digits,
    #: ``_`` or ``-``.
    clickhouse_cluster: str = ""
    #: Loopback port on which the sink process answers SQL for the embedded chDB it owns.
    query_port: int = 18124
    #: Interface the query service (``argus query-service``: ClickHouse's HTTP interface, read-only) binds:
    #: default ``127.0.0.1``; ``0.0.0.0`` for Grafana or clients on other hosts (set ``query_password`` then).
    query_service_host: str = "127.0.0.1"
    #: Port of the query service (default 18123, beside ClickHouse's 8123).
    query_service_port: int = 18123
    #: User name clients give the query service (default ``argus``).
    query_user: str = "argus"
    #: Password of ``query_user`` (``ARGUS_QUERY_PASSWORD`` or ``..._FILE``); empty (default): the per-home
    #: token in ``<home>/query.token``, which ``argus sql`` reads.
    query_password: Secret = Secret()
    #: Port of the Faust worker's web server: ``/health``, ``/stats`` (JSON) and ``/metrics`` (Prometheus).
    worker_web_port: int = 16066
    #: Interface the metrics endpoints bind: the worker's web server (all its pages), the sink's and the
    #: publisher's ``/metrics`` servers. Default ``127.0.0.1`` (loopback only); ``0.0.0.0`` (or ``::``) for a
    #: Prometheus on another host or container, behind a firewall. The local supervisor checks the worker's
    #: health on 127.0.0.1, which ``0.0.0.0`` includes.
    metrics_host: str = "127.0.0.1"
    #: Port of the sink process's Prometheus ``/metrics`` server on ``metrics_host`` (default 16067; 0: off).
    sink_metrics_port: int = 16067
    #: Rank side, opt-in: base port of each training process's publisher ``/metrics`` server on
    #: ``metrics_host`` (default 0: off). A process serves on this port plus its ``LOCAL_RANK`` (environment,
    #: as torchrun sets it; 0 when unset), so the ranks of one host get distinct ports: leave room for
    #: ``nproc_per_node`` ports. A port that cannot be bound is logged and skipped; training goes on.
    publisher_metrics_port: int = 0
    #: Faust application id (consumer group of the stream worker).
    app_id: str = "argus-streams"
    #: Consumer group of the ClickHouse sink.
    sink_group: str = "argus-sink"
    #: Event-time window of the compression agent, in nanoseconds (default 10 s).
    window_ns: int = 10_000_000_000
    #: How far behind a rank's newest event a window may still receive records (default 2 s).
    allowed_lateness_ns: int = 2_000_000_000
    #: How far ahead of a rank's watermark (its newest accepted kernel start) an event may start, in
    #: nanoseconds (default 1 h). Events beyond it are dead-lettered and do not move the watermark, so one
    #: bogus far-future timestamp cannot close the rank's windows and turn its later events late. A rank
    #: that is silent for longer (no kernels at all) resumes into the dead letters: raise it for jobs
    #: that pause their GPUs longer. At least ``window_ns + allowed_lateness_ns``, at most 2^61.
    max_event_skew_ns: int = 3_600_000_000_000
    #: Distinct kernel names kept per (rank, window) by the compressor (default 4096); events of further
    #: names are summarized together under the kernel name ``[other kernels]`` (its summary carries their
    #: count), so one window's compression cost stays bounded.
    max_kernel_names: int = 4096
    #: Judged event-time windows whose rows the L3 agent keeps per (job, kernel, stream) (default 64; the
    #: newest are kept; of older ones only what their judgement found stays, which the job's end judges again
    #: against its final step time; rows that arrive later for a dropped window are counted and ignored).
    #: At least 3.
    l3_max_windows: int = 64
    #: Stream worker: seconds without any record of a job (steps, phases, topology, lifecycle) after which
    #: the job is abandoned (default 300): a lifecycle record ``ABANDONED`` (reason, last step) is written, and
    #: on it the job's open kernel windows are summarized, its final diagnosis runs on what arrived, its state
    #: is dropped and its held Kafka messages are acked (so its partitions' committed offsets move on). The
    #: only use of the worker's clock (spans in which the worker was too busy to read count at most a fraction
    #: of a second each, so a lagging worker does not abandon jobs whose records wait unread). In (0, 604800].
    job_idle_timeout_s: float = 300.0
    #: Jobs the stream worker diagnoses at once (default 10000); beyond it, the job idle the longest is
    #: abandoned early (reason ``max_open_jobs``), so a worker's memory stays bounded. At least 1.
    max_open_jobs: int = 10_000
    #: Ranks the stream worker keeps state for per job (default 65536); records of higher ranks are
    #: dead-lettered. At least 1.
    max_ranks_per_job: int = 65_536
    #: Most bytes of one job-context message (default 1000000, under Kafka's default ``message.max.bytes`` of
    #: 1048588): a job's shared context larger than this (a 102,400-rank job's L3 totals are ~11 MB) is sent
    #: as several pieces that every worker joins before using it. In [16384, 8000000]: the worker's producer
    #: sends requests of at most 8,000,000 bytes; the brokers' ``message.max.bytes`` (or the context topic's
    #: ``max.message.bytes``) must be at least this.
    context_max_bytes: int = 1_000_000
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
    #: Rank-side tracer: seconds between two heartbeats of a rank (its step, phase and collective in flight;
    #: default 2 s). Also published, at most 4 per interval, when a rank stays in a newly entered phase. In
    #: (0, 3600].
    heartbeat_interval_s: float = 2.0
    #: Rank-side tracer: read ``argus control``'s commands to this job from the control topic (a background
    #: thread; see docs/rank-control.md).
    control: bool = True
    #: Rank-side tracer: longest wait of one poll of the control topic, seconds; a command reaches a running
    #: rank within about this long. In (0, 60].
    control_poll_s: float = 1.0
    #: Rank-side tracer: when another tool (a profiler, nsys) holds CUPTI, seconds between two tries to take it
    #: back; kernel records are paused meanwhile. In (0, 3600].
    cupti_retry_s: float = 30.0
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
    #: ``argus import-kineto``: the most memory, in MiB, that the traces' annotations (phases), names and
    #: process groups may keep across all files of one import, estimated while they are read (kernels go to a
    #: spill file on disk and do not count). A set of traces over it is refused, naming the file where it ran
    #: out (default 4096).
    import_max_memory_mb: int = 4096

    # -- the supervisor of the local stack (``argus up``) --
    #: First delay, in seconds, before the supervisor restarts a crashed worker, sink or local broker; it
    #: doubles with each crash in a row up to ``supervisor_backoff_max_s`` and starts over once the process
    #: has run for four times that maximum.
    supervisor_backoff_s: float = 1.0
    #: Longest delay between two restarts of a process that keeps crashing, in seconds.
    supervisor_backoff_max_s: float = 15.0
    #: Seconds a running worker or sink may fail its health check (``/health``), after having passed it once,
    #: before the supervisor kills it as hung and restarts it. Generous: a worker busy with a large diagnosis
    #: answers late, and a restart re-reads everything un-acked.
    supervisor_hang_s: float = 300.0

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
            elif _type_name(f.type) == "Secret" and key + "_FILE" in env:
                try:
                    values[name] = Secret(Path(env[key + "_FILE"]).read_text().strip())
                except OSError as exc:
                    raise ConfigError(f"cannot read {key}_FILE: {exc}") from exc
        _follow_brokers(values)
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        """Check ranges and formats; raises :class:`ConfigError` naming the setting."""
        positive = (
            "partitions", "replication_factor", "retention_ms", "window_ns", "kde_grid_points",
            "kde_min_samples", "publisher_batch_events", "publisher_queue_max", "sink_batch_max",
            "sink_flush_ms", "query_port", "worker_web_port", "import_max_memory_mb", "query_service_port",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("query_port", "worker_web_port", "sink_metrics_port", "publisher_metrics_port",
                     "query_service_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name} must be a port in 0..65535, got {getattr(self, name)!r}")
        if not self.metrics_host or any(c in self.metrics_host for c in " /[]@") or "://" in self.metrics_host:
            raise ConfigError(f"metrics_host must be a host name or IP address (e.g. 127.0.0.1 or 0.0.0.0), "
                              f"got {self.metrics_host!r}")
        for name, refused in (("query_service_host", " /[]@\t\r\n"), ("query_user", " /[]@:\t\r\n")):
            value = getattr(self, name)
            if not value or any(c in refused for c in value):
                raise ConfigError(f"{name} must be a plain name (no spaces, '/', '@' or brackets), got {value!r}")
        if not 0 < self.heartbeat_interval_s <= 3600:
            raise ConfigError(f"heartbeat_interval_s must be in (0, 3600], got {self.heartbeat_interval_s!r}")
        if not 0 < self.control_poll_s <= 60:
            raise ConfigError(f"control_poll_s must be in (0, 60], got {self.control_poll_s!r}")
        if not 0 < self.cupti_retry_s <= 3600:
            raise ConfigError(f"cupti_retry_s must be in (0, 3600], got {self.cupti_retry_s!r}")
        if self.allowed_lateness_ns < 0:
            raise ConfigError("allowed_lateness_ns must be >= 0")
        if self.window_ns > _MAX_WINDOW_NS:
            raise ConfigError(f"window_ns must be <= {_MAX_WINDOW_NS} (1 day), got {self.window_ns!r}")
        least_skew = self.window_ns + self.allowed_lateness_ns
        if not least_skew <= self.max_event_skew_ns <= 2**61:
            raise ConfigError(f"max_event_skew_ns must be in [window_ns + allowed_lateness_ns = {least_skew}, "
                              f"2^61], got {self.max_event_skew_ns!r}")
        if self.max_kernel_names < 1:
            raise ConfigError(f"max_kernel_names must be >= 1, got {self.max_kernel_names!r}")
        if self.l3_max_windows < 3:
            raise ConfigError(f"l3_max_windows must be >= 3, got {self.l3_max_windows!r}")
        if not 0 < self.job_idle_timeout_s <= 604_800:
            raise ConfigError(f"job_idle_timeout_s must be in (0, 604800], got {self.job_idle_timeout_s!r}")
        if not 16_384 <= self.context_max_bytes <= 8_000_000:
            raise ConfigError(f"context_max_bytes must be in [16384, 8000000], got {self.context_max_bytes!r}")
        for name in ("max_open_jobs", "max_ranks_per_job"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.kde_min_log_gap < 0:
            raise ConfigError("kde_min_log_gap must be >= 0")
        if not 0.0 <= self.min_impact_fraction < 1.0:
            raise ConfigError(f"min_impact_fraction must be in [0, 1), got {self.min_impact_fraction!r}")
        if self.compression not in ("zstd", "lz4", "none"):
            raise ConfigError(f"compression must be zstd, lz4 or none, got {self.compression!r}")
        if not self.clickhouse_dsn.startswith(("chdb://", "http://", "https://")):
            raise ConfigError(f"clickhouse_dsn must start with chdb://, http:// or https://: {self.clickhouse_dsn!r}")
        if self.clickhouse_cluster:
            check_identifier("clickhouse_cluster", self.clickhouse_cluster)
            # The database goes into the replicas' Keeper path and the Distributed engine's arguments too.
            check_identifier("clickhouse_database", self.clickhouse_database)
            if self.clickhouse_dsn.startswith("chdb://"):
                raise ConfigError("clickhouse_cluster needs a ClickHouse server (clickhouse_dsn http(s)://...); "
                                  "the embedded chDB has no clusters")
        if not self.bootstrap_servers or any(":" not in s for s in self.bootstrap_servers.split(",")):
            raise ConfigError(f"bootstrap_servers must be host:port[,host:port]: {self.bootstrap_servers!r}")
        self._validate_brokers()
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level must be DEBUG, INFO, WARNING or ERROR: {self.log_level!r}")
        if self.session_timeout_s <= 0:
            raise ConfigError("session_timeout_s must be > 0")
        self._validate_kafka_security()
        if not self.supervisor_hang_s > 0:
            raise ConfigError(f"supervisor_hang_s must be > 0, got {self.supervisor_hang_s!r}")
        if not 0 < self.supervisor_backoff_s <= self.supervisor_backoff_max_s:
            raise ConfigError(f"supervisor_backoff_s must be > 0 and <= supervisor_backoff_max_s, got "
                              f"{self.supervisor_backoff_s!r} and {self.supervisor_backoff_max_s!r}")

    def _validate_brokers(self) -> None:
        if not 1 <= self.brokers <= MAX_LOCAL_BROKERS:
            raise ConfigError(f"brokers must be in 1..{MAX_LOCAL_BROKERS}, got {self.brokers!r}")
        if self.brokers == 1:
            return
        listed = len(self.bootstrap_servers.split(","))
        if listed != self.brokers:
            raise ConfigError(f"bootstrap_servers must list the {self.brokers} local brokers (or one host:port, "
                              f"expanded to ports P, P+2, ...), got {listed}: {self.bootstrap_servers!r}")
        if self.kafka_secure:
            raise ConfigError(f"kafka_secure (argus up --secure) needs one broker, got brokers={self.brokers}: the "
                              "local cluster serves PLAINTEXT only (its nodes' controller listeners take no SASL)")
        if self.replication_factor > self.brokers:
            raise ConfigError(f"replication_factor {self.replication_factor} exceeds the {self.brokers} brokers")

    @property
    def min_insync_replicas(self) -> int:
        """``min.insync.replicas`` of argus's topics: replication factor - 1 from 3 replicas up (RF 3: 2, so
        one broker may fail with ``acks=all`` producers going on and nothing acknowledged on a single copy);
        1 below (RF 2 with 2 would stop every producer when one broker fails)."""
        return self.replication_factor - 1 if self.replication_factor >= 3 else 1

    def _validate_kafka_security(self) -> None:
        protocol = self.kafka_security_protocol
        if protocol not in _KAFKA_PROTOCOLS:
            raise ConfigError(f"kafka_security_protocol must be one of {', '.join(_KAFKA_PROTOCOLS)}: {protocol!r}")
        sasl = protocol.startswith("SASL_")
        if sasl:
            if self.kafka_sasl_mechanism not in _SASL_MECHANISMS:
                raise ConfigError(f"kafka_sasl_mechanism must be one of {', '.join(_SASL_MECHANISMS)} with "
                                  f"{protocol}, got {self.kafka_sasl_mechanism!r}")
            if not self.kafka_sasl_username or not self.kafka_sasl_password.reveal():
                raise ConfigError(f"kafka_sasl_username and kafka_sasl_password are required with {protocol}")
        elif self.kafka_sasl_mechanism or self.kafka_sasl_username or self.kafka_sasl_password.reveal():
            # Credentials that would silently not be sent are a misconfiguration, not a default.
            raise ConfigError(f"kafka_sasl_* settings need kafka_security_protocol SASL_PLAINTEXT or SASL_SSL, "
                              f"not {protocol}")
        files = {"kafka_ssl_ca_file": self.kafka_ssl_ca_file, "kafka_ssl_cert_file": self.kafka_ssl_cert_file,
                 "kafka_ssl_key_file": self.kafka_ssl_key_file}
        if any(files.values()) and not protocol.endswith("SSL"):
            raise ConfigError(f"kafka_ssl_* files need kafka_security_protocol SSL or SASL_SSL, not {protocol}")
        if bool(self.kafka_ssl_cert_file) != bool(self.kafka_ssl_key_file):
            raise ConfigError("kafka_ssl_cert_file and kafka_ssl_key_file go together (mutual TLS)")
        for name, value in files.items():
            if value and not (os.path.isfile(value) and os.access(value, os.R_OK)):
                raise ConfigError(f"{name}: {value!r} is not a readable file")

    def replace(self, **changes: Any) -> Settings:
        """A validated copy with ``changes`` applied."""
        new = dataclasses.replace(self, **changes)
        new.validate()
        return new

    def to_env(self, secrets_dir: Path | None = None) -> dict[str, str]:
        """These settings as ``ARGUS_*`` environment variables, for child processes.

        A credential is never put in the environment (which other tools print, dump and pass on): it is
        written to a file of its own, mode 0600, in ``secrets_dir`` (default ``<home>/run/secrets``, 0700), and
        passed as ``ARGUS_<NAME>_FILE``.

        Raises:
            ConfigError: a credential's file cannot be written.
        """
        out: dict[str, str] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Secret):
                if value.reveal():
                    path = _write_secret((secrets_dir or self.home / "run" / "secrets") / f.name, value)
                    out[ENV_PREFIX + f.name.upper() + "_FILE"] = str(path)
                continue
            if isinstance(value, Path):
                value = value.resolve()
            out[ENV_PREFIX + f.name.upper()] = str(value)
        if self.chdb_path is not None:
            out[ENV_PREFIX + "CLICKHOUSE_DSN"] = f"chdb://{self.chdb_path}"
        return out

    def child_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a child process: ``base`` (default ``os.environ``) less any credential given
        there as a value, plus :meth:`to_env` (credentials as files)."""
        base = os.environ if base is None else base
        secrets = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(self) if _type_name(f.type) == "Secret"}
        return {**{k: v for k, v in base.items() if k not in secrets}, **self.to_env()}

    @property
    def chdb_path(self) -> Path | None:
        """The embedded chDB directory (absolute), or ``None`` for a server DSN (see
        :attr:`ClickHouseSettings.chdb_path`)."""
        return self.clickhouse.chdb_path

    def topic(self, name: str) -> str:
        """The full topic name for a logical topic (e.g. ``kernels`` -> ``argus.kernels``)."""
        return f"{self.topic_prefix}{name}"

    # The parts each component takes, read from these settings (validated here, in one place).
    kafka = _Part(KafkaSettings)
    clickhouse = _Part(ClickHouseSettings)
    worker = _Part(WorkerSettings)
    detector = _Part(DetectorSettings)


def check_identifier(setting: str, value: str) -> str:
    """``value`` if it is a plain ClickHouse name (a letter or ``_``, then up to 127 letters, digits, ``_`` or
    ``-``), fit to be written into cluster DDL.

    Raises:
        ConfigError: naming ``setting``, for anything else.
    """
    if not _IDENTIFIER.fullmatch(value):
        raise ConfigError(f"{setting} must be a letter or _ followed by up to 127 letters, digits, _ or -, "
                          f"got {value!r}")
    return value


def _write_secret(path: Path, secret: Secret) -> Path:
    """``secret`` in ``path`` (mode 0600, its directory 0700), rewritten only when it changed; its absolute
    path."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.parent.chmod(0o700)
        text = secret.reveal()
        if not (path.is_file() and path.read_text() == text):
            write_private(path, text)
        path.chmod(0o600)
    except OSError as exc:
        raise ConfigError(f"cannot write the credential file {path}: {exc}") from exc
    return path.resolve()


def _follow_brokers(values: dict[str, Any]) -> None:
    """With ``brokers`` > 1 (from an argument or the environment): one ``bootstrap_servers`` entry ``host:P``
    becomes the cluster's ``host:P,host:P+2,...`` and an unset ``replication_factor`` becomes min(3, brokers)."""
    brokers = values.get("brokers", Settings.brokers)
    if not isinstance(brokers, int) or not 1 < brokers <= MAX_LOCAL_BROKERS:
        return  # 1, or out of range (validate() says so)
    servers = str(values.get("bootstrap_servers", Settings.bootstrap_servers)).strip()
    host, _, port = servers.rpartition(":")
    if "," not in servers and port.isdigit() and int(port) + 2 * brokers <= 65536:
        values["bootstrap_servers"] = ",".join(f"{host}:{int(port) + 2 * i}" for i in range(brokers))
    values.setdefault("replication_factor", min(3, brokers))


def _type_name(typ: Any) -> str:
    return typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))


def _coerce(name: str, typ: Any, raw: Any) -> Any:
    type_name = _type_name(typ)
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
