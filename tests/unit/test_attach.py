"""argus.attach and Tracer.from_env on CPU: environment parsing, topology from the environment and the process
groups, the exchange through a store, idempotence, never raising, phase and step boundaries from hooks, the
DDP communication hook (and its chaining) and the torch.distributed wrapper, in one process (gloo, world 1)."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

import argus  # noqa: E402
from argus.producers import attach as attach_mod  # noqa: E402
from argus.producers.exchange import TopologyExchange, agree, topology_from_posts  # noqa: E402
from argus.producers.groups import classify_name, discover_groups  # noqa: E402
from argus.producers.rank_registry import RankRegistry  # noqa: E402
from argus.producers.topology import build_topology, groups_of, parse_topology_spec, topology_from_groups  # noqa: E402
from argus.producers.tracer import Tracer  # noqa: E402
from argus.producers.tracer_auto import first_grad_tensor  # noqa: E402
from argus.schemas.records import JobLifecycle, JobTopology, LifecycleEvent, ParallelGroup, PhaseBatch, PhaseKind, Step  # noqa: E402
from tests.samples import RecordingPublisher  # noqa: E402

G = ParallelGroup


@pytest.fixture(autouse=True)
def fresh_process_state() -> Iterator[None]:
    """Each test gets a process without an attached tracer (attach keeps one per process)."""
    yield
    attach_mod.detach(timeout_s=2)


@pytest.fixture
def gloo(tmp_path: Path) -> Iterator[Any]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    if dist.is_initialized():
        dist.destroy_process_group()


def kw(tmp_path: Path, pub: RecordingPublisher, **more: Any) -> dict[str, Any]:
    """attach() arguments for a test: a recording publisher, no CUPTI, a private registry, a fixed job."""
    env = {"ARGUS_JOB_ID": "job-a", **more.pop("env", {})}
    return {"publisher": pub, "kernels": False, "registry": RankRegistry(tmp_path / "reg"), "env": env,
            "heartbeat": False, **more}


def tiny() -> tuple[Any, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train(model: Any, opt: Any, steps: int = 3) -> None:
    for _ in range(steps):
        loss = model(torch.randn(2, 4)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


# -- environment ---------------------------------------------------------------------------------------------


def test_read_env_rank_job_and_topology() -> None:
    e = attach_mod.read_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "run-7",
                             "ARGUS_TOPOLOGY": "dp=2, tp=2,pp=2", "ARGUS_PATCH_COLLECTIVES": "1"})
    assert (e.rank, e.world_size, e.local_rank, e.job_id) == (3, 8, 1, "run-7")
    assert e.topology == {"dp": 2, "tp": 2, "pp": 2} and e.patch_collectives and not e.disabled
    assert attach_mod.read_env({"ARGUS_JOB_ID": "mine", "TORCHELASTIC_RUN_ID": "run-7"}).job_id == "mine"
    assert attach_mod.read_env({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "42"}).job_id == "slurm-42"
    assert attach_mod.read_env({}).job_id is None
    bad = attach_mod.read_env({"RANK": "x", "WORLD_SIZE": "-1", "ARGUS_TOPOLOGY": "dp=two", "ARGUS_DISABLE": "yes"})
    assert bad.rank is None and bad.world_size is None and bad.topology == {} and bad.disabled
    assert len(bad.problems) == 3


def test_topology_spec_errors() -> None:
    assert parse_topology_spec("DP=4;TP:2") == {"dp": 4, "tp": 2}
    for spec in ("dp=0", "xp=2", "dp=2,dp=2", "dp"):
        with pytest.raises(ValueError):
            parse_topology_spec(spec)


def test_from_env_without_process_group(tmp_path: Path) -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "ARGUS_JOB_ID": "j8", "ARGUS_TOPOLOGY": "tp=2,pp=2"}
    tr = Tracer.from_env(env=env, publisher=RecordingPublisher(), kernels=False, registry=False, heartbeat=False)
    assert (tr.job_id, tr.rank, tr.world_size, tr.local_rank) == ("j8", 5, 8, 1)
    topo = tr._topology
    assert topo is not None and (topo.dp_size, topo.tp_size, topo.pp_size) == (2, 2, 2)
    assert Tracer.from_env(env=env, publisher=RecordingPublisher(), kernels=False, registry=False,
                           heartbeat=False, tp=1, pp=1)._topology.dp_size == 8  # overrides win
    with pytest.raises(ValueError):
        Tracer.from_env(env={"RANK": "4", "WORLD_SIZE": "4"}, publisher=RecordingPublisher(), kernels=False)
    tr.close(timeout_s=1)


def test_topology_from_groups_any_layout_and_derived_kinds() -> None:
    ref = build_topology("j", dp=2, tp=2, pp=2)
    given = {k: list(groups_of(ref, k).values()) for k in (G.TP, G.PP)}  # DP left out: derived
    topo = topology_from_groups("j", 8, given)
    for k in (G.DP, G.TP, G.PP):
        assert {frozenset(m) for m in groups_of(topo, k).values()} == {frozenset(m) for m in groups_of(ref, k).values()}
    assert topo.pp_stage == ref.pp_stage
    # a layout that is not Megatron's: TP across the "outer" ranks
    odd = topology_from_groups("j", 4, {G.TP: [[0, 2], [1, 3]]})
    assert groups_of(odd, G.DP) == {0: [0, 1], 1: [2, 3]} and odd.tp_size == 2
    with pytest.raises(ValueError):
        topology_from_groups("j", 4, {G.TP: [[0, 1], [1, 2]]})


def test_classify_group_names() -> None:
    assert classify_name("TENSOR_MODEL_PARALLEL_GROUP") is G.TP
    assert classify_name("mesh_dp_shard") is G.DP and classify_name("mesh_tp") is G.TP
    assert classify_name("PIPELINE_MODEL_PARALLEL_GROUP") is G.PP
    assert classify_name("EXPERT_MODEL_PARALLEL_GROUP") is G.EP
    assert classify_name("TENSOR_AND_DATA_PARALLEL_GROUP") is None and classify_name("default_pg") is None


def test_groups_from_names_and_megatron(gloo: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    tp = dist.new_group([0], group_desc="tp")
    assert discover_groups()[G.TP] is tp
    ps = types.SimpleNamespace(model_parallel_is_initialized=lambda: True,
                               get_tensor_model_parallel_group=lambda: "mtp",
                               get_data_parallel_group=lambda with_context_parallel=False: "mdp")
    core = types.ModuleType("megatron.core")
    core.parallel_state = ps  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron", types.ModuleType("megatron"))
    monkeypatch.setitem(sys.modules, "megatron.core", core)
    found = discover_groups({"pp": "mine"})
    assert found[G.TP] == "mtp" and found[G.DP] == "mdp" and found[G.PP] == "mine"  # explicit, Megatron, names


def test_exchange_through_a_store() -> None:
    store = dist.HashStore()
    ref = build_topology("jx", dp=2, tp=2)
    r0 = TopologyExchange(store, "jx", 0, 4, lifecycle=True, timeout_s=5)
    others = [TopologyExchange(store, "jx", r, 4, lifecycle=False, timeout_s=5) for r in (1, 2, 3)]
    for ex in [r0, *others]:
        tp = next(m for m in groups_of(ref, G.TP).values() if ex.rank in m)
        ex.post(f"host{ex.rank // 2}", {G.TP: tp})
    topo = r0.resolve()
    assert topo is not None and topo.tp_size == 2 and topo.dp_size == 2
    assert topo.host == ("host0", "host0", "host1", "host1")
    assert others[0].resolve() == topo  # the others read what the lifecycle rank posted
    late = TopologyExchange(dist.HashStore(), "jy", 0, 2, lifecycle=True, timeout_s=0.2)
    assert late.resolve() is None  # rank 1 never posted: the caller keeps its local topology
    assert agree(store, "argus/job_id", "first") == "first" and agree(store, "argus/job_id", "second") == "first"
    assert topology_from_posts("j", 2, [{"host": "a"}, {"host": "b"}], {"dp": 2}).host == ("a", "b")
    plain = topology_from_posts("j", 4, [{"host": "a", "groups": {}}] * 4)  # no groups reported: pure DP
    assert (plain.dp_size, plain.tp_size, plain.pp_size) == (4, 1, 1) and set(plain.dp_group) == {0}


# -- attach: hooks, steps, idempotence ---------------------------------------------------------------------


def test_attach_phases_and_steps_from_hooks(tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True)
    model, opt = tiny()
    tr = argus.attach(model, opt, **kw(tmp_path, pub))
    assert argus.current_tracer() is tr and tr.step_mode == "auto"
    train(model, opt, 3)
    with torch.no_grad():  # evaluation between steps: no iteration begins
        model(torch.randn(2, 4))
    tr.close()
    steps, batches = pub.of(Step), pub.of(PhaseBatch)
    assert [s.step for s in steps] == [0, 1, 2]
    for b in batches:
        assert b.names == ("forward", "backward", "optimizer")
        assert b.kinds == (PhaseKind.FORWARD, PhaseKind.BACKWARD, PhaseKind.OPTIMIZER)
        fwd, bwd, opt_ = (b.start_ns[i] for i in range(3))
        assert fwd <= bwd <= opt_  # in order, not nested
        assert b.start_ns[0] + b.duration_ns[0] <= b.start_ns[1] + 1000
    topo = pub.of(JobTopology)[0]
    assert topo.job_id == "job-a" and topo.world_size == 1
    assert [lc.event for lc in pub.of(JobLifecycle)] == [LifecycleEvent.START, LifecycleEvent.END]


def test_attach_twice_same_tracer_no_double_hooks(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pub = RecordingPublisher(check=True)
    model, opt = tiny()
    tr = argus.attach(model, opt, **kw(tmp_path, pub))
    n = len(tr._handles)
    with caplog.at_level(logging.WARNING):
        assert argus.attach(model, opt, job_id="other") is tr
    assert len(tr._handles) == n and "ignoring ['job_id']" in caplog.text
    train(model, opt, 2)
    tr.close()
    assert [b.names for b in pub.of(PhaseBatch)] == [("forward", "backward", "optimizer")] * 2


def test_manual_steps_are_respected(tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True)
    model, opt = tiny()
    tr = argus.attach(model, opt, **kw(tmp_path, pub))
    for i in range(2):
        with tr.step(10 + i):  # two optimizer steps in each of the user's iterations
            train(model, opt, 2)
    tr.close()
    assert tr.step_mode == "manual" and [s.step for s in pub.of(Step)] == [10, 11]
    assert pub.of(PhaseBatch)[0].names == ("forward", "backward", "optimizer") * 2


def test_external_boundaries(tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True)
    model, opt = tiny()
    tr = argus.attach(model, opt, **kw(tmp_path, pub))
    tr.begin_step()
    train(model, opt, 2)  # the optimizer no longer ends iterations
    tr.end_step()
    tr.close()
    assert tr.step_mode == "external" and len(pub.of(Step)) == 1


def test_disabled_and_never_raising(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = tiny()
    off = argus.attach(model, opt, **kw(tmp_path, RecordingPublisher(), env={"ARGUS_DISABLE": "1"}))
    assert off.job_id == "argus-disabled" and not off._handles

    class Exploding(RecordingPublisher):
        def publish(self, topic: Any, key: bytes, record: Any) -> bool:
            raise RuntimeError("broker on fire")

    with caplog.at_level(logging.WARNING):
        tr = argus.attach(object(), object(), **kw(tmp_path, Exploding()))  # no hook support either
        tr2 = argus.attach(model, opt)
        assert tr2 is tr
        train(model, opt, 2)
        tr.close()
    assert tr.stats().errors >= 1
    # attach itself failing (a bad argument) still returns a tracer
    assert isinstance(argus.attach(model, opt, **kw(tmp_path, RecordingPublisher(), rank=3, world_size=2)),
                      Tracer)


def test_first_grad_tensor_finds_outputs() -> None:
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    assert first_grad_tensor({"loss": y, "n": 1}) is y and first_grad_tensor((torch.ones(1), [y])) is y
    assert first_grad_tensor(torch.ones(1)) is None and first_grad_tensor("text") is None


def test_destroy_process_group_closes_the_tracer(tmp_path: Path, gloo: Any) -> None:
    pub = RecordingPublisher(check=True)
    model, opt = tiny()
    tr = argus.attach(model, opt, **kw(tmp_path, pub))
    train(model, opt, 2)
    dist.destroy_process_group()
    assert tr._closed and argus.current_tracer() is None
    end = pub.of(JobLifecycle)[-1]
    assert end.event is LifecycleEvent.END and end.steps == 2


# -- DDP communication hook ----------------------------------------------------------------------------------


def ddp_pair(bucket_mb: float = 0.0001) -> tuple[Any, Any, Any, Any]:
    """A DDP model and a plain twin with the same weights (world 1: DDP must not change the gradients)."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    twin.load_state_dict(plain.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(twin, bucket_cap_mb=bucket_mb)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), plain, torch.optim.SGD(plain.parameters(), lr=0.1)


def train_same(ddp: Any, opt: Any, plain: Any, popt: Any, steps: int = 3) -> None:
    torch.manual_seed(1)
    batches = [torch.randn(2, 4) for _ in range(steps)]
    train_on(ddp, opt, batches)
    train_on(plain, popt, batches)
    for a, b in zip(ddp.module.parameters(), plain.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def train_on(model: Any, opt: Any, batches: list[Any]) -> None:
    for x in batches:
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_ddp_buckets_timed_gradients_unchanged(tmp_path: Path, gloo: Any) -> None:
    pub = RecordingPublisher(check=True)
    ddp, opt, plain, popt = ddp_pair()
    tr = argus.attach(ddp, opt, **kw(tmp_path, pub))
    train_same(ddp, opt, plain, popt)
    tr.close()
    for b in pub.of(PhaseBatch):
        comm = [i for i, n in enumerate(b.names) if n == "dp-allreduce"]
        assert comm and all(b.kinds[i] is PhaseKind.ALL_REDUCE and b.groups[i] is G.DP for i in comm)
        assert b.names[0] == "forward" and b.names[-1] == "optimizer"
    assert tr.stats().errors == 0


def test_user_comm_hook_after_attach_is_chained(tmp_path: Path, gloo: Any) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    pub = RecordingPublisher(check=True)
    ddp, opt, plain, popt = ddp_pair()
    tr = argus.attach(ddp, opt, **kw(tmp_path, pub))
    calls: list[int] = []

    def my_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, my_hook)  # DDP alone would refuse a second hook
    train_same(ddp, opt, plain, popt)
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    train_on(ddp, opt, [torch.randn(2, 4)])
    tr.close()
    assert calls and all("dp-allreduce" in b.names for b in pub.of(PhaseBatch))
    with pytest.raises(ValueError):
        ddp._register_builtin_comm_hook("no such hook")


def test_comm_hook_registered_before_attach_is_left_alone(tmp_path: Path, gloo: Any,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    pub = RecordingPublisher(check=True)
    ddp, opt, plain, popt = ddp_pair()
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    with caplog.at_level(logging.WARNING):
        tr = argus.attach(ddp, opt, **kw(tmp_path, pub))
    assert "already has a communication hook" in caplog.text
    train_same(ddp, opt, plain, popt)
    tr.close()
    assert all("dp-allreduce" not in b.names and "forward" in b.names for b in pub.of(PhaseBatch))


# -- torch.distributed wrapper -------------------------------------------------------------------------------


def test_patched_collectives(tmp_path: Path, gloo: Any) -> None:
    pub = RecordingPublisher(check=True)
    original = dist.all_reduce
    tp = dist.new_group([0], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
    tr = argus.attach(**kw(tmp_path, pub, patch_collectives=True))
    assert dist.all_reduce is not original and dist.all_reduce.__wrapped__ is original
    t = torch.ones(4)
    dist.all_reduce(t)  # outside an iteration: runs, not timed
    with tr.step():
        dist.all_reduce(t)
        dist.all_reduce(t, group=tp)
        dist.all_reduce(t, async_op=True).wait()
        dist.broadcast(t, 0)
        out = torch.zeros(4)
        dist.all_gather_into_tensor(out, t)
        tr.all_reduce(t)  # the tracer's own wrapper: timed once, not twice
    tr.close()
    assert dist.all_reduce is original  # close() undid the patch
    (batch,) = pub.of(PhaseBatch)
    assert batch.names == ("dp-allreduce", "tp-allreduce", "dp-allreduce", "dp-broadcast", "dp-all-gather",
                           "dp-allreduce")
    assert batch.groups[1] is G.TP and t.tolist() == [1.0] * 4 and out.tolist() == [1.0] * 4


class NoFutureWork:
    """A host Work without a future (gloo send/recv): the wrapper hands back a proxy."""

    def __init__(self) -> None:
        self.waited = 0

    def wait(self, timeout: Any = None) -> bool:
        self.waited += 1
        return True

    def get_future(self) -> Any:
        raise RuntimeError("no futures for p2p")

    def is_completed(self) -> bool:
        return True


def test_async_host_work_proxy_ends_the_phase(tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True)
    tr = argus.attach(**kw(tmp_path, pub))
    works = [NoFutureWork(), NoFutureWork()]
    with tr.step():
        got = tr._timed_launch("pp-send-recv", PhaseKind.SEND_RECV, G.PP, torch.ones(1), None, True,
                               lambda: works, proxy=True)
        assert got[0].is_completed()  # attributes pass through
        for w in got:
            w.wait()
            w.wait()
    tr.close()
    (batch,) = pub.of(PhaseBatch)
    assert batch.names == ("pp-send-recv",) and [w.waited for w in works] == [2, 2]


# -- CUDA-mode bookkeeping with a fake torch.cuda (no GPU here) ----------------------------------------------


class FakeFuture:
    def __init__(self, value: Any) -> None:
        self._value = value

    def then(self, cb: Any) -> FakeFuture:
        return FakeFuture(cb(self))

    def value(self) -> Any:
        return self._value


def test_bucket_timed_on_the_communication_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import argus.producers.tracer as tracer_mod
    import argus.producers.tracer_collectives as coll_mod
    import argus.producers.tracer_patch as patch_mod
    from tests.unit.test_tracer import FakeCuda, FakeCudaTensor, FakeTorch

    cuda = FakeCuda()
    for mod in (tracer_mod, coll_mod, patch_mod):
        monkeypatch.setattr(mod, "torch", FakeTorch(cuda))
    pub = RecordingPublisher(check=True)
    tr = Tracer(None, "job-c", 0, 1, pub, kernels=False, registry=False, heartbeat=False, cuda=True).start()
    bucket = FakeCudaTensor()
    with tr.step():
        fut = tr._timed_future("dp-allreduce", PhaseKind.ALL_REDUCE, G.DP, bucket, None,
                               lambda: FakeFuture("reduced"))
        sync = tr._timed_launch("tp-allreduce", PhaseKind.ALL_REDUCE, G.TP, bucket, None, False, lambda: None)
    tr.close()
    assert fut.value() == "reduced" and sync is None
    (batch,) = pub.of(PhaseBatch)
    comm = next(s for _, s, _ in [e for e in cuda.log if e[0] == "wait"])
    assert batch.names == ("dp-allreduce", "tp-allreduce")
    assert batch.streams[0] == comm.stream_id and batch.streams[1] == cuda.default.stream_id
    records = [s for kind, _, s in cuda.log if kind == "record"]
    assert records[1:3] == [comm, comm]  # both bucket events on the communication stream


def test_fsdp_comm_wrapper(tmp_path: Path, gloo: Any) -> None:
    from argus.producers.tracer_ddp import TimedComm

    class Comm:  # what FSDP2 holds: allocate() and a call returning None (sync) or a Work
        def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False) -> Any:
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    pub = RecordingPublisher(check=True)
    tr = argus.attach(**kw(tmp_path, pub))
    comm = TimedComm(tr, Comm(), PhaseKind.ALL_GATHER)
    out = comm.allocate((4,), dtype=torch.float32, device="cpu")
    with tr.step():
        assert comm(out, torch.ones(4), dist.group.WORLD) is None
        comm(out, torch.ones(4), dist.group.WORLD, async_op=True).wait()
    tr.close()
    (batch,) = pub.of(PhaseBatch)
    assert batch.names == ("dp-all-gather", "dp-all-gather") and batch.groups == (G.DP, G.DP)


def test_from_env_with_a_process_group_agrees_on_a_job_id(tmp_path: Path, gloo: Any) -> None:
    kwargs = {"publisher": RecordingPublisher(), "kernels": False, "registry": False, "heartbeat": False}
    a = Tracer.from_env(env={}, **kwargs)
    b = Tracer.from_env(env={}, **kwargs)
    assert a.job_id == b.job_id and a.job_id.count("-") >= 3  # <script>-<date>-<time>-<random>, via the store
    assert (a.rank, a.world_size) == (0, 1) and a._topology is not None and a._topology.host == (a.host,)
    a.close(timeout_s=1)
    b.close(timeout_s=1)


def test_closed_at_exit_within_its_timeout(tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True)
    model, opt = tiny()
    tr = argus.attach(model, opt, **kw(tmp_path, pub, close_timeout_s=2))
    train(model, opt, 1)
    attach_mod._close_current("atexit")
    assert tr._closed and pub.of(JobLifecycle)[-1].event is LifecycleEvent.END
    again = argus.attach(model, opt, **kw(tmp_path, pub))  # a new tracer continues the step count
    assert again is not tr and again._next_step == 1


def test_late_exchange_start_still_precedes_end(tmp_path: Path) -> None:
    import threading

    pub = RecordingPublisher(check=True)
    tr = Tracer(None, "job-late", 0, 2, pub, kernels=False, registry=False, heartbeat=False, dp=2)
    tr._topology = build_topology("job-late", dp=2)
    release = threading.Event()

    def never_resolves() -> None:  # a peer that never posts (until released)
        release.wait(5)

    tr._topology_fn = never_resolves
    tr.start()
    assert not pub.of(JobLifecycle)  # START waits for the exchange, off the training thread
    tr.close(timeout_s=0.3)
    release.set()
    tr._topology_thread.join(5)
    events = [lc.event for lc in pub.of(JobLifecycle)]
    assert events == [LifecycleEvent.START, LifecycleEvent.END] and len(pub.of(JobTopology)) == 1


def test_layer_phases_nest_in_the_heartbeat_state(tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True)
    model, opt = tiny()
    seen: list[int] = []
    own = model[2].forward

    def recording(*args: Any) -> Any:  # runs inside argus's wrapper of "2"
        seen.append(tr._live.depth)
        return own(*args)

    model[2].forward = recording  # an instance wrapper of the user's, wrapped in turn by attach
    tr = argus.attach(model, opt, modules=("0", "2"), **kw(tmp_path, pub))
    train(model, opt, 2)
    assert tr._live.depth == 0 and seen == [2, 2]  # inside "2": "forward" and "2" are open ("0" ended)
    tr.close()
    assert vars(model[2])["forward"] is recording  # the user's own wrapper is put back
    for b in pub.of(PhaseBatch):
        assert b.names == ("forward", "0", "2", "backward", "optimizer")
