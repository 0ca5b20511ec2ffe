"""The ``argus`` command line: the local stack, the demo, SQL, and the service entry points.

This module is the user-facing output layer, so it writes to stdout; library code logs instead. Every failure
is one line on stderr and an exit code of :class:`Exit`, never a traceback: bad arguments and settings exit 2
(argparse's own code), brokers that do not answer within 10 s exit 6 after one line saying so.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import logging
import os
import select
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from argus.core.errors import ArgusError, SchemaError
from argus.core.extras import Extra, missing_extra, require_extra
from argus.core.kafka_logs import LIBRDKAFKA_LOGGER, KafkaUnreachableError, require_kafka
from argus.core.settings import Settings
from argus.kafka_users import Role, role_settings

if TYPE_CHECKING:
    from argus.replay import ReplayResult

__all__ = ["Exit", "main", "replay_lines"]

#: Seconds a command waits for the brokers to answer before it gives up (with one line saying so first).
KAFKA_REACH_S = 10.0


class Exit(enum.IntEnum):
    """The exit codes of ``argus`` (docs/cli.md lists them)."""

    OK = 0
    #: An operation failed (the message says what); also a demo whose job was not fully processed.
    ERROR = 1
    #: Bad arguments or settings.
    USAGE = 2
    #: ``status``: not every process of this home's stack is healthy.
    UNHEALTHY = 3
    #: ``findings --wait`` / ``replay``: the diagnosis was not complete within the time allowed.
    INCOMPLETE = 4
    #: ``findings`` / ``report``: nothing is stored for the job (a typo, or another database or namespace).
    UNKNOWN_JOB = 5
    #: The Kafka brokers did not answer within :data:`KAFKA_REACH_S`.
    KAFKA_UNREACHABLE = 6
    INTERRUPTED = 130
    #: The reader of stdout went away (``argus ddl | head``): 128 + SIGPIPE, as a shell reports a program
    #: that SIGPIPE ended.
    BROKEN_PIPE = 141


def _out(text: str = "") -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _err(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _progress(msg: str) -> None:
    sys.stderr.write(f"  · {msg}\n")
    sys.stderr.flush()


def _table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in columns]] + [["NULL" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _cmd_up(settings: Settings, args: argparse.Namespace) -> int:
    from argus.stack import Stack

    status = Stack(settings).up(progress=_progress)
    _out(json.dumps(status, indent=2) if args.json else "argus stack is up")
    return 0


def _cmd_down(settings: Settings, args: argparse.Namespace) -> int:
    from argus.stack import Stack

    Stack(settings).down(keep_kafka=args.keep_kafka)
    _out("argus stack is down")
    return 0


def _cmd_status(settings: Settings, args: argparse.Namespace) -> int:
    from argus.stack import Stack

    status = Stack(settings).status()
    if args.json:
        _out(json.dumps(status, indent=2))
    else:
        sup = status["supervisor"]
        _out(f"{'supervisor':13s} {'running' if sup['running'] else 'stopped':8s} pid={sup['pid']}  "
             f"up since {sup['up_since'] or '-'}  log={sup['log']}")
        for name in ("kafka", "worker", "sink", "query-service"):
            s = status[name]
            state = "healthy" if s.get("healthy") else ("running" if s.get("running") else "stopped")
            if s.get("foreign"):
                state += " (its port answers for another home or process)"
            if s.get("state") not in (None, "running"):
                state += f" ({s['state']})"  # e.g. backoff: the supervisor restarts it shortly
            last = s.get("last_exit")
            exit_text = "-" if last is None else (f"{last.get('signal') or last.get('code')} at {last.get('at')}")
            _out(f"{name:13s} {state:8s} pid={s.get('pid')}  up since {s.get('up_since') or '-'}  "
                 f"restarts={s.get('restarts', 0)}  last exit={exit_text}  log={s.get('log')}")
            for b in s.get("brokers", []) if len(s.get("brokers", [])) > 1 else []:  # a cluster: each broker
                b_state = "healthy" if b.get("healthy") else (b.get("state") or "stopped")
                active = "  (active controller)" if b.get("node_id") == s.get("controller") else ""
                _out(f"  {b['name']:8s} {b_state:8s} pid={b.get('pid')}  {b.get('bootstrap')}  "
                     f"restarts={b.get('restarts', 0)}{active}  log={b.get('log')}")
        _out_jobs((status["worker"].get("stats") or {}).get("diagnosis"))
    healthy = status["supervisor"]["running"] and all(status[n].get("healthy")
                                                      for n in ("kafka", "worker", "sink", "query-service"))
    return Exit.OK if healthy else Exit.UNHEALTHY


def _out_jobs(diagnosis: dict[str, Any] | None, limit: int = 20) -> None:
    """The worker's jobs holding state: open ones, those being abandoned, finished ones awaiting L3."""
    if not diagnosis:
        return
    jobs = diagnosis.get("jobs") or []
    _out(f"jobs          open={diagnosis.get('open_jobs', 0)}  held messages={diagnosis.get('held_messages', 0)}  "
         f"abandoned={diagnosis.get('jobs_abandoned', 0)}  diagnosed={diagnosis.get('jobs_diagnosed', 0)}")
    if jobs:
        rows = [(j["job"], j["state"], f"{j['age_s']:.0f}", f"{j['idle_s']:.0f}", j["last_step"], j["held_messages"])
                for j in jobs[:limit]]
        _out(_table(("job", "state", "age_s", "idle_s", "last_step", "held_messages"), rows))
        if len(jobs) > limit:
            _out(f"... {len(jobs) - limit} more (argus status --json lists them)")


def _cmd_sql(settings: Settings, args: argparse.Namespace) -> int:
    from argus.sinks.query_server import run_query

    res = run_query(settings, args.query)
    if args.json:
        _out(json.dumps(res.as_dicts(), default=str))
    elif res.columns:
        _out(_table(res.columns, res.rows))
    return 0


def _cmd_topics(settings: Settings, args: argparse.Namespace) -> int:
    from argus.topics import ensure_topics

    created = ensure_topics(settings)
    _out(f"created {len(created)} topic(s): {', '.join(created) or '-'}")
    return _cmd_acls(settings, args) if args.acls else 0


def _cmd_acls(settings: Settings, args: argparse.Namespace) -> int:
    from argus.kafka_acls import apply_acls, describe_acls

    if getattr(args, "describe", False):
        acls = describe_acls(settings)
        for acl in acls:
            _out(str(acl))
        if not acls:  # what the broker answers a user without DESCRIBE on the cluster, too
            _err("argus: the broker shows no ALLOW bindings (to a user that may not describe ACLs it shows none)")
        return 0
    users = dict(getattr(args, "user", None) or [])
    created, extra = apply_acls(settings, users=users, prune=getattr(args, "prune", False))
    _out(f"created {len(created)} ACL binding(s)" + "".join(f"\n  + {a}" for a in created))
    if extra:
        verb = "removed" if getattr(args, "prune", False) else "kept (not in argus's table; --prune removes them)"
        _out(f"{len(extra)} other ALLOW binding(s) of argus's users {verb}" + "".join(f"\n  - {a}" for a in extra))
    return 0


def _cmd_worker(settings: Settings, args: argparse.Namespace) -> int:
    from argus.streams.worker import run_worker

    run_worker(settings)
    return 0


def _cmd_sink(settings: Settings, args: argparse.Namespace) -> int:
    from argus.sinks.writer import serve

    serve(settings)
    return 0


def _cmd_query_service(settings: Settings, args: argparse.Namespace) -> int:
    from argus.sinks.query_service import serve_query_service

    serve_query_service(settings)
    return 0


def _cmd_simulate(settings: Settings, args: argparse.Namespace) -> int:
    from argus.demo import simulate_job

    stats = simulate_job(settings, job_id=args.job, dp=args.dp, tp=args.tp, pp=args.pp, steps=args.steps,
                         fault=args.fault, seed=args.seed, progress=_progress, hang_rank=args.hang_rank,
                         hang_step=args.hang_step, hang_s=args.hang_s, hang_resume=not args.no_resume,
                         pause_step=args.pause_step, pause_s=args.pause_s)
    _out(json.dumps(stats, indent=2))
    return 0


def _cmd_demo(settings: Settings, args: argparse.Namespace) -> int:
    from argus.demo import run_demo
    from argus.progress import Meter

    with Meter("publishing the job", total=args.steps, unit="step") as meter:
        report = run_demo(settings, fault=args.fault, steps=args.steps, progress=meter.say, timeout_s=args.timeout,
                          advance=meter)
    _out(json.dumps(report, indent=2) if args.json else report["text"])
    return 0 if report["complete"] else 1


def _finding_rows(findings: Sequence[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(f"{f['impact_ns'] / 1e9:.3f}", f["level"], f["kind"], ",".join(map(str, f["ranks"])) or "-",
             ",".join(f.get("hosts") or ()) or "-", f["phase"] or f["kernel"] or "-",
             ",".join(map(str, f["steps"])) or "-", f"{f['score']:.2f}")
            for f in findings]


_FINDING_COLUMNS = ("impact_gpu_s", "level", "kind", "ranks", "hosts", "phase/kernel", "steps", "score")


def _incident_rows(findings: list[dict[str, Any]], members: bool) -> list[tuple[Any, ...]]:
    """One row per incident (its lead, and how many findings it folds, by kind), largest impact first; with
    ``members``, each member's row under its lead, marked ``+``."""
    from argus.sinks.findings_query import fold_incidents

    rows = []
    for lead, *rest in fold_incidents(findings):
        kinds = Counter(f["kind"] for f in rest)
        folded = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"
        rows.append((*_finding_rows([lead])[0], folded))
        if members:
            rows += [("+" + r[0], *r[1:], "") for r in _finding_rows(rest)]
    return rows


def _cmd_follow(settings: Settings, args: argparse.Namespace) -> int:
    from argus.sinks.findings_feed import follow_findings

    if not args.json:
        sys.stderr.write(f"following findings{' of job ' + args.job if args.job else ''} on "
                         f"{settings.topic('findings')} (Ctrl-C stops)\n")
    for f in follow_findings(settings, args.job, from_beginning=args.from_beginning,
                             idle_timeout_s=args.idle_timeout):
        if args.json:
            _out(json.dumps(f))
        else:
            [row] = _finding_rows([f])
            lead = f.get("incident_id") in (None, "", f.get("finding_id"))
            _out(f"{f['job']}  " + "  ".join(f"{c}={v}" for c, v in zip(_FINDING_COLUMNS, row, strict=True))
                 + ("" if lead else f"  incident={str(f['incident_id'])[:12]}"))
    return 0


def _unknown_job(settings: Settings, job: str) -> int | None:
    """:attr:`Exit.UNKNOWN_JOB` after saying so when nothing is stored for ``job``, else None."""
    from argus.sinks.findings_query import job_known

    if job_known(settings, job):
        return None
    sys.stderr.write(f"argus: no job {job!r} in database {settings.clickhouse_database} (nothing stored for it: "
                     "check the name, ARGUS_CLICKHOUSE_DATABASE, or wait until its records arrive)\n")
    return Exit.UNKNOWN_JOB


def _cmd_findings(settings: Settings, args: argparse.Namespace) -> int:
    from argus.sinks.findings_query import fetch_findings, pending_reasons, wait_diagnosed

    if args.follow:
        return _cmd_follow(settings, args)
    if not args.job:
        sys.stderr.write("argus: findings needs --job (or --follow for every job)\n")
        return Exit.USAGE
    complete = True
    if args.wait:
        complete = wait_diagnosed(settings, args.job, args.wait)
        if not complete:
            try:
                why = "; ".join(pending_reasons(settings, args.job)) or "unknown"
            except ArgusError as exc:
                why = str(exc)
            sys.stderr.write(f"argus: job {args.job} not fully diagnosed after {args.wait:.0f} s ({why}); "
                             "showing the findings so far\n")
    findings = fetch_findings(settings, args.job)
    if not findings and (unknown := _unknown_job(settings, args.job)) is not None:
        return unknown
    if args.json:
        _out(json.dumps(findings))
    elif not findings:
        _out(f"no findings for job {args.job}")
    else:
        _out(_table((*_FINDING_COLUMNS, "folded"), _incident_rows(findings, args.members)))
    if not args.json:
        from argus.sinks.kernel_pauses import format_pauses, kernel_pauses

        try:
            spans = kernel_pauses(settings, args.job)
        except ArgusError as exc:  # a store its sink has not migrated yet (no pause columns): findings still shown
            _err(f"argus: kernel pauses not shown: {exc}")
            spans = []
        for line in format_pauses(spans):
            _out(line)
    return Exit.OK if complete else Exit.INCOMPLETE


def _cmd_replay(settings: Settings, args: argparse.Namespace) -> int:
    from argus.progress import Meter
    from argus.replay import parse_time_ms, replay_job

    from_ms = parse_time_ms(args.from_time) if args.from_time else None
    to_ms = parse_time_ms(args.to_time) if args.to_time else None
    with Meter("reading retained records", unit="msg") as meter:
        res = replay_job(settings, args.job, args.into, from_ms, to_ms, timeout_s=args.timeout,
                         progress=meter.say, advance=meter)
    if args.json:
        _out(json.dumps(res.as_dict(), indent=2))
    else:
        for line in replay_lines(res):
            _out(line)
    return 0 if res.complete else 4


def replay_lines(res: ReplayResult) -> list[str]:
    """The text form of a replay's result: where it went, the detector versions, the difference."""
    d = res.diff
    out = [f"replay of job {res.job_id} into namespace {res.namespace} (topics {res.settings.topic_prefix}*, "
           f"database {res.settings.clickhouse_database}): {len(res.live)} live finding(s), "
           f"{len(res.replayed)} replayed" + ("" if res.complete else " (replayed diagnosis INCOMPLETE)")]
    versions = {f.get("detector_version") or "?" for f in res.live}, {f["detector_version"] for f in res.replayed}
    out.append(f"detectors: live {', '.join(sorted(versions[0])) or '-'}; "
               f"replay {', '.join(sorted(versions[1])) or '-'}")
    if d.identical:
        out.append(f"findings identical ({d.same})")
    for tag, group in (("- live only  ", d.only_live), ("+ replay only", d.only_replay)):
        out += [f"{tag} " + "  ".join(map(str, _finding_rows([f])[0])) for f in group]
    out += ["~ changed     " + "  ".join(map(str, _finding_rows([a])[0]))
            + f"  ->  impact {b['impact_ns'] / 1e9:.3f} score {b['score']:.2f}" for a, b in d.changed]
    return out


def _cmd_import_kineto(settings: Settings, args: argparse.Namespace) -> int:
    from argus.producers.kineto import import_kineto
    from argus.progress import Meter

    with Meter("importing: ranks parsed, then published", unit="rank") as meter:
        report = import_kineto(settings, args.directory, args.job, topology=args.topology,
                               progress=meter.say, advance=meter)
    _out(json.dumps(dataclasses.asdict(report), default=str, indent=2))
    return 0


def _cmd_report(settings: Settings, args: argparse.Namespace) -> int:
    from argus.report import build_report

    if (unknown := _unknown_job(settings, args.job)) is not None:
        return unknown
    drawn = build_report(settings, args.job, args.out)
    if args.json:
        _out(json.dumps(drawn, default=str, indent=2))
    else:
        _out(f"wrote {drawn['path']} ({drawn['bytes'] / 1e6:.1f} MB): {', '.join(drawn['plots'])}; "
             f"{drawn['findings']} finding(s), {drawn['ranks_shown']} of {drawn['ranks']} ranks shown")
    return 0


def _cmd_export_trace(settings: Settings, args: argparse.Namespace) -> int:
    from argus.progress import Meter
    from argus.trace_export import export_trace

    ranks = sorted({*([] if args.rank is None else [args.rank]), *(args.ranks or [])})
    with Meter("reading retained kernel batches", unit="msg") as meter:
        done = export_trace(settings, args.job, ranks, args.from_step, args.to_step, args.out, progress=meter,
                            kernels="summaries" if args.summaries_only else "auto")
    if args.json:
        _out(json.dumps(done, default=str, indent=2))
    else:
        events = ", ".join(f"{k} {v:,}" for k, v in done["events"].items())
        _out(f"wrote {done['path']} ({done['bytes']:,} B): {events}; kernels from "
             + ", ".join(f"rank {r}: {src}" for r, src in sorted(done["kernel_source"].items()))
             + "; open it at https://ui.perfetto.dev")
    return 0


def _cmd_ddl(settings: Settings, args: argparse.Namespace) -> int:
    from argus.sinks.tables import schema_ddl

    cluster = settings.clickhouse_cluster if args.cluster is None else args.cluster
    for sql in schema_ddl(args.database or settings.clickhouse_database, cluster):
        _out(sql + ";")
    return 0


def _cmd_stacks(settings: Settings, args: argparse.Namespace) -> int:
    import signal
    import threading

    from argus.producers.cpu_stacks import StackCollector

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    StackCollector(settings).run(stop)
    return 0


def _cmd_control(settings: Settings, args: argparse.Namespace) -> int:
    from argus.rank_control import make_command, send_command
    from argus.schemas.control import ControlAction

    action = ControlAction(args.action.upper().replace("-", "_"))
    try:
        cmd = make_command(args.job, action, ranks=args.ranks or (), count=getattr(args, "count", 0),
                           setting=getattr(args, "setting", ""))
    except SchemaError as exc:
        sys.stderr.write(f"argus: {exc}\n")
        return Exit.USAGE
    partition = send_command(settings, cmd)
    ranks = ",".join(map(str, cmd.ranks)) or "all"
    _out(f"control {cmd.command_id}: {action.value} to job {cmd.job_id}, ranks {ranks} (partition {partition}); "
         "each rank acknowledges it in its heartbeats (control_ack)")
    return 0


def _runtime_setting(text: str) -> str:
    """An argparse type: ``KEY=VALUE`` of a runtime setting (:data:`argus.schemas.control.RUNTIME_SETTINGS`)."""
    from argus.schemas.control import runtime_value

    key, sep, value = text.partition("=")
    try:
        if not sep:
            raise SchemaError(f"expected KEY=VALUE, got {text!r}")
        runtime_value(key, value)
    except SchemaError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _rank_list(text: str) -> tuple[int, ...]:
    """An argparse type: ranks as ``0,3,8-11``."""
    from argus.producers.cupti_parse import parse_rank_list

    try:
        ranks = parse_rank_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if ranks is None:
        return ()
    if not ranks:  # an empty tuple on the wire means every rank: "none" must not become that
        raise argparse.ArgumentTypeError(f"{text!r} selects no rank (leave --ranks out for every rank)")
    return tuple(sorted(ranks))


def _bounded_int(least: int, most: int = 1 << 31) -> Callable[[str], int]:
    """An argparse type: an integer in ``[least, most]``, else argparse's usage error (exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"must be in {least}..{most}, got {value}")
        return value

    return parse


def _role_user(text: str) -> tuple[Role, str]:
    """An argparse type: ``ROLE=NAME``, a role of :class:`Role` but the admin and a non-empty user name."""
    role, sep, name = text.partition("=")
    roles = [r.value for r in Role if r is not Role.ADMIN]
    if not sep or role not in roles or not name.strip() or any(c in name for c in " \t\r\n"):
        raise argparse.ArgumentTypeError(f"expected ROLE=NAME with ROLE one of {', '.join(roles)}, got {text!r}")
    return Role(role), name


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def _job_id(text: str) -> str:
    """An argparse type: a job id, non-empty, printable, at most 256 characters (it keys Kafka messages)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("a job id must not be empty")
    if len(text) > 256 or not text.isprintable():
        raise argparse.ArgumentTypeError(f"a job id is at most 256 printable characters, got {text[:40]!r}")
    return text


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("argus-failslow")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="argus", description="Always-on tracing and fail-slow diagnosis "
                                "for GPU training jobs.")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    p.add_argument("--log-level", default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   type=str.upper, help="log level of this command (env ARGUS_LOG_LEVEL for services)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("up", help="start Kafka, the stream worker, the sink and the query service in the "
                       "background, under a supervisor that restarts any of them that exits")
    s.add_argument("--json", action="store_true")
    s.add_argument("--brokers", type=_bounded_int(1, 1 << 16), default=None,
                   help="Kafka brokers: 1 (default) or a KRaft cluster of N on loopback (env ARGUS_BROKERS)")
    s.add_argument("--secure", action="store_true", default=None,
                   help="SASL/SCRAM users per role (passwords in <home>/secrets/) and Kafka ACLs on the (single) "
                        "broker; each service runs as its role's user (env ARGUS_KAFKA_SECURE=1)")
    s.set_defaults(fn=_cmd_up)
    s = sub.add_parser("down", help="stop the local stack")
    s.add_argument("--keep-kafka", action="store_true", help="leave the Kafka broker running")
    s.set_defaults(fn=_cmd_down)
    s = sub.add_parser("status", help="show the local stack: health, pids, restarts, last exits (exit 3 unless "
                       "all healthy)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=_cmd_status)
    s = sub.add_parser("sql", help="run SQL against the configured ClickHouse (embedded or server); through the "
                       "running query service (or sink) only one read-only statement (SELECT, WITH, SHOW, DESCRIBE, "
                       "EXPLAIN, EXISTS), sent with ARGUS_QUERY_PASSWORD or the token in <ARGUS_HOME>/query.token")
    s.add_argument("query")
    s.add_argument("--json", action="store_true", help="print a JSON array of row objects")
    s.set_defaults(fn=_cmd_sql)
    s = sub.add_parser("topics", help="create the argus topics (idempotent)")
    s.add_argument("--acls", action="store_true", help="then apply argus's ACLs, as `argus acls` does")
    s.set_defaults(fn=_cmd_topics)
    s = sub.add_parser("acls", help="grant argus's Kafka users (rank, worker, sink, reader) what each may read and "
                       "write, and nothing else (idempotent; needs a super user on a broker with an authorizer)")
    s.add_argument("--describe", action="store_true", help="only print the ALLOW bindings the broker holds")
    s.add_argument("--prune", action="store_true",
                   help="also remove ALLOW bindings of those users that the table does not have")
    s.add_argument("--user", type=_role_user, action="append", metavar="ROLE=NAME",
                   help="the Kafka user of a role (rank, worker, sink, reader) when it is not named as the role")
    s.set_defaults(fn=_cmd_acls)
    s = sub.add_parser("worker", help="run the Faust stream worker in the foreground")
    s.set_defaults(fn=_cmd_worker)
    s = sub.add_parser("sink", help="run the ClickHouse sink (and its SQL endpoint) in the foreground")
    s.set_defaults(fn=_cmd_sink)
    s = sub.add_parser("query-service", help="serve argus's tables read-only over ClickHouse's HTTP interface on "
                       "ARGUS_QUERY_SERVICE_HOST:ARGUS_QUERY_SERVICE_PORT (default 127.0.0.1:18123), in the "
                       "foreground (`argus up` supervises it)")
    s.set_defaults(fn=_cmd_query_service)
    s = sub.add_parser("ddl", help="print the statements that create argus's ClickHouse schema, one per line "
                       "ending in ';' (for review, or `clickhouse-client --multiquery`), without connecting")
    s.add_argument("--cluster", default=None, metavar="NAME",
                   help="the cluster (remote_servers) to create the tables ON CLUSTER: NAME_local "
                        "ReplicatedReplacingMergeTree + Distributed tables (default ARGUS_CLICKHOUSE_CLUSTER; '' for "
                        "one server)")
    s.add_argument("--database", default=None, metavar="DB", help="default ARGUS_CLICKHOUSE_DATABASE (argus)")
    s.set_defaults(fn=_cmd_ddl)
    s = sub.add_parser("stacks", help="on a training host: capture py-spy stacks of ranks named by findings")
    s.set_defaults(fn=_cmd_stacks)
    faults = ["none", "case1", "case2", "case3", "case4", "case5"]
    s = sub.add_parser("simulate", help="publish a simulated training job to Kafka")
    s.add_argument("--job", required=True, type=_job_id)
    s.add_argument("--dp", type=_bounded_int(1, 65536), default=8, help="data-parallel degree (>= 1)")
    s.add_argument("--tp", type=_bounded_int(1, 1024), default=2, help="tensor-parallel degree (>= 1)")
    s.add_argument("--pp", type=_bounded_int(1, 1024), default=2, help="pipeline stages (>= 1)")
    s.add_argument("--steps", type=_bounded_int(1, 1_000_000), default=40)
    s.add_argument("--seed", type=_bounded_int(0), default=0)
    s.add_argument("--fault", choices=[*faults, "hang", "silent-rank", "crash"], default="none",
                   help="case1..case5 (fail-slow), hang / silent-rank (rank --hang-rank from step --hang-step), "
                        "crash (no END)")
    s.add_argument("--hang-rank", type=_bounded_int(0), default=5, metavar="R", help="hang / silent-rank: the rank")
    s.add_argument("--hang-step", type=_bounded_int(0), default=10, metavar="S",
                   help="hang / silent-rank: the first step")
    s.add_argument("--hang-s", type=_seconds, default=20.0, metavar="SECONDS",
                   help="hang / silent-rank: seconds the blocked ranks heartbeat (in real time)")
    s.add_argument("--no-resume", action="store_true", help="hang: the job never resumes (no END)")
    s.add_argument("--pause-step", type=_bounded_int(-1), default=-1, metavar="S",
                   help="a checkpoint pause: every rank stops before step S (heartbeats only), then goes on")
    s.add_argument("--pause-s", type=_seconds, default=5.0, metavar="SECONDS",
                   help="length of the --pause-step pause")
    s.set_defaults(fn=_cmd_simulate)
    s = sub.add_parser("findings", help="the diagnosis of a job (JSON contract with --json), or --follow "
                                        "findings as they arrive")
    s.add_argument("--job", default=None, type=_job_id, help="the job (required unless --follow)")
    s.add_argument("--follow", action="store_true",
                   help="print findings as they arrive on the diagnosis topic (one JSON object per line with "
                        "--json), from now or --from-beginning, until Ctrl-C")
    s.add_argument("--from-beginning", action="store_true", help="--follow: start at the oldest retained finding")
    s.add_argument("--idle-timeout", type=_seconds, default=None, metavar="SECONDS",
                   help="--follow: stop after this long without a finding")
    s.add_argument("--wait", type=_seconds, default=0.0, metavar="SECONDS",
                   help="block until the job is diagnosed through to ClickHouse: every detector part done, its "
                        "findings and the END's record counts stored (exit 4 on timeout)")
    s.add_argument("--json", action="store_true", help="print a JSON array of findings")
    s.add_argument("--members", action="store_true",
                   help="list each incident's member findings under it (by default folded into a count)")
    s.set_defaults(fn=_cmd_findings)
    s = sub.add_parser("control", help="pause, resume or re-tune the ranks of a running job without a restart "
                                       "(acknowledged in each rank's heartbeats)")
    s.add_argument("--job", required=True, type=_job_id)
    s.add_argument("--ranks", type=_rank_list, default=None, metavar="LIST",
                   help="the ranks it applies to, e.g. 0,3,8-11 (default: every rank)")
    cs = s.add_subparsers(dest="action", required=True)
    cs.add_parser("pause-kernels", help="stop kernel records (CUPTI released, e.g. for nsys); steps and phases "
                                        "go on, and the gap is missing data, never a fault")
    cs.add_parser("resume-kernels", help="start kernel records again")
    c = cs.add_parser("sample-ranks", help="trace kernels on N ranks spread over the job (0: every rank)")
    c.add_argument("count", type=_bounded_int(0))
    c = cs.add_parser("set", help="change a runtime setting: heartbeat_interval_s, kernel_batch_events, "
                                  "kernel_max_latency_s")
    c.add_argument("setting", metavar="KEY=VALUE", type=_runtime_setting)
    s.set_defaults(fn=_cmd_control)
    s = sub.add_parser("import-kineto", help="publish torch.profiler/Kineto traces (one file per rank) as a job")
    s.add_argument("directory", type=Path)
    s.add_argument("--job", required=True, type=_job_id)
    s.add_argument("--topology", default=None, help="dp=N,tp=N,pp=N when the traces carry no pg_config")
    s.set_defaults(fn=_cmd_import_kineto)
    s = sub.add_parser("replay", help="diagnose a retained job again with the current detectors into a "
                                      "namespace of its own, and diff its findings against the stored ones")
    s.add_argument("--job", required=True, type=_job_id)
    s.add_argument("--into", default=None, metavar="NAMESPACE",
                   help="namespace of the replay's topics and ClickHouse database (default replay_<UTC time>)")
    s.add_argument("--from-time", default=None, metavar="T",
                   help="only records published from T (ISO 8601, or seconds since the epoch)")
    s.add_argument("--to-time", default=None, metavar="T", help="only records published until T")
    s.add_argument("--timeout", type=_seconds, default=600.0, help="seconds to wait for the replayed diagnosis")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=_cmd_replay)
    s = sub.add_parser("report", help="write one self-contained HTML page of a job: iteration time, per-rank "
                                      "heat maps of phases and kernels, the suspect kernel's clusters, findings")
    s.add_argument("--job", required=True, type=_job_id)
    s.add_argument("--out", type=Path, default=Path("report.html"))
    s.add_argument("--json", action="store_true", help="print what was drawn as JSON")
    s.set_defaults(fn=_cmd_report)
    s = sub.add_parser("export-trace", help="a Chrome/Perfetto trace of chosen ranks and steps (steps, phases, "
                                            "collectives, kernels per stream, findings), for ui.perfetto.dev")
    s.add_argument("--job", required=True, type=_job_id)
    s.add_argument("--rank", type=_bounded_int(0), default=None, help="a rank to export")
    s.add_argument("--ranks", type=_bounded_int(0), nargs="+", default=None, metavar="R",
                   help="more ranks to export")
    s.add_argument("--from-step", type=_bounded_int(0), required=True)
    s.add_argument("--to-step", type=_bounded_int(0), required=True)
    s.add_argument("--out", type=Path, required=True, help="trace.json, or trace.json.gz for gzip")
    s.add_argument("--summaries-only", action="store_true",
                   help="kernel activity from the per-window summaries only (do not read the kernels topic)")
    s.add_argument("--json", action="store_true", help="print what was written as JSON")
    s.set_defaults(fn=_cmd_export_trace)
    s = sub.add_parser("demo", help="start the stack, simulate a 32-rank job with a fault, report")
    s.add_argument("--fault", choices=faults[1:], default="case1")
    s.add_argument("--steps", type=_bounded_int(1, 1_000_000), default=40)
    s.add_argument("--timeout", type=_seconds, default=300.0, help="seconds to wait for processing")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=_cmd_demo)
    return p


#: Commands whose output files are the user's to share (the home is not created by them).
_PUBLIC_OUTPUT_COMMANDS = frozenset({"report", "export-trace", "ddl"})


def _private_home(home: Path) -> None:
    """Keep argus's state to its user: files and directories this process (and the processes it starts)
    creates get no group or other permissions (the embedded chDB's tables, logs, pid files, the token), and
    a home created by an older version with 0755 is closed to 0700."""
    os.umask(0o077)
    try:
        if home.is_dir() and home.stat().st_uid == os.getuid() and home.stat().st_mode & 0o077:
            home.chmod(0o700)
    except OSError:  # not ours to change: the files in it are still created private
        pass


#: Commands of the base install (the rank side): everything else needs the ``server`` extra.
_RANK_SIDE_COMMANDS = frozenset({"stacks", "topics", "acls", "control"})


def _needs_kafka(args: argparse.Namespace) -> bool:
    """Whether the command talks to the brokers (checked first, so an unreachable one is one clear error)."""
    if args.command in ("topics", "acls", "simulate", "replay", "import-kineto", "stacks", "control"):
        return True
    if args.command == "findings":
        return bool(args.follow)
    return args.command == "export-trace" and not args.summaries_only


#: The Kafka user each command takes against a secure home (``ARGUS_KAFKA_SECURE=1`` without credentials of its
#: own): the least its work needs. ``up``, ``status`` and ``down`` manage the stack as its admin themselves.
_COMMAND_ROLE = {"topics": Role.ADMIN, "acls": Role.ADMIN, "control": Role.ADMIN, "replay": Role.ADMIN,
                 "export-trace": Role.ADMIN, "simulate": Role.RANK, "import-kineto": Role.RANK, "stacks": Role.RANK,
                 "findings": Role.READER,
                 "worker": Role.WORKER, "sink": Role.SINK}


def _as_role(settings: Settings, command: str) -> Settings:
    """``settings`` as the user of ``command``'s role on a secure home (unchanged elsewhere).

    Raises:
        ConfigError: the home has no password for that role (no ``argus up --secure`` yet).
    """
    role = _COMMAND_ROLE.get(command)
    return settings if role is None else role_settings(settings, role)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` (default ``sys.argv[1:]``); returns its exit code (:class:`Exit`)."""
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # here, not at the interpreter's exit, where a broken pipe is only a warning
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        # Python's advice (the SIGPIPE note of the signal module): what is left in stdout's buffer goes to
        # devnull, else the interpreter's own flush at exit fails again and prints a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return Exit.BROKEN_PIPE


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it: a BrokenPipeError may also come from a socket,
    which is a failure to report, not a reader that had enough. True where poll() is missing (Windows)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (replaced in-process): not the pipe that broke
        return False
    if not hasattr(select, "poll"):
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _fd, events in poller.poll(0))


def _run(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    try:
        # up --brokers N: explicit > ARGUS_BROKERS > 1 (the bootstrap servers and replication follow).
        settings = Settings.load(log_level=args.log_level, brokers=getattr(args, "brokers", None),
                                 kafka_secure=getattr(args, "secure", None))
        settings = _as_role(settings, args.command)
    except ArgusError as exc:
        sys.stderr.write(f"argus: configuration error: {exc}\n")
        return Exit.USAGE
    if args.command not in _PUBLIC_OUTPUT_COMMANDS:
        _private_home(settings.home)
    # Services log at the configured level; interactive commands only show warnings unless asked, and leave
    # librdkafka's retries to the one line require_kafka writes.
    service = args.command in ("worker", "sink", "query-service", "stacks")
    level = settings.log_level.upper() if service or args.log_level else "WARNING"
    logging.basicConfig(level=level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not (service or args.log_level):
        logging.getLogger(LIBRDKAFKA_LOGGER).setLevel(logging.CRITICAL)
    try:
        if args.command not in _RANK_SIDE_COMMANDS:  # before the brokers: the first thing to fix is said first
            require_extra(Extra.SERVER, f"argus {args.command}")
        if _needs_kafka(args):
            require_kafka(settings.kafka, KAFKA_REACH_S, notice=lambda m: _err(f"argus: {m}"))
        return int(args.fn(settings, args))
    except KafkaUnreachableError as exc:
        sys.stderr.write(f"argus: {exc}\n")
        return Exit.KAFKA_UNREACHABLE
    except ArgusError as exc:
        sys.stderr.write(f"argus: {exc}\n")
        return Exit.ERROR
    except ModuleNotFoundError as exc:  # a module of an extra this installation lacks, found deeper down
        error = missing_extra(exc, f"argus {args.command}")
        if error is None:
            raise
        sys.stderr.write(f"argus: {error}\n")
        return Exit.ERROR
    except KeyboardInterrupt:
        return Exit.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
