"""The stream worker's start: the log level it is given holds for every library, and the compiled core loads
before the first batch."""

from __future__ import annotations

import logging
from pathlib import Path

from argus.core.settings import Settings
from argus.streams.app import create_app
from argus.streams.compression import load_compiled_core
from argus.streams.worker import _Worker


def test_the_worker_keeps_the_root_logger_at_its_level(tmp_path: Path) -> None:
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    try:
        app = create_app(Settings.load(env={}, home=tmp_path, bootstrap_servers="127.0.0.1:1"))
        worker = _Worker(app, loglevel="warning", quiet=True, redirect_stdouts=False)
        worker._setup_logging()
        # Faust's spinner would set the root to DEBUG: every library's debug call then builds a record.
        assert not logging.getLogger("aiokafka.producer.producer").isEnabledFor(logging.DEBUG)
        assert not logging.getLogger("faust.topics").isEnabledFor(logging.DEBUG)
        assert logging.getLogger("argus.streams").isEnabledFor(logging.WARNING)
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]


def test_the_compiled_core_loads() -> None:
    load_compiled_core()  # decodes and clusters a small batch; raises if a kernel does not compile


def test_the_web_server_binds_the_metrics_host_only(tmp_path: Path) -> None:
    """Faust's web_host only names the host in URLs; web_bind stayed 0.0.0.0 (/stats and /metrics open to the
    network, seen listening on 0.0.0.0:16066)."""
    app = create_app(Settings.load(env={}, home=tmp_path, bootstrap_servers="127.0.0.1:1"))
    assert app.conf.web_bind == "127.0.0.1" and app.conf.web_host == "127.0.0.1"
    app = create_app(Settings.load(env={}, home=tmp_path, bootstrap_servers="127.0.0.1:1", metrics_host="0.0.0.0"))
    assert app.conf.web_bind == "0.0.0.0"
