"""``argus import-kineto``: publish a directory of torch.profiler / Kineto traces (one file per rank) as a job.

Every file is parsed and checked first (:mod:`argus.producers.kineto_parse`, bounded memory): a bad or hostile
file aborts the import with a :class:`~argus.core.errors.ProducerError` naming it, and nothing of the job reaches
Kafka. Then the job's topology, START, every step's Step and PhaseBatch, each rank's KernelBatches and END are
published, as a traced job's would be.

The order of publication, the topology sources and the clocks: docs/internals/producers.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from argus.core.errors import ConfigError, ProducerError
from argus.core.settings import Settings
from argus.producers.gpu_ids import kineto_gpu
from argus.producers.kineto_groups import MEGATRON_GROUPS, PhaseGroups, co_ended_streams
from argus.producers.kineto_parse import MAX_FILE_BYTES, MemoryBudget, Phase, RankTrace, assign_steps, parse_rank
from argus.producers.publisher import MAX_MESSAGE_BYTES, Publisher
from argus.producers.topology import GROUP_COLUMN, build_topology, groups_of
from argus.schemas.records import (
    JobLifecycle,
    JobTopology,
    KernelBatch,
    LifecycleEvent,
    ParallelGroup,
    PhaseBatch,
    Record,
    Step,
)
from argus.topics import PublisherLike, Topic, job_key, publish_in_order, rank_key

__all__ = ["ALIGN_THRESHOLD_NS", "ImportReport", "PublisherLike", "find_traces", "import_kineto", "kernel_batches",
           "parse_topology", "rank_records", "read_trace", "step_records", "topology_from_pg_config",
           "with_stream_groups"]

log = logging.getLogger(__name__)

#: Skew of first step starts beyond which ranks are aligned by default (10 ms).
ALIGN_THRESHOLD_NS = 10_000_000
_SUFFIXES = (".json", ".json.gz")


@dataclass(frozen=True)
class ImportReport:
    """What :func:`import_kineto` found and published."""

    job_id: str
    files: tuple[str, ...]
    ranks: tuple[int, ...]
    #: Ranks of the published job (``distributedInfo.world_size`` unless only some ranks' traces are there).
    world_size: int
    #: ``distributedInfo.world_size`` of the traces (None if absent).
    trace_world_size: int | None
    #: 'pg_config', 'flag' or 'default'.
    topology_source: str
    #: e.g. 'dp=8,tp=1,pp=1'.
    topology: str
    kernel_events: int
    kernel_batches: int
    steps: int
    phases: int
    phase_batches: int
    #: Events skipped, by reason ('negative_dur', 'missing_ts', ...).
    skipped_events: Mapping[str, int]
    #: Per rank: its first common ProfilerStep start minus the reference rank's, ns (before alignment).
    clock_offsets_ns: Mapping[int, int]
    clock_aligned: bool
    #: Per rank: kernel events per CUDA stream.
    streams: Mapping[int, Mapping[int, int]]
    #: Distinct NCCL kernel names (``ncclKernel_*`` and ``ncclDevKernel_*``), sorted.
    nccl_kernels: tuple[str, ...]
    #: Largest lag of a kernel start behind an earlier one in file order (what windows must tolerate).
    max_out_of_order_ns: int
    records_published: int
    records_dropped: int
    seconds: float
    messages: tuple[str, ...]


def with_stream_groups(topo: JobTopology, traces: Sequence[RankTrace], messages: list[str]) -> JobTopology:
    """``topo`` with the collective streams whose NCCL kernels named their process group
    (:attr:`~argus.producers.kineto_parse.RankTrace.stream_pgs`): a stream whose group is of one kind on every rank
    that names it; a stream named as different kinds by different ranks is left out (and said in
    ``messages``). The other NCCL streams' groups are recovered from which ranks' calls end together
    (:func:`~argus.producers.kineto_groups.co_ended_streams`), where that names one."""
    groups = PhaseGroups(topo)
    kinds: dict[int, set[ParallelGroup]] = {}
    for t in traces:
        for stream, pg in t.stream_pgs.items():
            kinds.setdefault(stream, set()).add(groups.stream_group(t.rank, pg))
    known = {st: next(iter(ks)) for st, ks in sorted(kinds.items()) if len(ks) == 1 and ParallelGroup.NONE not in ks}
    mixed = sorted(st for st, ks in kinds.items() if len(ks - {ParallelGroup.NONE}) > 1)
    if mixed:
        messages.append(f"streams {mixed[:8]} carry collectives of different groups on different ranks: "
                        f"their group is not published")
    if known:
        messages.append("collective streams by process group: "
                        + ", ".join(f"{st}={g.value}" for st, g in known.items()))
    ended = co_ended_streams(topo, traces, skip=[*known, *mixed])
    if ended:
        messages.append("collective streams by the ranks whose calls end together: "
                        + ", ".join(f"{st}={g.value}" for st, g in ended.items()))
    known = dict(sorted((known | ended).items()))
    return dataclasses.replace(topo, group_streams=tuple(known), group_kinds=tuple(known.values()))


def step_records(trace: RankTrace, job_id: str, shift_ns: int = 0,
                 groups: PhaseGroups | None = None) -> list[tuple[Step | None, PhaseBatch]]:
    """Per step of one rank, ascending: its Step and its PhaseBatch (empty when the step has no phases: the
    detectors count a step complete once every rank sent both). Phases outside every step go to step -1,
    which has no Step. ``shift_ns`` is added to every time (clock alignment). With ``groups`` (the job's
    :class:`~argus.producers.kineto_groups.PhaseGroups`), sends and receives between pipeline stages or inside
    expert groups are named by their role and carry their group, and collectives on a stream whose NCCL
    kernels name their process group (or whose group the topology knows: ``group_streams``) carry that group;
    other phases have group NONE."""
    on_stream = ({**groups.stream_groups(), **{st: groups.stream_group(trace.rank, pg)
                                               for st, pg in trace.stream_pgs.items()}}
                 if groups is not None else {})
    starts = np.array([p.start_ns for p in trace.phases], dtype=np.int64)
    steps = np.where(np.array([p.on_gpu for p in trace.phases], dtype=bool),
                     assign_steps(trace.intervals(gpu=True), starts), assign_steps(trace.intervals(gpu=False), starts))
    by_step: dict[int, list[Phase]] = {s.step: [] for s in trace.steps}
    for p, step in zip(trace.phases, steps.tolist(), strict=True):
        by_step.setdefault(step, []).append(p)
    spans = {s.step: s for s in trace.steps}
    out: list[tuple[Step | None, PhaseBatch]] = []
    for step, ps in sorted(by_step.items()):
        s = spans.get(step)
        named = ([groups.phase(trace.rank, p.name, p.kind, on_stream.get(p.stream, ParallelGroup.NONE)
                               if p.on_gpu else ParallelGroup.NONE) for p in ps] if groups is not None
                 else [(p.name, ParallelGroup.NONE) for p in ps])
        rec = None if s is None else Step(
            job_id, trace.rank, step, s.start_ns + shift_ns, s.dur_ns,
            None if s.kernel_start_ns is None or s.kernel_end_ns is None else s.kernel_end_ns - s.kernel_start_ns,
            s.expert_tokens)
        out.append((rec, PhaseBatch(job_id, trace.rank, step, tuple(p.kind for p in ps), tuple(n for n, _ in named),
                                    tuple(g for _, g in named), tuple(p.stream for p in ps),
                                    tuple(p.start_ns + shift_ns for p in ps), tuple(p.dur_ns for p in ps))))
    return out


def kernel_batches(trace: RankTrace, job_id: str, batch_events: int = 4096, shift_ns: int = 0,
                   host: str = "") -> Iterator[KernelBatch]:
    """One rank's kernels in file order, ``batch_events`` per batch (seq from 0); the last (possibly empty)
    one has ``end_of_stream``."""
    if batch_events < 1:
        raise ValueError(f"batch_events must be >= 1, got {batch_events}")
    iv, seq, pending = trace.intervals(gpu=True), 0, None
    for rows in trace.rows(batch_events):
        if pending is not None:
            yield _kernel_batch(job_id, trace, seq - 1, pending, iv, shift_ns, host, eos=False)
        pending, seq = rows, seq + 1
    if pending is None:
        yield KernelBatch.empty(job_id, trace.rank, 0, end_of_stream=True, host=host)
    else:
        yield _kernel_batch(job_id, trace, seq - 1, pending, iv, shift_ns, host, eos=True)


def rank_records(trace: RankTrace, job_id: str, batch_events: int = 4096, shift_ns: int = 0,
                 host: str = "") -> Iterator[Record]:
    """One rank's records: per step its Step and PhaseBatch (:func:`step_records`), then its KernelBatches."""
    for st, ph in step_records(trace, job_id, shift_ns):
        if st is not None:
            yield st
        yield ph
    yield from kernel_batches(trace, job_id, batch_events, shift_ns, host)


def _kernel_batch(job_id: str, trace: RankTrace, seq: int, rows: Any, iv: Any, shift_ns: int, host: str,
                  eos: bool) -> KernelBatch:
    uniq, inv = np.unique(rows["name"], return_inverse=True)
    graph, node = graph_columns(rows, trace.graph_launches)
    return KernelBatch(job_id=job_id, rank=trace.rank, seq=seq, names=tuple(trace.names[i] for i in uniq.tolist()),
                       name_idx=inv.astype(np.uint32), stream=rows["stream"], start_ns=rows["start"] + shift_ns,
                       duration_ns=rows["dur"], step=assign_steps(iv, rows["start"]), host=host, end_of_stream=eos,
                       graph_id=graph, graph_node_id=node)


def graph_columns(rows: Any, launches: frozenset[int]) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.int64]]:
    """Per kernel row, its CUDA graph and node: the trace's ``graph id`` where it names one, else
    :attr:`KernelBatch.UNKNOWN_GRAPH` for a kernel of a ``cudaGraphLaunch`` (its correlation id is one of
    ``launches``: HTA's graph-launched kernels, missing from launch-based analyses), else 0."""
    graph = rows["graph"].astype(np.uint32)
    if launches:
        corr = rows["corr"]
        launched = np.isin(corr, np.fromiter(launches, np.int64, len(launches))) & (corr >= 0) & (graph == 0)
        graph[launched] = KernelBatch.UNKNOWN_GRAPH
    return graph, rows["node"]


def read_trace(path: Path, job_id: str = "kineto", batch_events: int = 4096, *,
               max_file_bytes: int = MAX_FILE_BYTES) -> Iterator[Record]:
    """Parse one rank's file and yield its records (see :func:`rank_records`); pure, no Kafka.

    Raises :class:`ProducerError` like :func:`~argus.producers.kineto_parse.parse_rank`."""
    with parse_rank(Path(path), max_file_bytes=max_file_bytes) as trace:
        yield from rank_records(trace, job_id, batch_events, host=trace.host or "")


def parse_topology(spec: str) -> dict[str, int]:
    """``'dp=4,tp=2,pp=1'`` (any order; ``ep`` optional; missing degrees 1) to degrees. Raises ConfigError."""
    out = {"dp": 1, "tp": 1, "pp": 1, "ep": 1}
    seen: set[str] = set()
    for part in spec.split(","):
        key, sep, value = part.strip().partition("=")
        key = key.strip().lower()
        if not sep or key not in out or key in seen or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"invalid topology {spec!r}: expected e.g. 'dp=4,tp=2,pp=1' with degrees >= 1")
        seen.add(key)
        out[key] = int(value)
    if out["dp"] % out["ep"]:
        raise ConfigError(f"invalid topology {spec!r}: ep={out['ep']} must divide dp={out['dp']}")
    return out


def find_traces(directory: Path) -> list[Path]:
    """The ``.json`` / ``.json.gz`` files under ``directory`` (recursively, sorted), or the file itself."""
    directory = Path(directory)
    if directory.is_file():
        return [directory]
    if not directory.is_dir():
        raise ProducerError(f"{directory}: no such directory")
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name.lower().endswith(_SUFFIXES))
    if not files:
        raise ProducerError(f"{directory}: no .json or .json.gz trace files")
    return files


def topology_from_pg_config(job_id: str, world_size: int, pg_configs: Iterable[Mapping[str, Any]],
                            hosts_per_node: int = 8) -> JobTopology | None:
    """A topology from Megatron process-group descriptions (all files' ``pg_config`` entries), else None.

    Groups are matched by ``pg_desc``; the Megatron-order layout of :func:`build_topology` is used when it has
    exactly these groups, otherwise the groups are taken as they are (indices by lowest member, pipeline
    stage = position in the ``ranks`` list; ranks in no group of a kind get a group of their own).
    """
    by_members: dict[ParallelGroup, dict[frozenset[int], tuple[int, ...]]] = {}
    for pg in pg_configs:
        kind = MEGATRON_GROUPS.get(str(pg.get("pg_desc", "")).strip().upper())
        ranks = pg.get("ranks")
        if kind is None or not isinstance(ranks, list) or not ranks:
            continue
        if all(type(r) is int and 0 <= r < world_size for r in ranks):  # each rank's file repeats its groups
            by_members.setdefault(kind, {}).setdefault(frozenset(ranks), tuple(ranks))
    found = {k: set(v.values()) for k, v in by_members.items()}
    if not found:
        return None
    for kind, groups in found.items():
        members = [r for g in groups for r in g]
        if len(members) != len(set(members)):
            raise ProducerError(f"pg_config: {kind.value} groups overlap: {sorted(groups)[:4]}")
    size = {k: len(next(iter(g))) for k, g in found.items()}
    tp, pp = size.get(ParallelGroup.TP, 1), size.get(ParallelGroup.PP, 1)
    dp = size.get(ParallelGroup.DP, world_size // (tp * pp) if world_size % (tp * pp) == 0 else 0)
    ep = size.get(ParallelGroup.EP, 1)
    if dp and dp * tp * pp == world_size and dp % ep == 0:
        topo = build_topology(job_id, dp, tp, pp, ep, hosts_per_node)
        if all({frozenset(g) for g in groups} <= {frozenset(m) for m in groups_of(topo, kind).values()}
               for kind, groups in found.items()):
            return topo
    return _custom_topology(job_id, world_size, found, hosts_per_node)


def _custom_topology(job_id: str, world: int, found: dict[ParallelGroup, set[tuple[int, ...]]],
                     hosts_per_node: int) -> JobTopology:
    cols: dict[str, list[int]] = {}
    stage = [0] * world
    for kind, column in GROUP_COLUMN.items():
        groups = sorted(found.get(kind, ()), key=min)
        index = [-1] * world
        for i, g in enumerate(groups):
            for pos, r in enumerate(g):
                index[r] = i
                if kind is ParallelGroup.PP:
                    stage[r] = pos
        nxt = len(groups)
        for r in range(world):
            if index[r] < 0:
                index[r], nxt = nxt, nxt + 1
        cols[column] = index
    size = {k: len(next(iter(g))) if g else 1 for k, g in found.items()}
    return JobTopology(
        job_id=job_id, world_size=world, dp_size=size.get(ParallelGroup.DP, 1), tp_size=size.get(ParallelGroup.TP, 1),
        pp_size=size.get(ParallelGroup.PP, 1), ep_size=size.get(ParallelGroup.EP, 1), rank=tuple(range(world)),
        host=tuple(f"node{r // hosts_per_node:04d}" for r in range(world)),
        dp_group=tuple(cols["dp_group"]), tp_group=tuple(cols["tp_group"]), pp_group=tuple(cols["pp_group"]),
        ep_group=tuple(cols["ep_group"]), pp_stage=tuple(stage))


def _resolve_topology(job_id: str, world: int, traces: list[RankTrace], flag: str | None,
                      messages: list[str]) -> tuple[JobTopology, str]:
    topo = topology_from_pg_config(job_id, world, [g for t in traces for g in t.pg_config])
    if topo is not None:
        if flag:
            messages.append(f"--topology {flag} ignored: the traces' pg_config gives the process groups")
        return topo, "pg_config"
    if flag:
        deg = parse_topology(flag)
        if deg["dp"] * deg["tp"] * deg["pp"] != world:
            raise ConfigError(f"topology {flag}: dp*tp*pp = {deg['dp'] * deg['tp'] * deg['pp']}, but the world size "
                              f"is {world} (distributedInfo.world_size or the ranks found)")
        return build_topology(job_id, deg["dp"], deg["tp"], deg["pp"], deg["ep"]), "flag"
    return build_topology(job_id, world), "default"


def _clock_offsets(traces: list[RankTrace], messages: list[str]) -> tuple[dict[int, int], bool]:
    """Per rank: reference time minus the reference rank's; and whether they come from step annotations."""
    if all(t.steps for t in traces):
        common = set.intersection(*({s.step for s in t.steps} for t in traces))
        step = min(common) if common else None
        starts = {t.rank: next(s.start_ns for s in t.steps if s.step == step) if step is not None
                  else t.steps[0].start_ns for t in traces}
        basis = f"ProfilerStep#{step} start" if step is not None else "first ProfilerStep start"
        from_steps = True
    else:
        starts = {t.rank: t.first_kernel_ns for t in traces if t.first_kernel_ns is not None}
        basis, from_steps = "first kernel start (no ProfilerStep annotations on every rank)", False
    if not starts:
        return {}, False
    ref = min(starts)
    offsets = {r: s - starts[ref] for r, s in sorted(starts.items())}
    skew = max(offsets.values()) - min(offsets.values())
    messages.append(f"clock offsets from the {basis}, relative to rank {ref}: skew {skew / 1e6:.3f} ms")
    return offsets, from_steps


def import_kineto(settings: Settings, directory: Path, job_id: str, topology: str | None = None,
                  batch_events: int | None = None, progress: Callable[[str], None] | None = None,
                  publisher: PublisherLike | None = None, align_clocks: bool | None = None, *,
                  max_file_bytes: int = MAX_FILE_BYTES,
                  advance: Callable[[int, int | None], None] | None = None) -> ImportReport:
    """Import the Kineto traces under ``directory`` (one file per rank) as job ``job_id``.

    Args:
        settings: Kafka settings and defaults (``publisher_batch_events``).
        directory: a directory searched recursively for ``.json`` / ``.json.gz`` files, or one file.
        job_id: the job's identifier in argus.
        topology: ``'dp=…,tp=…,pp=…'`` used when the traces carry no Megatron ``pg_config`` groups.
        batch_events: kernel events per KernelBatch (default ``settings.publisher_batch_events``).
        progress: called with one line of text per stage and per rank.
        publisher: anything with ``publish(topic, key, record) -> bool`` and ``flush()``; default a lossless
            :class:`~argus.producers.publisher.Publisher`, closed at the end.
        align_clocks: shift ranks so their first common step starts coincide (see the module docstring);
            None: only when the skew exceeds :data:`ALIGN_THRESHOLD_NS`.
        max_file_bytes: the most bytes one rank's file may hold after decompression (default
            :data:`~argus.producers.kineto_parse.MAX_FILE_BYTES`, 2 GiB).
        advance: called as ``advance(done, total)`` with rank files parsed plus ranks published, of twice
            the number of files (a progress bar).

    Raises:
        ProducerError: a file is not a trace or is refused as hostile (too deep, too long a number or string,
            too large, a rank or world size out of bounds: see :func:`~argus.producers.kineto_parse.parse_rank`; the
            message names the file and the event), keeps more than ``settings.import_max_memory_mb`` of
            annotations, names and process groups, two files claim one rank, a rank is outside the world size,
            the topology encodes to more than one Kafka message holds, nothing at all is kept, or records could not
            be published.
        ConfigError: ``topology`` is malformed or does not multiply to the world size.
    """
    t0 = time.perf_counter()
    if not job_id:
        raise ProducerError("job id must not be empty")
    say = progress or (lambda _msg: None)
    batch = batch_events or settings.publisher_batch_events
    if batch < 1:
        raise ProducerError(f"batch_events must be >= 1, got {batch}")
    files = find_traces(directory)
    budget = MemoryBudget(settings.import_max_memory_mb << 20)
    tick = advance or (lambda _done, _total: None)
    messages: list[str] = []
    with tempfile.TemporaryDirectory(prefix="argus-kineto-") as spill, contextlib.ExitStack() as stack:
        traces: list[RankTrace] = []
        for i, path in enumerate(files):
            trace = stack.enter_context(parse_rank(path, Path(spill), max_file_bytes=max_file_bytes,
                                                   budget=budget))
            traces.append(trace)
            say(f"[{i + 1}/{len(files)}] {path.name}: rank {trace.rank}, {trace.kernel_events:,} kernel events, "
                f"{len(trace.steps)} steps, {len(trace.phases)} phases")
            tick(i + 1, 2 * len(files))
        traces.sort(key=lambda t: t.rank)
        if not any(t.kernel_events or t.steps for t in traces):
            dropped = sum((t.skipped for t in traces), Counter[str]())
            why = ", ".join(f"{k} {v}" for k, v in sorted(dropped.items())) or "no kernel or step events"
            raise ProducerError(f"nothing to import from {len(traces)} file(s) under {directory}: no kernel "
                                f"event and no step was kept (skipped: {why})")
        world, traced = _check_ranks(traces, messages)
        topo, source = _resolve_topology(job_id, world, traces, topology, messages)
        hosts, gpus = list(topo.host), [""] * topo.world_size
        for t in traces:
            if t.host:
                hosts[t.rank] = t.host
            gpus[t.rank] = kineto_gpu(t.gpu_index)
        topo = dataclasses.replace(topo, host=tuple(hosts), gpu=tuple(gpus) if any(gpus) else ())
        topo = with_stream_groups(topo, traces, messages)
        size = len(topo.encode())
        if size > MAX_MESSAGE_BYTES:  # refused before anything of the job is published
            raise ProducerError(f"the job's topology of {topo.world_size:,} ranks encodes to {size:,} bytes, over "
                                f"the {MAX_MESSAGE_BYTES:,}-byte message limit ({len(traces)} trace file(s); "
                                "a world this large cannot be imported)")
        offsets, from_steps = _clock_offsets(traces, messages)
        skew = max(offsets.values()) - min(offsets.values()) if offsets else 0
        aligned = bool(offsets) and (align_clocks if align_clocks is not None
                                     else from_steps and skew > ALIGN_THRESHOLD_NS)
        if aligned:
            messages.append(f"clocks aligned: each rank shifted by minus its offset (skew {skew / 1e6:.3f} ms; "
                            f"valid only for synchronous jobs)")
        shifts = {r: -o for r, o in offsets.items()} if aligned else {}
        max_lag = max((t.max_lag_ns for t in traces), default=0)
        if max_lag > settings.allowed_lateness_ns:
            messages.append(f"kernels are up to {max_lag / 1e9:.3f} s out of order in file order, more than the "
                            f"pipeline's allowed lateness ({settings.allowed_lateness_ns / 1e9:.3f} s): some "
                            f"may be dead-lettered as late")
        own = publisher is None
        pub: Any = publisher
        if own:
            pub = Publisher(settings, lossless=True)
        failed = 0
        try:
            counts = _publish(pub, job_id, topo, traces, shifts, batch, say,
                              lambda k: tick(len(files) + k, 2 * len(files)))
        finally:
            if own:
                stats = pub.close()
                failed = stats.failed + stats.encode_errors
        if failed:
            counts["dropped"] += failed
            messages.append(f"{failed} records failed delivery to Kafka (see the log)")
    skipped: Counter[str] = Counter()
    for t in traces:
        skipped.update(t.skipped)
    if skipped:
        messages.append("skipped events: " + ", ".join(f"{k} {v}" for k, v in sorted(skipped.items())))
    if counts["dropped"]:
        raise ProducerError(f"job {job_id}: {counts['dropped']} of {counts['records']} records not published "
                            f"({counts['pending']} undelivered after flush); {'; '.join(messages[-1:])}")
    nccl = sorted({n for t in traces for n in t.names if n.startswith("nccl")})
    report = ImportReport(
        job_id=job_id, files=tuple(str(t.path) for t in traces), ranks=tuple(t.rank for t in traces),
        world_size=world, trace_world_size=traced, topology_source=source,
        topology=f"dp={topo.dp_size},tp={topo.tp_size},pp={topo.pp_size}" + (f",ep={topo.ep_size}"
                                                                             if topo.ep_size > 1 else ""),
        kernel_events=counts["kernels"], kernel_batches=counts["batches"], steps=counts["steps"],
        phases=sum(len(t.phases) for t in traces), phase_batches=counts["phase_batches"],
        skipped_events=dict(sorted(skipped.items())), clock_offsets_ns=offsets, clock_aligned=aligned,
        streams={t.rank: dict(sorted(t.streams.items())) for t in traces}, nccl_kernels=tuple(nccl),
        max_out_of_order_ns=max_lag, records_published=counts["records"] - counts["dropped"],
        records_dropped=counts["dropped"], seconds=time.perf_counter() - t0, messages=tuple(messages))
    line = (f"job {job_id}: {len(traces)} ranks, {report.kernel_events:,} kernel events in {report.kernel_batches} "
            f"batches, {report.steps} steps, {report.phase_batches} phase batches ({report.seconds:.2f} s)")
    log.info(line)
    say(line)
    return report


def _check_ranks(traces: list[RankTrace], messages: list[str]) -> tuple[int, int | None]:
    """(world size to publish, ``distributedInfo.world_size``). A partial set of traces is published as a job
    of ``max rank + 1`` ranks: the detectors wait for every rank of the published world."""
    seen: dict[int, Path] = {}
    for t in traces:
        if t.rank in seen:
            raise ProducerError(f"{t.path.name} and {seen[t.rank].name} are both rank {t.rank}: one directory "
                                f"must hold one job's traces, one file per rank")
        seen[t.rank] = t.path
    sizes = {t.world_size for t in traces if t.world_size is not None}
    if len(sizes) > 1:
        messages.append(f"files disagree on distributedInfo.world_size {sorted(sizes)}: using the largest")
    traced = max(sizes) if sizes else None
    top = max(seen)
    if traced is not None and top >= traced:
        raise ProducerError(f"{seen[top].name}: rank {top} is outside world_size {traced}")
    world = traced if traced is not None and len(seen) == traced else top + 1
    if traced is not None and world != traced:
        messages.append(f"traces of {len(seen)} of {traced} ranks (ranks {_ranges(sorted(seen))}): published as "
                        f"a {world}-rank job")
    if len(seen) < world:
        messages.append(f"ranks {_ranges(sorted(set(range(world)) - set(seen)))} have no trace: no step is complete "
                        f"on every rank, so L1/L2 cannot diagnose this job")
    return world, traced


def _ranges(ranks: list[int]) -> str:
    out, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def _publish(pub: Any, job_id: str, topo: JobTopology, traces: list[RankTrace], shifts: dict[int, int],
             batch: int, say: Callable[[str], None], published: Callable[[int], None]) -> Counter[str]:
    counts: Counter[str] = Counter()

    def send(topic: Topic, key: bytes, record: Record, in_order: bool = False) -> None:
        counts["records"] += 1
        if not (publish_in_order(pub, topic, key, record) if in_order else pub.publish(topic, key, record)):
            counts["dropped"] += 1

    starts = [s.start_ns + shifts.get(t.rank, 0) for t in traces for s in t.steps[:1]]
    starts += [t.first_kernel_ns + shifts.get(t.rank, 0) for t in traces if t.first_kernel_ns is not None]
    ends = [t.last_kernel_end_ns + shifts.get(t.rank, 0) for t in traces if t.last_kernel_end_ns is not None]
    ends += [s.start_ns + s.dur_ns + shifts.get(t.rank, 0) for t in traces for s in t.steps[-1:]]
    t_start = min(starts, default=0)
    send(Topic.TOPOLOGY, job_key(job_id), topo)
    send(Topic.LIFECYCLE, job_key(job_id),
         JobLifecycle(job_id, LifecycleEvent.START, t_start, topo.world_size, source="kineto-import"))
    # Steps and phases (small, in memory) as a live job would send them: step by step, all ranks.
    groups = PhaseGroups(topo)
    per_step = sorted(((ph.step, ph.rank, st, ph) for t in traces
                       for st, ph in step_records(t, job_id, shifts.get(t.rank, 0), groups)), key=lambda x: x[:2])
    for _, _, st, ph in per_step:
        if st is not None:
            send(Topic.STEPS, job_key(job_id), st)
            counts["steps"] += 1
        send(Topic.PHASES, job_key(job_id), ph)
        counts["phase_batches"] += 1
    for done, t in enumerate(traces, 1):
        for kb in kernel_batches(t, job_id, batch, shifts.get(t.rank, 0), host=topo.host[t.rank]):
            send(Topic.KERNELS, rank_key(job_id, t.rank), kb)
            counts["kernels"] += len(kb)
            counts["batches"] += 1
        say(f"rank {t.rank}: {t.kernel_events:,} kernel events published")
        published(done)
    send(Topic.LIFECYCLE, job_key(job_id),
         JobLifecycle(job_id, LifecycleEvent.END, max(ends, default=t_start), topo.world_size,
                      source="kineto-import", kernel_events=counts["kernels"], steps=counts["steps"],
                      phase_batches=counts["phase_batches"]), in_order=True)
    counts["pending"] = int(pub.flush())
    counts["dropped"] += counts["pending"]
    return counts
