"""The parts of the settings each component takes (settings.kafka, .clickhouse, .worker, .detector): read from
the one Settings (so from ARGUS_* in one place), each field from its setting."""

from __future__ import annotations

import dataclasses

import pytest

from argus.core.settings import ClickHouseSettings, DetectorSettings, KafkaSettings, Settings, WorkerSettings

PARTS = {"kafka": KafkaSettings, "clickhouse": ClickHouseSettings, "worker": WorkerSettings,
         "detector": DetectorSettings}
#: Settings of the processes around the worker and the sink, which take the whole Settings: the rank-side
#: publisher and tracer (control topic, CUPTI retries), the supervisor, the local broker (and its cluster size),
#: the query endpoint, the Kineto importer, logging.
WHOLE = {"brokers", "control", "control_poll_s", "cupti_retry_s", "import_max_memory_mb", "kafka_cache",
         "kafka_secure", "kafka_version", "log_level", "publisher_batch_events", "publisher_metrics_port",
         "publisher_queue_max", "sink_metrics_port", "supervisor_backoff_max_s", "supervisor_backoff_s",
         "supervisor_hang_s"}


def _source(f: dataclasses.Field) -> str:  # type: ignore[type-arg]
    return f.metadata.get("from", f.name)


def test_every_setting_is_in_a_part_or_taken_whole() -> None:
    names = {f.name for f in dataclasses.fields(Settings)}
    in_parts = {_source(f) for cls in PARTS.values() for f in dataclasses.fields(cls)}
    assert in_parts <= names
    assert names - in_parts == WHOLE


@pytest.mark.parametrize("part", sorted(PARTS))
def test_a_part_reads_its_settings_from_the_environment(part: str) -> None:
    cls = PARTS[part]
    setting = {"kafka": "partitions", "clickhouse": "sink_batch_max", "worker": "worker_web_port",
               "detector": "kde_grid_points"}[part]
    env = {f"ARGUS_{setting.upper()}": "4242"}
    settings = Settings.load(env)
    value = getattr(settings, part)
    assert isinstance(value, cls) and dataclasses.is_dataclass(value)
    for f in dataclasses.fields(cls):
        assert getattr(value, f.name) == getattr(settings, _source(f))
    assert [f.name for f in dataclasses.fields(cls) if getattr(value, f.name) == 4242] == [
        f.name for f in dataclasses.fields(cls) if _source(f) == setting]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, dataclasses.fields(cls)[0].name, None)


def test_secrets_stay_secret_in_their_parts() -> None:
    s = Settings.load({"ARGUS_CLICKHOUSE_PASSWORD": "hunter2"})
    assert s.clickhouse.password.reveal() == "hunter2" and "hunter2" not in repr(s.clickhouse)
    assert s.kafka.topic("kernels") == s.topic("kernels") == "argus.kernels"
