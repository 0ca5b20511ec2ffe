"""docker-compose.yml read as Docker Compose and the apache/kafka image read it, for tests without Docker.

* :func:`compose` parses the file (PyYAML resolves the ``x-argus-*`` anchors and ``<<`` merges as Compose does);
* :func:`interpolate` expands Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}`` and ``$$``;
* :func:`kafka_properties` turns the ``kafka`` service's ``KAFKA_*`` environment into the broker's
  ``server.properties`` as the image's start-up does (``utility render-properties``: the prefix dropped, ``_``
  -> ``.``, ``__`` -> ``_``, ``___`` -> ``-``, lower case; the JVM options left out; a value holding ``=`` is
  silently dropped by the image, so it is an error here);
* :func:`argus_services` lists the services that run the argus image, with their command.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"

#: KAFKA_* variables the image passes to the JVM instead of rendering them (kafka-propertiesSpec.json).
_KAFKA_NOT_PROPERTIES = frozenset({
    "KAFKA_VERSION", "KAFKA_HEAP_OPT", "KAFKA_LOG4J_OPTS", "KAFKA_OPTS", "KAFKA_JMX_OPTS",
    "KAFKA_JVM_PERFORMANCE_OPTS", "KAFKA_GC_LOG_OPTS", "KAFKA_LOG4J_ROOT_LOGLEVEL", "KAFKA_LOG4J_LOGGERS",
    "KAFKA_TOOLS_LOG4J_LOGLEVEL",
})
#: What the image sets when the environment does not (its configureDefaults) and compose leaves unset.
_KAFKA_IMAGE_DEFAULTS = {"KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0"}
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])((?:[^{}]|\{[^{}]*\})*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


class ComposeError(ValueError):
    """What ``docker compose`` would refuse (a required variable unset) or the image would mangle."""


def compose(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    """The parsed compose file."""
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict)
    return doc


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """``value`` with Compose's variables expanded from ``env``.

    Raises:
        ComposeError: a ``${VAR:?message}`` (or ``${VAR?message}``) whose variable is unset (or empty).
    """
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3) or ""
        current = env.get(name)
        missing = current is None or (op is not None and op.startswith(":") and current == "")
        if op is not None and op.endswith("?") and missing:
            raise ComposeError(f"required variable {name} is missing a value: {arg}")
        if op is not None and op.endswith("-") and missing:
            return interpolate(arg, env)
        return current or ""

    return _VAR.sub(sub, value)


def convert_key(name: str) -> str:
    """A ``KAFKA_*`` variable's property name as the image renders it (``KAFKA_LISTENER_NAME_X_Y`` ->
    ``listener.name.x.y``; ``__`` -> ``_``, ``___`` -> ``-``)."""
    key = name[len("KAFKA_"):]
    key = re.sub(r"(?<=[^_])_(?=[^_])", ".", key)
    return key.replace("___", "-").replace("__", "_").lower()


def kafka_properties(service: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """The ``server.properties`` the apache/kafka image renders from ``service``'s environment (interpolated
    with ``env``), its defaults included.

    Raises:
        ComposeError: a required variable unset, or a value the image would drop (it holds ``=``).
    """
    raw = {k: interpolate(str(v), env) for k, v in service["environment"].items()}
    for key, value in _KAFKA_IMAGE_DEFAULTS.items():
        raw.setdefault(key, value)
    out: dict[str, str] = {}
    for key, value in raw.items():
        if not key.startswith("KAFKA_") or key in _KAFKA_NOT_PROPERTIES:
            continue
        if "=" in value:
            raise ComposeError(f"{key}: the image drops values holding '=' (use a ${{file:...}} reference)")
        out[convert_key(key)] = value
    return out


def argus_services(doc: Mapping[str, Any] | None = None) -> dict[str, list[str]]:
    """``{service: command}`` of the services built from the argus image (its entrypoint is ``argus``)."""
    services = (doc or compose())["services"]
    return {name: [str(a) for a in svc["command"]] for name, svc in services.items() if "build" in svc}


def secret_files(doc: Mapping[str, Any] | None = None) -> dict[str, str]:
    """``{secret name: file}`` of the top-level ``secrets`` (files relative to the compose file)."""
    return {name: str(spec["file"]) for name, spec in (doc or compose())["secrets"].items()}
