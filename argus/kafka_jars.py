"""The jars of the local Kafka: Apache Kafka ``Settings.kafka_version`` and its runtime dependencies, fetched from
Maven Central with ``mvn`` through the ``kafka/pom.xml`` shipped in this package, cached under
``Settings.kafka_cache/<version>/libs`` (``python -m argus.local_kafka fetch``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from argus.core.errors import KafkaLocalError
from argus.core.settings import Settings

__all__ = ["fetch_jars", "pom_path", "tail_text"]

logger = logging.getLogger(__name__)

_COMPLETE_MARKER = ".complete"
_TAIL_CHARS = 4000


def pom_path() -> Path:
    """The pom that lists the broker's jars (shipped inside the package)."""
    return Path(__file__).parent / "kafka" / "pom.xml"


def tail_text(text: str, limit: int = _TAIL_CHARS) -> str:
    """The end of ``text`` (a tool's output, a log) in at most ``limit`` characters, for an error message."""
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def fetch_jars(settings: Settings, progress: Callable[[str], None] | None = None) -> Path:
    """Download Apache Kafka ``settings.kafka_version`` and its runtime dependencies with Maven.

    Idempotent: a completed download (marker file present) is reused. Concurrent callers are
    serialised with a lock file. Returns the ``libs`` directory holding the jars.

    Raises:
        KafkaLocalError: ``mvn`` is missing or failed (the message carries the tail of its output).
    """
    version_dir = (settings.kafka_cache / settings.kafka_version).resolve()
    libs = version_dir / "libs"
    marker = version_dir / _COMPLETE_MARKER
    if marker.exists() and any(libs.glob("kafka_*.jar")):
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaLocalError("Maven (mvn) is not on PATH; it is needed to fetch the Kafka jars")
    version_dir.mkdir(parents=True, exist_ok=True)
    with open(version_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and any(libs.glob("kafka_*.jar")):  # another process finished meanwhile
            return libs
        staging = version_dir / f"libs.partial-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        cmd = [
            mvn, "-q", "-B", "-f", str(pom_path()), f"-Dkafka.version={settings.kafka_version}",
            "dependency:copy-dependencies", "-DincludeScope=runtime", f"-DoutputDirectory={staging}",
        ]
        msg = f"fetching Apache Kafka {settings.kafka_version} jars from Maven Central into {libs}"
        logger.info(msg)
        if progress is not None:
            progress(msg)
        started = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not any(staging.glob("kafka_*.jar")):
            shutil.rmtree(staging, ignore_errors=True)
            raise KafkaLocalError(
                f"mvn failed (exit {proc.returncode}) fetching Kafka {settings.kafka_version}:\n"
                + tail_text(proc.stderr + "\n" + proc.stdout)
            )
        shutil.rmtree(libs, ignore_errors=True)
        staging.rename(libs)
        count = sum(1 for _ in libs.glob("*.jar"))
        marker.write_text(f"{settings.kafka_version} {count} jars\n")
        msg = f"fetched {count} jars in {time.monotonic() - started:.1f}s"
        logger.info(msg)
        if progress is not None:
            progress(msg)
    return libs
