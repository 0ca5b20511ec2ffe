"""CUDA graphs in the tracer: phases timed around graph replays, and nothing recorded inside a capture.

A loop captured with CUDA graphs (torch.compile's ``mode="reduce-overhead"``, ``torch.cuda.make_graphed_callables``,
Megatron's and NeMo's capture) runs its Python code, module hooks included, only while it is captured; every
later iteration replays the whole graph with one ``cudaGraphLaunch`` and no Python in between. Two consequences:
see docs/internals/producers.md.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from argus.producers.cuda_timing import PhaseOpener, PhaseRec
from argus.schemas.records import ParallelGroup, PhaseKind

__all__ = ["GraphMixin"]

log = logging.getLogger(__name__)


class GraphMixin(PhaseOpener):
    """Graph replays as phases and capture safety (see the module docstring); mixed into the Tracer."""

    _cuda: bool
    _graph_ids: dict[int, int]
    _graph_patch: tuple[Any, Any, Any] | None
    _captured: int

    def _torch(self) -> Any:
        raise NotImplementedError  # the Tracer's torch module (a test's fake)

    def _capturing(self) -> bool:
        """The current CUDA stream is capturing a graph (False without CUDA, or when it cannot be told)."""
        if not self._cuda:
            return False
        try:
            return bool(self._torch().cuda.is_current_stream_capturing())
        except Exception:
            return False

    def time_graph_replays(self) -> bool:
        """Time every ``torch.cuda.CUDAGraph.replay`` inside a step as a phase; False without CUDA graphs."""
        if self._graph_patch is not None:
            return True
        try:
            cls = self._torch().cuda.CUDAGraph
            original = cls.replay
        except Exception as exc:
            log.debug("no CUDA graphs to time: %s", exc)
            return False
        tracer = self

        @functools.wraps(original)
        def replay(graph: Any, *args: Any, **kwargs: Any) -> Any:
            if tracer._graph_patch is None:  # this tracer closed, another wrapper sits on top of it
                return original(graph, *args, **kwargs)
            rec = tracer._replay_phase(graph)
            try:
                return original(graph, *args, **kwargs)
            finally:
                if rec is not None:
                    tracer._close(rec)

        cls.replay = replay
        self._graph_patch = (cls, original, replay)
        return True

    def untime_graph_replays(self) -> None:
        patch, self._graph_patch = self._graph_patch, None
        if patch is not None:
            cls, original, wrapper = patch
            if getattr(cls, "replay", None) is wrapper:
                cls.replay = original

    def _replay_phase(self, graph: Any) -> PhaseRec | None:
        n = self._graph_ids.get(id(graph))
        if n is None:
            n = self._graph_ids[id(graph)] = len(self._graph_ids)
        return self._open(f"cuda-graph-{n}", PhaseKind.OTHER, ParallelGroup.NONE, None)
