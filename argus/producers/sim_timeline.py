"""Lays out one simulated step in time, for every rank at once (numpy over the ranks of a stage).

Compute kernels run back to back; a collective ends together for every member of its group (at the last
arrival plus the transfer), so a straggler makes its peers' collectives long; pipeline transfers wait for both
sides; ``finish_grad_sync`` is a job-wide barrier.

The semantics in full: docs/internals/producers.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from argus.producers.sim_workload import Op, StageProgram

__all__ = ["GAP_NS", "SYNC_NS", "StepTimes", "Timeline"]

I64 = npt.NDArray[np.int64]

#: Gap between consecutive compute kernels on a stream (kernel launch), integer nanoseconds.
GAP_NS = 2_000
#: Cost of the finish_grad_sync barrier, integer nanoseconds.
SYNC_NS = 20_000


@dataclass(frozen=True, eq=False)
class StepTimes:
    """Timing of one step: per stage ``(ranks, kernels)`` matrices, in integer nanoseconds."""

    start: list[I64]
    dur: list[I64]
    fb_end_ns: int
    end_ns: int


class _Stage:
    __slots__ = ("cur", "dpf", "dur", "ppf", "run_start", "run_sums", "start")

    def __init__(self, prog: StageProgram, dur: I64, gpu_start: I64) -> None:
        self.cur = gpu_start
        self.dpf = gpu_start
        self.ppf = gpu_start
        self.dur = dur
        self.start = np.zeros_like(dur)
        self.run_start = np.zeros((dur.shape[0], prog.run_first.shape[0]), dtype=np.int64)
        self.run_sums = np.zeros_like(self.run_start)


class Timeline:
    """Static schedule of a job's programs; :meth:`run` times one step."""

    def __init__(self, programs: tuple[StageProgram, ...], dp: int, tp: int) -> None:
        self.programs = programs
        self.dp, self.tp = dp, tp
        self.order = _topological_order(programs)
        self._cidx = [np.flatnonzero(p.compute) for p in programs]
        self._cfirst = [p.run_first[p.run_of[c]] for p, c in zip(programs, self._cidx, strict=True)]
        self._crun = [p.run_of[c] for p, c in zip(programs, self._cidx, strict=True)]
        self._gap = [np.where(p.compute, GAP_NS, 0).astype(np.int64) for p in programs]

    def _tp_max(self, x: I64) -> I64:
        return np.repeat(x.reshape(self.dp, self.tp).max(axis=1), self.tp)

    def _dp_max(self, x: I64) -> I64:
        return np.tile(x.reshape(self.dp, self.tp).max(axis=0), self.dp)

    def run(self, dur: list[I64], gpu_start: list[I64]) -> StepTimes:
        """Time one step.

        Args:
            dur: per stage, ``(ranks, kernels)`` durations in ns: compute kernel durations, and the
                transfer time at collective columns (overwritten in place with the kernel durations).
            gpu_start: per stage, when each rank's GPU work of the step may begin, ns since the epoch.
        """
        states = [_Stage(p, d, g) for p, d, g in zip(self.programs, dur, gpu_start, strict=True)]
        csz: list[I64] = []
        for p, st, gap in zip(self.programs, states, self._gap, strict=True):
            slot = np.where(p.compute, st.dur, 0) + gap
            c = np.zeros((slot.shape[0], slot.shape[1] + 1), dtype=np.int64)
            np.cumsum(slot, axis=1, out=c[:, 1:])
            csz.append(c)
            st.run_sums = c[:, p.run_last + 1] - c[:, p.run_first]
        pending: dict[int, tuple[int, int, I64]] = {}
        for s, bi in self.order:
            self._exec(s, self.programs[s].blocks[bi].ops, states, pending)
        fb_end = max(int(np.maximum(st.cur, st.dpf).max()) for st in states) + SYNC_NS
        for s, st in enumerate(states):
            st.cur = np.full_like(st.cur, fb_end)
            st.dpf = st.cur
            self._exec(s, self.programs[s].tail, states, pending)
        end = max(int(np.maximum(st.cur, st.dpf).max()) for st in states)
        for st, c, cidx, cfirst, crun in zip(states, csz, self._cidx, self._cfirst, self._crun, strict=True):
            st.start[:, cidx] = st.run_start[:, crun] + c[:, cidx] - c[:, cfirst]
        return StepTimes([st.start for st in states], [st.dur for st in states], fb_end, end)

    def _exec(self, s: int, ops: tuple[tuple[int, int, int], ...], states: list[_Stage],
              pending: dict[int, tuple[int, int, I64]]) -> None:
        st = states[s]
        for op, a, b in ops:
            if op == Op.RUN:
                st.run_start[:, a] = st.cur
                st.cur = st.cur + st.run_sums[:, a]
            elif op == Op.TP_SYNC:
                arrive = st.cur
                end = self._tp_max(arrive) + self._tp_max(st.dur[:, a])
                st.start[:, a] = arrive
                st.dur[:, a] = end - arrive
                st.cur = end
            elif op == Op.DP_SYNC:
                arrive = np.maximum(st.cur, st.dpf)
                end = self._dp_max(arrive) + self._dp_max(st.dur[:, a])
                st.start[:, a] = arrive
                st.dur[:, a] = end - arrive
                st.dpf = end
                if b:
                    st.cur = end
            elif op == Op.DP_WAIT:
                st.cur = np.maximum(st.cur, st.dpf)
            elif op == Op.SEND:
                pending[b] = (s, a, st.cur)
            elif op == Op.RECV:
                ss, ia, ready = pending.pop(b)
                so = states[ss]
                begin = np.maximum(np.maximum(ready, st.cur), np.maximum(st.ppf, so.ppf))
                transfer = np.maximum(st.dur[:, a], so.dur[:, ia])
                end = begin + transfer
                st.start[:, a] = begin
                so.start[:, ia] = begin
                st.dur[:, a] = transfer
                so.dur[:, ia] = transfer
                st.ppf = end
                so.ppf = end
                st.cur = end
            else:  # pragma: no cover - the builder emits only the ops above
                raise ValueError(f"unknown op {op}")


def _topological_order(programs: tuple[StageProgram, ...]) -> list[tuple[int, int]]:
    """``(stage, block)`` pairs so that every pipeline receive comes after its send."""
    pp = len(programs)
    ptr = [0] * pp
    done: set[tuple[int, bool, int]] = set()
    order: list[tuple[int, int]] = []
    total = sum(len(p.blocks) for p in programs)
    while len(order) < total:
        progressed = False
        for s, prog in enumerate(programs):
            while ptr[s] < len(prog.blocks):
                blk = prog.blocks[ptr[s]]
                if blk.backward and s < pp - 1:
                    dep: tuple[int, bool, int] | None = (s + 1, True, blk.microbatch)
                elif not blk.backward and s > 0:
                    dep = (s - 1, False, blk.microbatch)
                else:
                    dep = None
                if dep is not None and dep not in done:
                    break
                order.append((s, ptr[s]))
                done.add((s, blk.backward, blk.microbatch))
                ptr[s] += 1
                progressed = True
        if not progressed:  # pragma: no cover - 1F1B never deadlocks
            raise RuntimeError("pipeline schedule deadlocks")
    return order
