"""Entry point of the stream worker process (``argus worker``; docker-compose runs the same command)."""

from __future__ import annotations

import logging

from faust.worker import Worker

from argus.core.settings import Settings
from argus.heap_trim import start_heap_trimmer
from argus.streams.app import create_app

__all__ = ["run_worker"]

log = logging.getLogger(__name__)


def run_worker(settings: Settings) -> None:
    """Run the Faust worker until SIGTERM/SIGINT. Topics must exist (``argus up`` or ``argus topics``)."""
    app = create_app(settings)
    start_heap_trimmer()
    log.info("argus worker: app %s on %s; metrics on http://%s:%d/metrics", settings.app_id,
             settings.bootstrap_servers, settings.metrics_host, settings.worker_web_port)
    Worker(app, loglevel=settings.log_level.lower(), quiet=True, redirect_stdouts=False).execute_from_commandline()
