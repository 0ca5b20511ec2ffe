"""The compression agent's shell: kernel batches in, what its router answers carried out on Kafka.

:func:`install_compression` adds the agent (``argus.compress``), the job-end agent and their timers to the app.
Each kernel batch is decoded and handed to the :class:`~argus.streams.compression_router.CompressionRouter`
(the windows and the at-least-once rules); :class:`CompressionShell` carries out its answer: dead letters,
summaries, end markers, acks. Summaries are sent without waiting for the broker: a task acks the windows'
messages once their summaries are delivered (at most :data:`MAX_DELIVERIES_IN_FLIGHT` such tasks), so the agent
reads on; a job-end marker waits for every summary sent before it. A dead letter that cannot be delivered stops
the agent without acking (:class:`~argus.core.errors.DeadLetterError`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable
from typing import Any

import faust
from faust.types import EventT

from argus.core.errors import SchemaError, failure_reason
from argus.core.settings import Settings
from argus.schemas.records import JobLifecycle, KernelBatch, KernelSummary
from argus.streams.compression_router import CompressionRouter, DeadLetter, Emission, Routed, Staging
from argus.streams.dead_letters import DeadLetters
from argus.streams.summary_pieces import summary_end_marker
from argus.topics import Topic, job_key, kernel_key

__all__ = ["MAX_DELIVERIES_IN_FLIGHT", "CompressionShell", "install_compression"]

log = logging.getLogger(__name__)
#: Closed windows whose summaries are on their way to the broker at once (their messages not acked yet).
MAX_DELIVERIES_IN_FLIGHT = 256


class CompressionShell:
    """Carries out what the compression router answers (see the module's docstring); holds the summaries in
    flight (their windows' messages not acked yet) and the first delivery failure, which stops the agent."""

    def __init__(self, app: faust.App, settings: Settings, router: CompressionRouter[EventT],
                 dead: DeadLetters) -> None:
        self.app, self.settings, self.router, self.dead = app, settings, router, dead
        self.summaries = app.topic(Topic.SUMMARIES.full(settings), key_type=bytes, value_type=bytes)
        self._deliveries: set[asyncio.Future[None]] = set()
        self._failures: list[BaseException] = []
        # Held while summaries are handed to the producer (and their delivery task made) and while a job-end
        # marker waits for every summary sent before it: the staging timer's emissions and the agent's interleave.
        self._sending = asyncio.Lock()

    async def take(self, event: EventT) -> None:
        """One kernel batch: routed, carried out; raises the first summary delivery that failed."""
        t0 = time.perf_counter()
        msg = event.message
        try:
            batch = KernelBatch.decode(event.value)
        except SchemaError as exc:
            await self.carry_out(self.router.undecodable(failure_reason(exc)), event)
            event.ack()
        else:
            await self.carry_out(self.router.take(batch, event, msg.partition, msg.offset, time.monotonic(),
                                                  time.time_ns()), event)
        if self._failures:  # a summary's dead letter was not delivered: stop without acking
            raise self._failures[0]
        self.router.stats.busy_s += time.perf_counter() - t0

    async def flush_staged(self) -> None:
        routed = self.router.flush_staged(time.monotonic())
        if routed.emission is not None:
            await self.carry_out(routed, routed.emission.handle)

    async def carry_out(self, routed: Routed[EventT], event: EventT) -> None:
        """Do what the router said, in its order: dead letters, summaries, the job-end marker, acks."""
        for d in routed.dead:
            await self._send_dead(d, event)
        if routed.emission is not None:
            async with self._sending:
                await self._send(routed.emission)
        if routed.end_marker is not None:
            job_id, part = routed.end_marker
            async with self._sending:
                await self._all_delivered()  # the marker must follow every summary of the job sent before it
                marker = summary_end_marker(job_id, part).encode()
                futs = [await self.summaries.send(key=job_key(job_id), value=marker, partition=q, force=True)
                        for q in range(self.settings.partitions)]
                for fut in futs:
                    await fut
        for e in routed.ack:
            e.ack()

    async def _send_dead(self, d: DeadLetter, event: EventT) -> None:
        await self.dead.send(event, "compress", d.reason, payload=d.payload, job=d.job, rank=d.rank)

    async def _send(self, emission: Emission[EventT]) -> None:
        futs = []
        # Straight to the producer, not Topic.send: Faust's message wrapper, sensors and debug formatting cost
        # about as much as aiokafka's send itself, per summary. The delivery future is the same.
        producer, topic = self.app.producer, self.summaries.get_topic_name()
        for s in emission.summaries:
            payload = s.encode()
            self.router.stats.summary_bytes_out += len(payload)
            futs.append((s, payload, await producer.send(topic, kernel_key(s.job_id, s.kernel, s.stream), payload,
                                                         partition=None, timestamp=None, headers=None)))
        # The windows' messages are acked once their summaries are delivered; waiting for the broker here
        # would idle the agent for a round trip per closed window, so a task waits while the next messages
        # are read (bounded: at most MAX_DELIVERIES_IN_FLIGHT).
        while len(self._deliveries) >= MAX_DELIVERIES_IN_FLIGHT:
            await asyncio.wait(self._deliveries, return_when=asyncio.FIRST_COMPLETED)
        task = asyncio.ensure_future(self._deliver(emission, futs))
        self._deliveries.add(task)
        task.add_done_callback(self._delivered)

    async def _deliver(self, emission: Emission[EventT], futs: list[tuple[KernelSummary, bytes, Any]]) -> None:
        failures = []
        for s, payload, fut in futs:
            try:
                await fut
            except Exception as exc:  # e.g. refused by the broker: kept as a dead letter, never dropped
                failures.append((s, payload, exc))
        await self.carry_out(self.router.delivered(emission, failures), emission.handle)

    def _delivered(self, task: asyncio.Future[None]) -> None:
        self._deliveries.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._failures.append(task.exception())  # type: ignore[arg-type]

    async def _all_delivered(self) -> None:
        """Wait for every summary sent so far (e.g. before a job-end marker, which must follow them)."""
        while self._deliveries:
            await asyncio.wait(set(self._deliveries))
        if self._failures:
            raise self._failures[0]


def install_compression(app: faust.App, settings: Settings, dead: DeadLetters,
                        staging: Staging) -> CompressionRouter[EventT]:
    """Add the compression agent, the job-end agent and their timers to ``app``; returns the router (its
    ``stats``, open windows and pending messages are what the worker's pages show)."""
    kernels = app.topic(Topic.KERNELS.full(settings), key_type=bytes, value_type=bytes)
    lifecycle = app.topic(Topic.LIFECYCLE.full(settings), key_type=bytes, value_type=bytes)
    router: CompressionRouter[EventT] = CompressionRouter(settings.worker, settings.detector, time.monotonic(),
                                                          staging)
    shell = CompressionShell(app, settings, router, dead)

    @app.agent(kernels, name="argus.compress")
    async def compress(stream: Any) -> AsyncIterable[None]:
        async for event in stream.noack().events():
            await shell.take(event)
            yield None

    @app.agent(lifecycle, name="argus.job-end")
    async def job_end(stream: faust.StreamT[bytes]) -> AsyncIterable[None]:
        async for value in stream:
            try:
                rec = JobLifecycle.decode(value)
            except SchemaError as exc:
                log.warning("undecodable lifecycle record ignored by the compressor (the sink dead-letters "
                            "it): %s", exc)
                continue
            if router.job_closed(rec):
                # An ABANDONED job (idle past job_idle_timeout_s, see argus.streams.diagnosis_agents) is closed
                # like an ended one. A marker appended to every kernel partition closes the job's windows
                # there once everything produced before the END has been read.
                marker = KernelBatch.job_end_marker(rec.job_id).encode()
                futs = [await kernels.send(key=job_key(rec.job_id), value=marker, partition=p, force=True)
                        for p in range(settings.partitions)]
                for fut in futs:
                    await fut
            yield None

    @app.timer(interval=staging.max_age_s / 2, name="argus.staged-windows")
    async def summarize_staged() -> None:
        await shell.flush_staged()

    @app.timer(interval=router.idle_tick_s, name="argus.idle-kernel-jobs")
    async def abandon_kernel_only_jobs() -> None:
        for rec in router.idle_jobs(time.monotonic()):
            fut = await lifecycle.send(key=job_key(rec.job_id), value=rec.encode(), force=True)
            await fut

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]
    async def on_revoked(sender: Any, *args: Any, **kwargs: Any) -> None:
        router.revoked()

    return router
