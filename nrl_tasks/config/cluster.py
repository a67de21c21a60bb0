"""Where a run runs and writes, and how often it keeps its state: the ``cluster``, ``storage`` and
``checkpointing`` sections of the run config. Only ``checkpointing.enabled`` and
``checkpointing.save_optimizer`` count in the config hash (:mod:`nrl_tasks.config.hash`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from nrl_tasks.config.base import Section
from nrl_tasks.config.bounds import MAX_RETRIES, MAX_SECONDS, MAX_STEPS, MAX_WORKERS
from nrl_tasks.config.credentials import credential_paths
from storage.retry import RetryPolicy

__all__ = ["CheckpointingConfig", "ClusterConfig", "RayConfig", "StorageConfig", "StorageRetryConfig"]


class CheckpointingConfig(Section):
    enabled: bool = True
    save_period: int = Field(10, ge=1, le=MAX_STEPS, description="checkpoint every N steps (and at the end)")
    keep_last_k: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="retention: keep only the newest K (None: all)"
    )
    keep_top_k: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="retention: also keep the K best by metric_name (None: off)"
    )
    metric_name: str = Field("val_accuracy", description="metrics.jsonl column ranking checkpoints for keep_top_k")
    higher_is_better: bool = True
    save_optimizer: bool = True


class RayConfig(Section):
    address: str | None = Field(None, description="GCS address of a running cluster (None: RAY_ADDRESS or local)")
    num_cpus: int | None = Field(
        None, ge=1, le=1 << 16, description="logical CPUs of a local Ray (None: default; <= 65536)"
    )
    policy_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per policy worker bundle (node placement)"
    )
    generation_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per generation worker bundle (node placement)"
    )


class ClusterConfig(Section):
    num_nodes: int = Field(1, ge=1, le=1 << 16, description="<= 65536")
    gpus_per_node: int = Field(0, ge=0, le=64, description="<= 64")
    policy_workers: int = Field(1, ge=1, le=MAX_WORKERS, description="data-parallel trainer workers (<= 1024)")
    num_cpus_per_worker: float = Field(1.0, ge=0, le=MAX_WORKERS, description="<= 1024")
    ray: RayConfig = Field(default_factory=RayConfig)


class StorageRetryConfig(Section):
    """Backoff of remote-storage calls that fail transiently (endpoint down, throttled, 5xx).

    Waits ``initial_delay_s``, doubling up to ``max_delay_s``, for ``attempts`` calls in all; the
    defaults wait out ~40 s of outage. See ``storage.retry``.
    """

    attempts: int = Field(8, ge=1, le=MAX_RETRIES, description="calls in all (1: no retry; <= 100)")
    initial_delay_s: float = Field(0.5, ge=0, le=MAX_SECONDS, description="first backoff (s, <= 1 day)")
    max_delay_s: float = Field(10.0, ge=0, le=MAX_SECONDS, description="longest backoff (s, <= 1 day)")

    def policy(self) -> Any:
        """The ``storage.retry.RetryPolicy`` of these settings."""

        return RetryPolicy(attempts=self.attempts, initial_delay_s=self.initial_delay_s, max_delay_s=self.max_delay_s)


class StorageConfig(Section):
    """Where a run's files go. Credentials never go here: they come from the environment
    (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL``)
    or an AWS profile (``storage_options: {profile: name}``), because the config is saved with the
    run and sent to Prefect as a flow parameter."""

    root: str = Field("./runs", description="local path, file:// or s3://bucket/prefix")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec/s3fs options without credentials (endpoint_url, profile, ...)"
    )
    keep_last_k_steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="retention of step batches (None: all)")
    fsync: bool = Field(
        True,
        description=(
            "fsync each stage dataset (shards, manifest, directory) before it counts as committed; false keeps "
            "datasets consistent across killed processes (the page cache survives them) but not across a power "
            "loss or kernel crash (local storage only)"
        ),
    )
    retry: StorageRetryConfig = Field(default_factory=StorageRetryConfig, description="remote-storage backoff")

    @model_validator(mode="after")
    def _no_credentials(self) -> "StorageConfig":
        found = credential_paths(self.storage_options)
        if found:
            raise ValueError(
                f"storage.storage_options.{found[0]} looks like a credential: configs are saved with the run and "
                "sent to Prefect, so set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN in the "
                "environment (or storage.storage_options.profile) instead"
            )
        return self
