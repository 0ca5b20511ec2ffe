"""The pure-core benchmarks run end to end at a toy size (their budgets are judged at full size, not here):
a refactor that breaks a benchmark's imports or inputs fails here rather than in the next measurement."""

from __future__ import annotations

import json

import pytest

from load_tests import scale_diagnosis

pytestmark = pytest.mark.slow


def test_scale_diagnosis_runs_and_finds_its_slow_rank(capsys: pytest.CaptureFixture[str]) -> None:
    scale_diagnosis.main(["--ranks", "64", "--repeats", "1", "--l2-steps", "3", "--l1-steps", "20"])
    out = json.loads(capsys.readouterr().out)
    entry = out["results"]["64"]
    slow = entry["slow_rank"]
    assert entry["l3"]["compute"]["found"] == [f"kernel_degraded:{slow}"]
    assert entry["l3"]["collective"]["found"] == [f"late_arrival:{slow}"]
    assert f"compute_straggler:{slow}" in entry["l2"]["found"]
    assert entry["l3"]["compute"]["ms_per_window"] > 0 and entry["l2"]["ms_per_step"] > 0
    live = entry["l2"]["live"]
    assert live["columnar_same"] is True and live["columnar_decode_cpu_ms_per_step"] > 0


def test_fuzz_runs_every_target_and_reports_a_failure_with_its_seed(capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from load_tests import fuzz

    assert fuzz.main(["--minutes", "5", "--cases", "9", "--seed", "7"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {t: c["cases"] for t, c in out["targets"].items()} == {"codec": 3, "kineto": 3, "routers": 3}
    assert out["within_budget"] and out["escapes"] == 0 and out["failures"] == []

    def broken(rng: object) -> str:
        raise KeyError("boom")

    monkeypatch.setitem(fuzz.TARGETS, "codec", broken)
    assert fuzz.main(["--target", "codec", "--case-seed", "42", "--cases", "1"]) == 1
    out = json.loads(capsys.readouterr().out)
    [failure] = out["failures"]
    assert failure["case_seed"] == 42 and failure["outcome"] == "escape" and "KeyError" in failure["what"]
    assert failure["repro"].endswith("--target codec --case-seed 42 --cases 1")


def test_realtime_messages_are_the_records_own_encoding_every_step() -> None:
    """``load_tests/realtime.py`` publishes joined pre-encoded pieces (no broker here: its run through the stack
    is ``tests/integration/test_realtime_benchmark.py``): every step's messages decode to the job's records and
    equal their own encoding, the straggler's phases slow down at its onset, and its kernels are in the sample."""
    from argus.schemas.records import PhaseBatch
    from load_tests import realtime
    from load_tests.wire_templates import WireTemplate, avro_long

    p = realtime.plan(64, 0.5, 6.0, 32, 0.5, realtime.KERNEL_BATCH_EVENTS)
    assert p.steps == 12 and p.onset_step == 6 and p.slow_rank in p.sample and len(p.sample) == 32
    seqs: dict[int, int] = {}
    for s in range(p.steps):
        realtime.check(p, s)
        msgs = realtime.step_messages(p, s, seqs)
        assert sum(1 for t, _, _ in msgs if t.value == "phases") == 64
        assert sum(1 for t, _, _ in msgs if t.value == "heartbeats") == 16  # every rank once per 2 s
    slow = [PhaseBatch.decode(realtime.step_messages(p, s, {})[p.slow_rank][2]) for s in (5, 6)]
    assert sum(slow[1].duration_ns) > 1.2 * sum(slow[0].duration_ns)
    step = WireTemplate(realtime.Step("j", 0, 0, 5, 5, 5), ("rank", "step", "start_ns", "wall_ns", "gpu_ns"))
    step.check(rank=7, step=2**40, start_ns=-3, wall_ns=0, gpu_ns=1)
    assert avro_long(-1) == b"\x01" and avro_long(64) == b"\x80\x01"
