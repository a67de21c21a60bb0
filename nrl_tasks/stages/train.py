"""``train`` stage: one GRPO policy update from the persisted rollouts, logprobs and advantages.

The train input is assembled only from committed datasets, so the same step can be *replayed*
bit-identically after a restore from checkpoint (:func:`replay_train`; training is
deterministic). The output dataset (``steps/step_N/train``) is one row of scalar metrics;
its manifest marks the step trained and records ``weights_version`` (= N after the update)
and, when enabled, the policy's ``weights_checksum`` after the update, which replays verify.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.common import TASK_DEFAULTS, StageTimer, committed, save_output, stage_meta, stage_task
from nrl_tasks.stages.faults import arm_actor_kill, fault_point
from nrl_tasks.stages.recovery import STAGE_RETRY, ensure_policy, stage_attempts

__all__ = ["build_train_data", "replay_train", "run_train", "train", "train_metrics"]

TRAIN_INPUT_STAGES = ("rollouts", "logprobs", "advantages")


def build_train_data(rollouts: BatchedDataDict, logprobs: BatchedDataDict, adv: BatchedDataDict) -> BatchedDataDict:
    """The ``ClippedPGLossFn`` input: ``input_ids, input_lengths, token_mask, sample_mask,
    advantages [B,S], prev_logprobs, generation_logprobs, reference_policy_logprobs``."""
    token_mask = rollouts["token_mask"].to(torch.float32)
    return BatchedDataDict(
        {
            "input_ids": rollouts["input_ids"],
            "input_lengths": rollouts["input_lengths"],
            "token_mask": token_mask,
            "sample_mask": adv["sample_mask"].to(torch.float32),
            "advantages": adv["advantages"].to(torch.float32).unsqueeze(1) * token_mask,
            "prev_logprobs": logprobs["prev_logprobs"].to(torch.float32),
            "generation_logprobs": rollouts["generation_logprobs"].to(torch.float32),
            "reference_policy_logprobs": logprobs["reference_policy_logprobs"].to(torch.float32),
        }
    )


def _scalar(v: Any) -> float | None:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().mean()) if v.numel() else None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return None


def train_metrics(result: dict[str, Any]) -> dict[str, float]:
    """Scalar metrics of a ``Policy.train`` result (``all_mb_metrics`` averaged per key)."""
    out: dict[str, float] = {}
    for k, v in result.items():
        s = _scalar(v)
        if s is not None:
            out[k] = s
    mb = result.get("all_mb_metrics")
    if isinstance(mb, dict):
        for k, vals in mb.items():
            vals = [x for x in (map(_scalar, vals if isinstance(vals, list) else [vals])) if x is not None]
            if vals and k not in out:
                out[k] = sum(vals) / len(vals)
    elif isinstance(mb, list):
        keys = {k for d in mb if isinstance(d, dict) for k in d}
        for k in keys:
            vals = [s for d in mb if isinstance(d, dict) and (s := _scalar(d.get(k))) is not None]
            if vals and k not in out:
                out[k] = sum(vals) / len(vals)
    return out


def run_train(policy: Any, data: BatchedDataDict, loss_cfg: Any, *, gbs: int, mbs: int) -> dict[str, float]:
    """One ``Policy.train`` call with ``ClippedPGLossFn(loss_cfg)``; scalar metrics."""
    from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn

    result = policy.train(data, ClippedPGLossFn(loss_cfg), gbs=gbs, mbs=mbs)
    return train_metrics(result)


def _load_inputs(rt: Any, step: int) -> BatchedDataDict:
    import storage

    parts = [storage.load_batch(rt.layout.stage_uri(step, s), **rt.storage_kw) for s in TRAIN_INPUT_STAGES]
    return build_train_data(*parts)


def _check_version(policy: Any, step: int) -> None:
    """``Policy.train`` bumps the version once per (non-eval) call: after step N it must be N."""
    if policy.weights_version != step:
        raise RuntimeError(f"after train of step {step} the policy reports weights version {policy.weights_version}")


def replay_train(rt: Any, cfg: Any, step: int) -> dict[str, Any]:
    """Re-run the committed ``train`` of ``step`` from its persisted inputs (after a restore).

    Verifies the recorded weights checksum when there is one; raises ``RuntimeError`` if the
    replay does not reproduce it (training not deterministic) or the inputs are missing.
    """
    import storage

    uri = rt.layout.stage_uri(step, "train")
    manifest = storage.read_manifest(uri, **rt.storage_kw)
    meta = stage_meta(manifest)
    data = _load_inputs(rt, step)
    run_train(rt.policy, data, cfg.loss_fn, gbs=cfg.policy.train_global_batch_size, mbs=cfg.policy.train_micro_batch_size)
    _check_version(rt.policy, step)
    expected = meta.get("weights_checksum")
    if expected:
        got = rt.policy.weights_checksum()
        if got != expected:
            raise RuntimeError(
                f"replay of train step {step} gave weights checksum {got}, the run recorded {expected}: "
                "training is not deterministic (or the persisted inputs changed)"
            )
    return {"step": step, "replayed": True}


@stage_task(name="train", task_run_name="train-{run_id}-step{step}", **TASK_DEFAULTS, **STAGE_RETRY)
def train(cfg: Any, run_id: str, step: int) -> dict[str, Any]:
    """One policy update on the step's batch; persist its metrics as ``train`` (marks the step trained).

    Expects the policy at weights version ``step - 1`` and leaves it at ``step``. Retried on actor
    faults: a dead or stuck worker group is re-created, the last checkpoint restored and the
    ``train`` stages after it replayed from their persisted batches before this step trains.
    """
    from flows.runtime import get_runtime

    rt = get_runtime(cfg, run_id)
    uri = rt.layout.stage_uri(step, "train")
    if (done := committed(uri, rt.storage_options)) is not None:
        return {**done, "attempts": stage_attempts(skipped=True)}
    fault_point("train", step, "before")
    timer = StageTimer()
    with timer.phase("recover"):
        recovery = ensure_policy(rt, cfg, step - 1)
    with timer.phase("load"):
        data = _load_inputs(rt, step)
    arm_actor_kill("policy", "train", step, rt.policy.worker_group.workers)
    with timer.phase("train"):
        metrics = run_train(
            rt.policy, data, cfg.loss_fn, gbs=cfg.policy.train_global_batch_size, mbs=cfg.policy.train_micro_batch_size
        )
    _check_version(rt.policy, step)
    fault_point("train", step, "during")
    checksum = rt.policy.weights_checksum() if cfg.logger.weights_checksum else None
    tokens = int(data["input_lengths"].sum())
    row = {k: torch.tensor([v], dtype=torch.float64) for k, v in metrics.items() if math.isfinite(v)}
    row["step"] = torch.tensor([step], dtype=torch.int64)
    res = save_output(
        BatchedDataDict(row), uri, run_id=run_id, step=step, stage="train", weights_version=step,
        storage_options=rt.storage_options, fsync=cfg.storage.fsync, seconds=timer.total(), train_seconds=timer.seconds["train"],
        tokens_per_s=tokens / max(timer.seconds["train"], 1e-9), weights_checksum=checksum,
        loss=metrics.get("loss"), grad_norm=metrics.get("grad_norm"),
        recovered=recovery["restored_from"] != "live", replayed=",".join(map(str, recovery.get("replayed", []))),
    )
    fault_point("train", step, "after")
    return {**res, "attempts": stage_attempts()}
