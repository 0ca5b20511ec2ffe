"""Fail-slow detectors: per-window compression of kernel durations and distances between ranks."""
