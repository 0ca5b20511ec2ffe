"""Entry point of the stream worker process (``argus worker``; docker-compose runs the same command)."""

from __future__ import annotations

import logging

from faust.worker import Worker

from argus.core.settings import Settings
from argus.heap_trim import start_heap_trimmer
from argus.streams.app import create_app
from argus.streams.compression import load_compiled_core

__all__ = ["run_worker"]

log = logging.getLogger(__name__)


class _Worker(Worker):
    """Faust's worker without its terminal spinner. To spin on every log record, the spinner sets the root
    logger to DEBUG: every debug call of Faust and aiokafka (several per summary sent) then built a record and
    ran the handlers, whatever the log level asked for. The worker is a service; its output is a log."""

    def on_setup_root_logger(self, logger: logging.Logger, level: int) -> None:
        self.spinner = None


def run_worker(settings: Settings) -> None:
    """Run the Faust worker until SIGTERM/SIGINT. Topics must exist (``argus up`` or ``argus topics``)."""
    app = create_app(settings)
    load_compiled_core()  # before the first batch, not while it waits
    start_heap_trimmer()
    log.info("argus worker: app %s on %s; metrics on http://%s:%d/metrics", settings.app_id,
             settings.bootstrap_servers, settings.metrics_host, settings.worker_web_port)
    _Worker(app, loglevel=settings.log_level.lower(), quiet=True, redirect_stdouts=False).execute_from_commandline()
