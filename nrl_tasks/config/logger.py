"""The ``logger`` section of the run config: console, artifacts, checksums, trackers (TensorBoard,
MLflow, W&B) and the step grouping in the Prefect UI. None of it changes a run's numbers, so the
whole section stays out of the config hash (:mod:`nrl_tasks.config.hash`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nrl_tasks.config.base import Section

__all__ = ["LoggerConfig", "MLflowConfig", "WandbConfig"]


class MLflowConfig(Section):
    experiment_name: str = Field(
        "nrl-flows", min_length=1, description="MLflow experiment of the run (created if missing)"
    )
    run_name: str | None = Field(None, description="MLflow run name; default: the run id")
    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking server (http(s)://host:port) or store URI; default: a SQLite store "
        "sqlite:///<log_dir>/mlflow/mlflow.db (browse with `mlflow ui --backend-store-uri ...`)",
    )


class WandbConfig(Section):
    project: str = Field("nrl-flows", min_length=1, description="W&B project")
    name: str | None = Field(None, description="W&B run name; default: the run id")


class LoggerConfig(Section):
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    console: bool = Field(True, description="print one progress line per step")
    artifacts: bool = Field(True, description="publish Prefect table/progress/markdown artifacts")
    num_rollouts_to_show: int = Field(4, ge=0, le=1024, description="best and worst rollouts in the markdown artifact")
    weights_checksum: bool = Field(True, description="record the policy weights checksum after each train")
    tensorboard_enabled: bool = Field(False, description="TensorBoard event files of every metrics line (flows.observe.trackers)")
    log_dir: str = Field(
        "logs", description="trackers' local directory: <log_dir>/<run_id>/{tensorboard,wandb}, <log_dir>/mlflow"
    )
    mlflow_enabled: bool = Field(False, description="an MLflow run mirroring every metrics line (flows.observe.trackers_mlflow)")
    mlflow: MLflowConfig = Field(default_factory=MLflowConfig)
    wandb_enabled: bool = Field(
        False,
        description="a W&B run mirroring every metrics line (flows.observe.trackers_wandb); offline unless WANDB_MODE says otherwise",
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    step_subflows: bool = Field(
        True,
        description="run the steps in Prefect subflow runs of the run's flow run, grouped by steps_per_subflow "
        "(off: the steps' tasks run directly in the run's flow run, named <stage>-<run_id>-step7 as always; "
        "a subflow costs 0.2-2 s on a SQLite server, bench_pipeline)",
    )
    steps_per_subflow: int | None = Field(
        None,
        ge=1,
        description="steps in one subflow run <run_id>-steps-0001-0010 (1: a subflow a step, <run_id>-step-0007); "
        "default: a flow run's steps in at most 4 subflows (max_num_steps/4 rounded up), so the UI's runs list "
        "shows runs, not steps",
    )
