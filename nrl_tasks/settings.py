"""Every ``NRL_*`` environment knob of the flows and tasks, read and validated in one place.

:func:`nrl_settings` returns the current :class:`NrlSettings`; the storage layer's knobs
(``NRL_STORAGE_CHECKSUM``, ``NRL_STORAGE_RETRY_*``) are in :class:`storage.settings.StorageSettings`
(``storage`` imports nothing from here). ``docs/settings.md`` lists both in one table.

Each field is read from the environment variable named as its alias (exactly, case-sensitive);
an empty value counts as unset. A value that does not validate raises a pydantic
``ValidationError`` (a ``ValueError``) naming the variable, where it is used.

:class:`WorkerEnv` is not a user knob: the variables a worker group sets for each of its actors
(``nrl_tasks.distributed.worker_groups``), read back inside the actor.

>>> NrlSettings(NRL_REFIT_NUM_BUFFERS="3", NRL_KEEP_ACTORS="1").refit_num_buffers
3
>>> NrlSettings(NRL_PLUGINS="a.b").plugins, NrlSettings(NRL_PROBE_TIMEOUT_S="2.5").probe_timeout_s
('a.b', 2.5)
"""

from __future__ import annotations

import functools
import os

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from storage.settings import StorageSettings

__all__ = [
    "DEFAULT_MODEL_CACHE",
    "NrlSettings",
    "WorkerEnv",
    "nrl_settings",
    "settings_problems",
]

#: Where built-in models are prepared when ``NRL_MODEL_CACHE`` is unset (``~`` expanded on use).
DEFAULT_MODEL_CACHE = os.path.join("~", ".cache", "nrl-flows", "models")

_CONFIG = SettingsConfigDict(case_sensitive=True, env_ignore_empty=True, extra="ignore", populate_by_name=True, frozen=True)


class NrlSettings(BaseSettings):
    """The user knobs of nrl-flows (the variable of each field is its alias).

    Storage knobs: :class:`storage.settings.StorageSettings`. Booleans accept ``1/0``,
    ``true/false``, ``yes/no``, ``on/off``.
    """

    model_config = _CONFIG

    # ----------------------------------------------------------------------- flows
    keep_actors: bool = Field(
        False, validation_alias="NRL_KEEP_ACTORS",
        description="keep the run's Ray actors (and a local Ray the flow started) when the flow ends",
    )
    model_cache: str | None = Field(
        None, validation_alias="NRL_MODEL_CACHE",
        description=f"where built-in models (builtin:tiny, builtin:smollm2) are prepared; default {DEFAULT_MODEL_CACHE}",
    )
    plugins: str = Field(
        "", validation_alias="NRL_PLUGINS",
        description="comma-separated module[:factory] stage-observer plug-ins (flows.run.plugins)",
    )
    plugin_import_timeout_s: float = Field(
        60.0, gt=0, le=3600, validation_alias="NRL_PLUGIN_IMPORT_TIMEOUT_S",
        description="how long (s) preflight lets a user's plug-in module (env.reward_fn, env.environment) "
        "import in a child process before it counts as hanging",
    )
    lease_ttl_s: float = Field(
        60.0, gt=0, le=3600, validation_alias="NRL_LEASE_TTL_S",
        description="a run-lease holder silent this long (s) is dead",
    )
    lease_heartbeat_s: float = Field(
        10.0, gt=0, le=600, validation_alias="NRL_LEASE_HEARTBEAT_S",
        description="how often (s) the run-lease holder renews the lease",
    )
    # ----------------------------------------------------------------------- actors
    probe_timeout_s: float = Field(
        30.0, gt=0, validation_alias="NRL_PROBE_TIMEOUT_S",
        description="how long (s) a worker may take to answer a health probe before it counts as stuck",
    )
    node_ip: str | None = Field(
        None, validation_alias="NRL_NODE_IP",
        description="address other nodes reach this one at (collective groups); default: Ray's "
        "node address on a multi-node cluster, else 127.0.0.1",
    )
    # ----------------------------------------------------------------------- refit
    refit_cache_buffers: bool = Field(
        True, validation_alias="NRL_REFIT_CACHE_BUFFERS",
        description="reuse CPU refit buffers across refits (0 disables the pool)",
    )
    refit_buffer_size_bytes: int | None = Field(
        None, ge=1, validation_alias="NRL_REFIT_BUFFER_SIZE_BYTES",
        description="packed refit chunk size (bytes); default: CUDA memory x NRL_REFIT_BUFFER_MEMORY_RATIO "
        "(<= 5 GiB), 4 MiB on CPU",
    )
    refit_buffer_memory_ratio: float = Field(
        0.02, gt=0, le=1, validation_alias="NRL_REFIT_BUFFER_MEMORY_RATIO",
        description="on CUDA, the packed chunk size as a fraction of device memory",
    )
    refit_num_buffers: int = Field(
        2, ge=1, validation_alias="NRL_REFIT_NUM_BUFFERS",
        description="alternating buffers of a packed broadcast (broadcasts in flight per side)",
    )

    @field_validator("model_cache")
    @classmethod
    def _cache_is_a_folder(cls, value: str | None) -> str | None:
        if value and os.path.exists(os.path.expanduser(value)) and not os.path.isdir(os.path.expanduser(value)):
            raise ValueError("is not a folder (it names a file); point it at a directory, or unset it")
        return value

    @field_validator("node_ip")
    @classmethod
    def _an_ip_address(cls, value: str | None) -> str | None:
        import ipaddress

        if value is not None:
            try:
                ipaddress.ip_address(value.strip())
            except ValueError:
                raise ValueError("is not an IP address (other nodes connect to this one at it)") from None
            return value.strip()
        return value

    def model_cache_dir(self) -> str:
        """``model_cache``, else :data:`DEFAULT_MODEL_CACHE` (expanded)."""
        return self.model_cache or os.path.expanduser(DEFAULT_MODEL_CACHE)


_NAMES = tuple(str(f.validation_alias) for f in NrlSettings.model_fields.values())


@functools.lru_cache(maxsize=16)
def _settings_for(values: tuple[str | None, ...]) -> NrlSettings:
    return NrlSettings()


def nrl_settings() -> NrlSettings:
    """The current :class:`NrlSettings`: re-read whenever one of its variables changes (so
    ``monkeypatch.setenv`` and a flow's own ``os.environ`` edits take effect at once). A validated
    object is cached per set of values: constructing one costs ~1 ms and some knobs are read on
    hot paths (the refit buffer pool)."""
    return _settings_for(tuple(os.environ.get(name) for name in _NAMES))


def settings_problems() -> list[str]:
    """One line per ``NRL_*`` variable (of :class:`NrlSettings` and the storage layer's
    :class:`storage.settings.StorageSettings`) whose value does not validate, naming the variable
    and its value; empty when all do. The CLI checks this first, before anything starts, so
    ``NRL_LEASE_TTL_S=abc`` is a usage error rather than a failure after Prefect started.

    >>> settings_problems()
    []
    """
    from pydantic import ValidationError

    def storage_settings() -> object:  # importing ``storage`` reads its settings already
        return StorageSettings()

    out: list[str] = []
    for build in (NrlSettings, storage_settings):
        try:
            build()
        except ValidationError as exc:
            for err in exc.errors():
                name = ".".join(str(p) for p in err["loc"])
                msg = str(err["msg"]).removeprefix("Value error, ")
                out.append(f"environment variable {name}={os.environ.get(name)!r}: {msg}")
    return out


class WorkerEnv(BaseSettings):
    """What a worker group tells each of its actors through the environment (set by
    ``nrl_tasks.distributed.worker_groups`` when it creates the actor, read inside it)."""

    model_config = _CONFIG

    rank: int = Field(0, ge=0, validation_alias="NRL_WORKER_RANK", description="the actor's rank in its group")
    world_size: int | None = Field(
        None, ge=0, validation_alias="NRL_WORKER_WORLD_SIZE", description="workers in the group (unset: not in a group)"
    )
    group: str | None = Field(None, validation_alias="NRL_WORKER_GROUP", description="the group's name prefix")
