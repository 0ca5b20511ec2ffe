"""The ground floor of argus: settings, errors and the enums every stage shares. It imports no other part of
argus (the import-linter contract in ``pyproject.toml`` holds every floor to that)."""

from argus.core.errors import ArgusError, ConfigError
from argus.core.settings import ENV_PREFIX, Secret, Settings

__all__ = ["ENV_PREFIX", "ArgusError", "ConfigError", "Secret", "Settings"]
