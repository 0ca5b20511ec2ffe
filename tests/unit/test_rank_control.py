"""Control without a restart, rank side, without a broker: control commands and heartbeat v2 on the wire, the
rank's application of commands (pause, resume, sample, set, refusals), kernel records pausing and resuming
through a fake CUPTI (argus control, a profiler taking CUPTI, CUPTI held by another tool at start), and what
the heartbeats say about it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import argus.producers.cupti_kernels as ck
from argus.core.errors import ConfigError, SchemaError
from argus.core.settings import Settings
from argus.kafka_acls import Operation, Resource, acl_table
from argus.kafka_users import Role
from argus.producers.control import ControlThread, RankControl, sampled_ranks
from argus.producers.cupti_kernels import CuptiKernels, CuptiState
from argus.producers.cupti_parse import KIND_CONCURRENT_KERNEL
from argus.producers.heartbeat import LiveState
from argus.rank_control import make_command
from argus.schemas.codec import codec
from argus.schemas.control import ControlAction, ControlCommand
from argus.schemas.records import Heartbeat, PauseReason
from argus.topics import Topic, control_partition, job_key, key_partition
from tests.samples import RecordingPublisher
from tests.unit.test_cupti_kernels import FakeCupti, kernel

T0 = 1_700_000_000_000_000_000


class Target:
    """A ControlTarget that records what it is asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.acks: list[tuple[str, str]] = []

    def pause_kernels(self, reason: PauseReason) -> None:
        self.calls.append(("pause", reason))

    def resume_kernels(self, reason: PauseReason) -> None:
        self.calls.append(("resume", reason))

    def set_runtime(self, key: str, value: float | int) -> None:
        self.calls.append(("set", (key, value)))

    def acknowledge(self, command_id: str, error: str) -> None:
        self.acks.append((command_id, error))


def cmd(action: ControlAction, cid: str, ranks: tuple[int, ...] = (), count: int = 0, key: str = "",
        value: str = "") -> ControlCommand:
    return ControlCommand("job-c", cid, T0, action, ranks, count, key, value)


# -- the wire --------------------------------------------------------------------------------------------


def test_heartbeat_v2_carries_pauses_and_acks_and_v1_still_reads() -> None:
    hb = Heartbeat("j", 2, T0, 5, kernels_paused=True, pause_reasons=(PauseReason.CONTROL, PauseReason.PROFILER),
                   control_ack="abc", control_error="", kernel_pauses=3)
    again = Heartbeat.decode(hb.encode())
    assert again == hb and hb.encode()[1] == 2
    v2_only = ("kernels_paused", "pause_reasons", "control_ack", "control_error", "kernel_pauses")
    old = codec("heartbeat").encode({k: v for k, v in Heartbeat("j", 2, T0, 5).to_avro().items() if k not in v2_only},
                                    version=1)
    v1 = Heartbeat.decode(old)
    assert old[1] == 1 and not v1.kernels_paused and v1.pause_reasons == () and v1.control_ack == ""
    with pytest.raises(SchemaError, match="kernels_paused"):
        Heartbeat("j", 2, T0, kernels_paused=True).check()


def test_commands_keys_partition_and_checks() -> None:
    c = make_command("job-c", ControlAction.PAUSE_KERNELS, ranks=(3, 1, 3))
    assert c.ranks == (1, 3) and c.kafka_key() == b"job-c/kernels/1,3" and len(c.command_id) == 16
    assert ControlCommand.decode(c.encode()) == c
    assert make_command("job-c", ControlAction.RESUME_KERNELS).kafka_key() == b"job-c/kernels/all"
    s = make_command("job-c", ControlAction.SET, setting="heartbeat_interval_s=0.5")
    assert (s.key, s.value, s.kafka_key()) == ("heartbeat_interval_s", "0.5", b"job-c/set:heartbeat_interval_s/all")
    for bad in ("nope=1", "heartbeat_interval_s=0", "kernel_batch_events=x", "heartbeat_interval_s"):
        with pytest.raises(SchemaError):
            make_command("job-c", ControlAction.SET, setting=bad)
    with pytest.raises(SchemaError, match="without '/'"):
        make_command("a/b", ControlAction.PAUSE_KERNELS)
    with pytest.raises(SchemaError, match="SET only"):
        cmd(ControlAction.PAUSE_KERNELS, "x", key="heartbeat_interval_s").check()
    # Every command of a job lies in the partition of its job key, whatever its own key.
    assert control_partition("job-c", 12) == key_partition(job_key("job-c"), 12)


def test_sampled_ranks_spread_over_the_job() -> None:
    assert sampled_ranks(4, 16) == {0, 4, 8, 12}
    assert sampled_ranks(3, 8) == {0, 2, 5}
    assert sampled_ranks(0, 8) == sampled_ranks(8, 8) == sampled_ranks(9, 8) == set(range(8))


# -- applying commands -----------------------------------------------------------------------------------


def test_rank_applies_its_commands_in_order_and_acknowledges_each() -> None:
    t = Target()
    rc = RankControl(rank=2, world_size=8, target=t)
    assert rc.apply(cmd(ControlAction.PAUSE_KERNELS, "a", ranks=(2, 5)))
    assert not rc.apply(cmd(ControlAction.PAUSE_KERNELS, "b", ranks=(1,)))  # not this rank: no ack
    assert rc.apply(cmd(ControlAction.PAUSE_KERNELS, "a", ranks=(2, 5)))  # read again: applied once
    rc.apply(cmd(ControlAction.RESUME_KERNELS, "c"))
    rc.apply(cmd(ControlAction.SAMPLE_RANKS, "d", count=4))  # {0, 2, 4, 6}: rank 2 in
    rc.apply(cmd(ControlAction.SAMPLE_RANKS, "e", count=2))  # {0, 4}: rank 2 out
    rc.apply(cmd(ControlAction.SAMPLE_RANKS, "f", ranks=(1, 2, 3), count=1))  # among 1..3: {1}
    rc.apply(cmd(ControlAction.SET, "g", key="kernel_batch_events", value="512"))
    rc.apply(cmd(ControlAction.SET, "h", key="from_a_newer_argus", value="1"))
    assert t.calls == [("pause", PauseReason.CONTROL), ("resume", PauseReason.CONTROL),
                       ("resume", PauseReason.SAMPLING), ("pause", PauseReason.SAMPLING),
                       ("pause", PauseReason.SAMPLING), ("set", ("kernel_batch_events", 512))]
    assert [a for a, _ in t.acks] == ["a", "c", "d", "e", "f", "g", "h"]
    assert t.acks[-1][1].startswith("'from_a_newer_argus' is not a runtime setting")
    assert (rc.applied, rc.refused) == (6, 1)


def test_control_thread_keeps_its_jobs_commands_and_counts_bad_ones() -> None:
    t = Target()
    thread = ControlThread(Settings(), "job-c", RankControl(0, 2, t))
    thread.handle(b"job-c/kernels/all", cmd(ControlAction.PAUSE_KERNELS, "a").encode())
    thread.handle(b"job-cc/kernels/all", ControlCommand("job-cc", "b", T0, ControlAction.RESUME_KERNELS).encode())
    thread.handle(b"job-c/kernels/all", None)  # a tombstone
    thread.handle(b"job-c/kernels/all", b"\xa7\x01garbage")
    thread.handle(None, b"x")
    assert t.calls == [("pause", PauseReason.CONTROL)]
    assert (thread.read, thread.undecodable) == (2, 1)


# -- kernel records paused and resumed -------------------------------------------------------------------


def _wait(fn: Any, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not fn():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_pause_releases_cupti_and_resume_takes_it_back(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCupti()
    monkeypatch.setattr(ck, "_load_cupti", lambda: (fake, ""))
    pub = RecordingPublisher(check=True)
    changes: list[int] = []
    k = CuptiKernels("job-p", 0, 1, pub, batch_events=2, env={}, on_change=lambda: changes.append(1))
    assert k.start().state is CuptiState.RUNNING
    fake.pending.append([kernel("before", time.time_ns(), 5)])  # still in CUPTI's buffers at the pause
    k.pause(PauseReason.CONTROL)
    assert fake.enabled == [] and k.status.state is CuptiState.PAUSED and k.status.reason == "paused: CONTROL"
    k.pause(PauseReason.PROFILER)  # a second reason: nothing more to release
    assert k.pause_reasons == (PauseReason.CONTROL, PauseReason.PROFILER)
    k.resume(PauseReason.CONTROL)
    assert fake.enabled == [] and k.status.reason == "paused: PROFILER"
    fake.completed, fake.enabled = None, []  # a profiler registered its own callbacks meanwhile
    k.resume(PauseReason.PROFILER)
    assert k.status.state is CuptiState.RUNNING and fake.completed is not None
    assert KIND_CONCURRENT_KERNEL in fake.enabled
    fake.completed([kernel("after", time.time_ns(), 5)])
    k.stop()
    names = [b.names[i] for b in pub.batches() for i in b.name_idx.tolist()]
    assert names == ["before", "after"]  # flushed before the pause, and traced again after
    assert k.pauses == 1 and len(changes) >= 4


def test_cupti_held_by_another_tool_at_start_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    class Held(FakeCupti):
        held = True

        def activity_enable(self, kind: int) -> None:
            if self.held:
                raise RuntimeError("cuptiActivityEnable: CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED")
            super().activity_enable(kind)

    fake = Held()
    monkeypatch.setattr(ck, "_load_cupti", lambda: (fake, ""))
    k = CuptiKernels("job-h", 0, 1, RecordingPublisher(), env={}, retry_s=0.05)
    status = k.start()
    assert status.state is CuptiState.PAUSED and k.pause_reasons == (PauseReason.PROFILER,)
    time.sleep(0.2)
    assert k.status.state is CuptiState.PAUSED  # still held: still paused, still trying
    fake.held = False
    _wait(lambda: k.status.state is CuptiState.RUNNING)
    assert k.pause_reasons == () and fake.enabled
    k.stop()
    assert k.status.state is CuptiState.STOPPED


def test_heartbeat_says_paused_why_and_the_last_command() -> None:
    live = LiveState()
    v = live.version
    live.set_control((PauseReason.SAMPLING,), "c1", "", 2)
    assert live.version > v
    hb = live.snapshot("j", 1, T0, {})
    assert (hb.kernels_paused, hb.pause_reasons, hb.control_ack, hb.kernel_pauses) == (
        True, (PauseReason.SAMPLING,), "c1", 2)
    hb.check()


def test_tracer_applies_control_and_heartbeats_acknowledge(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from argus.producers.rank_registry import RankRegistry
    from argus.producers.tracer import Tracer

    fake = FakeCupti()
    monkeypatch.setattr(ck, "_load_cupti", lambda: (fake, ""))
    monkeypatch.setenv("ARGUS_CUPTI", "1")
    pub = RecordingPublisher(check=True, round_trip=True)
    tr = Tracer(Settings(heartbeat_interval_s=30.0), "job-t", 0, 1, pub, registry=RankRegistry(tmp_path / "r"),
                reduce_counts=False, cuda=False)
    assert tr._control_thread is None  # a publisher passed in: no control thread unless asked
    tr.start()
    tr._control.apply(cmd(ControlAction.PAUSE_KERNELS, "p1"))
    tr._control.apply(cmd(ControlAction.SET, "s1", key="heartbeat_interval_s", value="0.2"))
    assert tr._beat is not None and tr._beat.interval_s == 0.2
    _wait(lambda: any(h.control_ack == "s1" for h in pub.of(Heartbeat)))
    last = pub.of(Heartbeat)[-1]
    assert last.kernels_paused and last.pause_reasons == (PauseReason.CONTROL,) and last.kernel_pauses == 1
    with tr.step():  # steps go on while kernels are paused
        pass
    tr._control.apply(cmd(ControlAction.RESUME_KERNELS, "r1"))
    _wait(lambda: pub.of(Heartbeat)[-1].control_ack == "r1")
    assert not pub.of(Heartbeat)[-1].kernels_paused and fake.enabled
    stats = tr.close()
    assert (stats.kernel_pauses, stats.control_applied, stats.control_refused, stats.steps) == (1, 3, 0, 1)


# -- settings and who may read and write the control topic ----------------------------------------------


def test_control_settings_are_validated() -> None:
    assert Settings.load(env={"ARGUS_CONTROL_POLL_S": "0.2"}).control_poll_s == 0.2
    with pytest.raises(ConfigError, match="control_poll_s"):
        Settings.load(env={}, control_poll_s=0)
    with pytest.raises(ConfigError, match="cupti_retry_s"):
        Settings.load(env={"ARGUS_CUPTI_RETRY_S": "-1"})


def test_ranks_read_the_control_topic_and_only_the_admin_writes_it() -> None:
    s = Settings()
    acls = acl_table(s)
    control = Topic.CONTROL.full(s)
    assert {(a.principal, a.operation) for a in acls if a.resource is Resource.TOPIC and a.name == control} == {
        (Role.RANK.value, Operation.READ), (Role.RANK.value, Operation.DESCRIBE)}
    assert any(a.principal == Role.RANK.value and a.resource is Resource.GROUP and a.name == f"{s.app_id}-control-"
               for a in acls)
