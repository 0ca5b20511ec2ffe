"""Rank-side producers: the non-blocking publisher, the job simulator and (with torch) the live tracer."""

from argus.producers.publisher import Publisher, PublisherStats

__all__ = ["Publisher", "PublisherStats"]
