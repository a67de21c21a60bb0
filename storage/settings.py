"""The environment knobs of the storage layer, read and validated in one place.

``storage`` imports nothing from ``nrl_tasks`` or ``flows``, so its knobs live here rather than
in :class:`nrl_tasks.settings.NrlSettings` (whose docstring points here); both are documented
in one table in ``docs/settings.md``.

Each field is read from the environment variable named as its alias (exactly, case-sensitive);
an empty value counts as unset. A value that does not validate raises a pydantic
``ValidationError`` (a ``ValueError``) naming the variable.

>>> StorageSettings(NRL_STORAGE_RETRY_ATTEMPTS="3").retry_overrides()
{'attempts': 3}
"""

from __future__ import annotations

import functools
import os
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["StorageSettings", "storage_settings"]


class StorageSettings(BaseSettings):
    """Storage knobs from the environment (the variable of each field is its alias).

    The retry fields override the defaults of :class:`storage.retry.RetryPolicy`; a policy set
    in code (``storage.retry.set_retry_policy``, the run config's ``storage.retry``) overrides
    them in turn.
    """

    model_config = SettingsConfigDict(
        case_sensitive=True, env_ignore_empty=True, extra="ignore", populate_by_name=True, frozen=True
    )

    checksum: Literal["xxh3-128", "crc32", "blake2b-128"] | None = Field(
        None,
        validation_alias="NRL_STORAGE_CHECKSUM",
        description="checksum algorithm of new datasets (xxh3-128, crc32, blake2b-128); "
        "default xxh3-128 when xxhash is installed, else crc32",
    )
    retry_attempts: int | None = Field(
        None, ge=1, validation_alias="NRL_STORAGE_RETRY_ATTEMPTS",
        description="calls of a remote storage operation before it fails (1 = no retry); default 8",
    )
    retry_initial_s: float | None = Field(
        None, ge=0, validation_alias="NRL_STORAGE_RETRY_INITIAL_S",
        description="first backoff delay (s), doubled after each failure; default 0.5",
    )
    retry_max_s: float | None = Field(
        None, ge=0, validation_alias="NRL_STORAGE_RETRY_MAX_S", description="longest backoff delay (s); default 10"
    )

    def retry_overrides(self) -> dict[str, Any]:
        """The ``RetryPolicy`` fields set in the environment."""
        fields = {"attempts": self.retry_attempts, "initial_delay_s": self.retry_initial_s, "max_delay_s": self.retry_max_s}
        return {k: v for k, v in fields.items() if v is not None}


_NAMES = tuple(str(f.validation_alias) for f in StorageSettings.model_fields.values())


@functools.lru_cache(maxsize=8)
def _settings_for(values: tuple[str | None, ...]) -> StorageSettings:
    return StorageSettings()


def storage_settings() -> StorageSettings:
    """The current :class:`StorageSettings`: re-read whenever one of its variables changes (a
    validated object is cached per set of values: constructing one costs ~1 ms, and the retry
    policy is looked up on every remote call)."""
    return _settings_for(tuple(os.environ.get(name) for name in _NAMES))
