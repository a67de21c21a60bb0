"""The warm start a GRPO run can run itself: an SFT run, then GRPO from its weights.

A tiny model from scratch is almost never right, so GRPO on it sees reward 0 everywhere and
learns nothing. With ``warm_start.sft_steps: N`` in the config the ``grpo`` flow first trains an
SFT run (:mod:`flows.algorithms.sft`; so the ``grpo-train`` deployment's default run learns
visibly):

1. the SFT run is ``<run_id>-sft`` under the same storage root (a subflow run of the GRPO flow
   run, a run of its own: lease, status, metrics, summary, resume), ``sft.max_num_steps = N``
   steps of ``warm_start.batch_size`` rows (``warm_start.lr``, if set, as its learning rate) on
   the built-in task's reference answers, checkpointed at step ``N``; it trains full weights even
   when the GRPO run has LoRA on (``policy.dtensor_cfg.lora_cfg``), whose adapters then sit on
   the SFT weights;
2. the GRPO run's ``policy.model_name`` becomes that checkpoint's weights, and its saved
   ``config.yaml`` records them (with the ``warm_start`` section, which the config hash counts).

Idempotent: a committed warm-start checkpoint is reused, so a retried or resumed flow (its
``config`` still names the base model) maps to the same weights and the same config hash without
training again; an SFT run killed midway resumes where it stopped; a config whose
``policy.model_name`` already is the run's warm-start weights (the saved ``config.yaml`` of a
resume) is used as it is once they are committed, else the SFT run is resumed (the GRPO run's
``config.yaml`` and ``status.json`` are written before the SFT starts, so a run killed there is
listed by ``nrl runs`` and resumed by ``nrl resume``). The post-training pipeline (:mod:`flows.pipeline`) is the general form:
any stages, each from the last one's checkpoint.
"""

from __future__ import annotations

from typing import Any

from flows.algorithms.sft import sft
from flows.config import MasterConfig
from flows.run.resolve import resolve_config
from nrl_tasks.config.sft import SFTConfig
from nrl_tasks.run_layout import RunLayout, join_uri
from nrl_tasks.stages.checkpoint import is_checkpoint_committed
from storage import fs

__all__ = ["ensure_warm_start", "run_sft_warm_start", "warm_start_config", "warm_start_run_id", "warm_start_weights", "with_warm_start_weights"]

#: the warm start's draw of rows is independent of the GRPO run's draw of prompts
SEED_OFFSET = 1_000_003


def warm_start_run_id(run_id: str) -> str:
    return f"{run_id}-sft"


def warm_start_weights(cfg: MasterConfig, run_id: str) -> str:
    """URI of the warm-start weights of run ``run_id`` (``<root>/<run_id>-sft/checkpoints/step_N/weights``)."""
    ck = RunLayout(cfg.storage.root, warm_start_run_id(run_id)).checkpoint_uri(cfg.warm_start.sft_steps)
    return join_uri(ck, "weights")


def with_warm_start_weights(cfg: MasterConfig, run_id: str) -> MasterConfig:
    """``cfg`` with ``policy.model_name`` set to the run's warm-start weights (no training;
    ``cfg`` unchanged without a warm start)."""
    if not cfg.warm_start.sft_steps:
        return cfg
    weights = warm_start_weights(cfg, run_id)
    return cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"model_name": weights})})


def warm_start_config(cfg: MasterConfig) -> dict[str, Any]:
    """The SFT run's config (data) for GRPO config ``cfg``: its policy (full weights, the warm
    start's batch size and learning rate), data and seed, an ``sft`` section of ``N`` steps
    checkpointed at the last (even where the GRPO run itself saves no checkpoints), no warm start of its own."""
    ws, policy = cfg.warm_start, cfg.policy
    if policy.dtensor_cfg.lora_cfg.enabled:
        dt = policy.dtensor_cfg.model_copy(update={"lora_cfg": type(policy.dtensor_cfg.lora_cfg)()})
        policy = policy.model_copy(update={"dtensor_cfg": dt})
    mbs = min(policy.train_micro_batch_size, ws.batch_size)
    update: dict[str, Any] = {"train_global_batch_size": ws.batch_size, "train_micro_batch_size": mbs}
    if ws.lr is not None:
        kwargs = policy.optimizer.kwargs.model_copy(update={"lr": ws.lr})
        update["optimizer"] = policy.optimizer.model_copy(update={"kwargs": kwargs})
    policy = policy.model_copy(update=update)
    base = cfg.model_copy(update={
        "warm_start": type(ws)(), "policy": policy, "sft": SFTConfig(max_num_steps=ws.sft_steps, seed=cfg.grpo.seed + SEED_OFFSET),
        "checkpointing": cfg.checkpointing.model_copy(update={"enabled": True, "save_period": ws.sft_steps, "save_optimizer": False}),
    })
    return base.model_dump(mode="json", exclude={"loss_fn", "dpo"})


def run_sft_warm_start(config: Any, run_id: str, *, steps: int, storage: str, lr: float | None = None) -> str:
    """An SFT run ``run_id`` as GRPO config ``config``'s warm start would train it (``steps``
    steps, learning rate ``lr``), outside a GRPO run (benchmarks share one); its final weights."""
    overrides = [f"warm_start.sft_steps={steps}", *([f"warm_start.lr={lr}"] if lr is not None else [])]
    cfg = resolve_config(config, overrides, storage)
    sft(config=warm_start_config(cfg), run_id=run_id, storage=cfg.storage.root)
    return join_uri(RunLayout(cfg.storage.root, run_id).checkpoint_uri(steps), "weights")


def ensure_warm_start(cfg: MasterConfig, run_id: str, log: Any) -> MasterConfig:
    """Run the warm-start SFT unless its checkpoint is committed; return the GRPO config on its weights."""
    if not cfg.warm_start.sft_steps:
        return cfg
    weights = warm_start_weights(cfg, run_id)
    ck_uri = weights.rsplit("/", 1)[0]
    opts = cfg.storage.storage_options or None
    if is_checkpoint_committed(ck_uri, opts):
        if cfg.policy.model_name != weights:
            log.info("warm start: reusing %s", ck_uri)
        return with_warm_start_weights(cfg, run_id)
    sid = warm_start_run_id(run_id)
    # an SFT run killed midway (its config is saved) resumes where it stopped
    resume = fs.exists(RunLayout(cfg.storage.root, sid).config_uri, storage_options=opts)
    if cfg.policy.model_name == weights and not resume:  # the run's saved config names weights never trained
        raise ValueError(
            f"run {run_id!r} was stopped before its warm start's SFT run {sid!r} began, and its saved config "
            f"names only the weights that run would make ({weights}): start it again with its original config"
        )
    log.info("warm start: %d SFT steps (run %s%s)", cfg.warm_start.sft_steps, sid, ", resumed" if resume else "")
    out = sft(  # its own run session: lease, status, and a local Ray it starts is stopped at its end
        config=None if resume else warm_start_config(cfg), run_id=sid, resume=resume, storage=cfg.storage.root,
    )
    last = out["final_metrics"] or {}
    log.info("warm start: SFT loss %s at step %s; GRPO starts from %s", last.get("loss"), last.get("step"), weights)
    return with_warm_start_weights(cfg, run_id)
