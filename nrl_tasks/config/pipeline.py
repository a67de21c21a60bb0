"""The post-training pipeline's file (``nrl pipeline --config configs/pipeline_tiny.yaml``,
:mod:`flows.pipeline`): an ordered list of stages, each a run of an algorithm or an evaluation.

::

    stages:
      - name: sft                         # the stage's run id is <pipeline_id>-sft
        config: sft_tiny.yaml             # its run config (relative to this file), any algorithm
        overrides: [sft.max_num_steps=20] # dotted key=value, as on the command line
        gate: {metric: val_loss, max: 2.0}   # optional: stop the pipeline when not met
      - name: dpo
        config: dpo_tiny.yaml
        gate: {metric: val_accuracy, min: 0.5}
      - name: grpo
        config: grpo_tiny.yaml
      - name: eval                        # an evaluation of the last run's final checkpoint
        eval: {num_samples: 2, max_prompts: 16}

Each run stage starts from the final checkpoint of the run stage before it (``policy.model_name``
set to that checkpoint's ``weights``); the first starts from its own config's model. A gate reads
the stage's last recorded value of ``metric`` (its metrics lines: ``val_accuracy``, ``val_loss``,
``reward_mean``, ...; an eval stage's ``accuracy`` or ``pass_at_k``) and holds when it is at
least ``min`` / at most ``max``.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from nrl_tasks.config.base import Section

__all__ = ["EvalStageConfig", "GateConfig", "PipelineConfig", "PipelineStageConfig"]


class GateConfig(Section):
    """A condition on a stage's figures the pipeline checks before its next stage."""

    metric: str = Field(min_length=1, max_length=200, description="a metrics-line key (an eval stage: accuracy, pass_at_k)")
    min: float | None = Field(None, description="holds when the value is at least this")
    max: float | None = Field(None, description="holds when the value is at most this")

    @model_validator(mode="after")
    def _bound(self) -> "GateConfig":
        if self.min is None and self.max is None:
            raise ValueError(f"gate on {self.metric!r} needs min or max")
        return self

    def holds(self, value: float | None) -> bool:
        """Whether ``value`` meets the gate (``None``, never recorded: it does not).

        >>> GateConfig(metric="a", min=0.5).holds(0.5), GateConfig(metric="a", max=1.0).holds(1.5), GateConfig(metric="a", min=0).holds(None)
        (True, False, False)
        """
        if value is None:
            return False
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)

    def describe(self) -> str:
        parts = [f">= {self.min}" if self.min is not None else "", f"<= {self.max}" if self.max is not None else ""]
        return f"{self.metric} " + " and ".join(p for p in parts if p)


class EvalStageConfig(Section):
    """An evaluation of the previous run stage's final checkpoint (``nrl eval``'s options)."""

    num_samples: int = Field(4, ge=0, le=1024, description="k of pass@k (0: greedy only)")
    max_prompts: int | None = Field(None, ge=1, le=10**7, description="at most this many held-out prompts")
    dataset: str | None = Field(None, description="held-out prompts file (default: the run's validation split)")


class PipelineStageConfig(Section):
    """One stage: a run of its config's algorithm (``config``), or an evaluation (``eval``)."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,31}$", description="the stage's name; its run id is <pipeline_id>-<name>")
    config: str | None = Field(None, max_length=4096, description="the run's config file, relative to the pipeline file")
    overrides: list[str] = Field(default_factory=list, max_length=256, description="dotted key=value overrides of the config")
    gate: GateConfig | None = None
    eval: EvalStageConfig | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> "PipelineStageConfig":
        if (self.config is None) == (self.eval is None):
            raise ValueError(f"stage {self.name!r}: set either `config` (a run) or `eval` (an evaluation)")
        if self.eval is not None and self.overrides:
            raise ValueError(f"stage {self.name!r}: an eval stage takes no overrides")
        return self


class PipelineConfig(Section):
    """The pipeline file (see the module docstring)."""

    stages: list[PipelineStageConfig] = Field(min_length=1, max_length=64)

    @model_validator(mode="after")
    def _order(self) -> "PipelineConfig":
        names = [s.name for s in self.stages]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"stage names must be unique: {dup} repeat")
        if self.stages[0].eval is not None:
            raise ValueError(f"the first stage ({self.stages[0].name!r}) is an evaluation: it has no run to evaluate")
        return self
