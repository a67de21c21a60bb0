"""The error of a bad run config, raised by the schema's checks and by the loader (``flows.config``)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration problem (unknown key, wrong type, impossible combination, missing file)."""
