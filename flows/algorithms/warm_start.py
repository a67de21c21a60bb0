"""The warm start a GRPO run can run itself: a short SFT, then GRPO from its weights.

A tiny model from scratch is almost never right, so GRPO on it sees reward 0 everywhere and
learns nothing; ``make demo`` always warm-started it with :mod:`flows.algorithms.sft`. With
``warm_start.sft_steps: N`` in the config the ``grpo`` flow does the same by itself (so the
``grpo-train`` deployment's default run learns visibly):

1. the SFT is its own run, ``<run_id>-sft`` under the same storage root (a subflow run ``sft-…``
   of the GRPO flow run), checkpointed at step ``N``; it trains full weights even when the GRPO
   run has LoRA on (``policy.dtensor_cfg.lora_cfg``), whose adapters then sit on the SFT weights;
2. the GRPO run's ``policy.model_name`` becomes that checkpoint's weights, and its saved
   ``config.yaml`` records them (with the ``warm_start`` section, which the config hash counts).

Idempotent: a committed warm-start checkpoint is reused, so a retried or resumed flow (its
``config`` still names the base model) maps to the same weights and the same config hash without
training again; a config whose ``policy.model_name`` already is the run's warm-start weights (the
saved ``config.yaml`` of a resume) is used as it is.

The SFT is a run of its own (:mod:`flows.run.session`: its lease refuses a second writer, its
``status.json`` says how it ended); it starts (and stops) a local Ray of its own when none is
connected, so the GRPO run's Ray is started in the run's namespace as without a warm start.
"""

from __future__ import annotations

from typing import Any

from flows.config import MasterConfig
from nrl_tasks.run_layout import RunLayout, join_uri

__all__ = ["ensure_warm_start", "warm_start_run_id", "warm_start_weights", "with_warm_start_weights"]


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


def ensure_warm_start(cfg: MasterConfig, run_id: str, log: Any) -> MasterConfig:
    """Run the warm-start SFT unless its checkpoint is committed; return the GRPO config on its weights."""
    if not cfg.warm_start.sft_steps:
        return cfg
    from nrl_tasks.stages.checkpoint import is_checkpoint_committed

    weights = warm_start_weights(cfg, run_id)
    if cfg.policy.model_name == weights:
        return cfg  # the run's saved config (a resume)
    ck_uri = weights.rsplit("/", 1)[0]
    opts = cfg.storage.storage_options or None
    if is_checkpoint_committed(ck_uri, opts):
        log.info("warm start: reusing %s", ck_uri)
        return with_warm_start_weights(cfg, run_id)
    from flows.algorithms.sft import sft

    ws = cfg.warm_start
    log.info("warm start: %d SFT steps from %s (run %s)", ws.sft_steps, cfg.policy.model_name, warm_start_run_id(run_id))
    # the SFT run's own config has no warm start, and trains full weights: with LoRA on, GRPO then
    # adapts the warm-started model (the adapters' base), as it would adapt any base model
    policy = cfg.policy
    if policy.dtensor_cfg.lora_cfg.enabled:
        dt = policy.dtensor_cfg.model_copy(update={"lora_cfg": type(policy.dtensor_cfg.lora_cfg)()})
        policy = policy.model_copy(update={"dtensor_cfg": dt})
    base = cfg.model_copy(update={"warm_start": type(ws)(), "policy": policy})
    out = sft(  # its own run session: lease, status, and a local Ray it starts is stopped at its end
        config=base.model_dump(mode="json"), run_id=warm_start_run_id(run_id), num_steps=ws.sft_steps,
        batch_size=ws.batch_size, storage=cfg.storage.root, lr=ws.lr,
    )
    log.info("warm start: SFT loss %.4f -> %.4f; GRPO starts from %s", out["losses"][0], out["losses"][-1], out["weights"])
    return with_warm_start_weights(cfg, run_id)
