"""``evaluate`` stage: generation + scoring on held-out prompts (validation and checkpoint evals).

For each prompt: one greedy response (``accuracy`` = mean greedy reward) and, with
``num_samples = k > 0``, ``k`` sampled responses (per-request seeds from
``(seed, step, "eval", i)``): ``pass@k`` = fraction of prompts with at least one sample whose
reward is > 0 (for a 0/1 reward exactly "solved by one of k samples") and ``sample_reward_mean``.

Output columns (one row per response): ``mode`` ("greedy" | "sample"), ``record_index``,
``sample_index``, ``prompt``, ``answer``, ``response``, ``reward`` (float32), ``reward_valid``
(bool), ``generation_length``.

With a multi-turn environment (``env.environment``) each response is a whole episode, run by the
training rollout's :class:`~nrl_tasks.stages.multi_turn.MultiTurnRollout` (greedy: every turn
greedy) on the environment's actors: ``reward`` is its reward summed over turns,
``generation_length`` counts the tokens the model wrote (every turn), and the rows also hold
``num_turns`` and the conversation (``message_log``); the summary gains ``turns_mean``.

A checkpoint's evaluation (``nrl eval``, the sweep, a pipeline's eval stage) scores with the
task's own reward (``env.reward_fn``, else exact match against the answers), also for a run
scored by a reward model (``env.reward_model``): that model is the run's training signal and its
validation's score, not a held-out measure of it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from prefect import task

import storage
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster
from nrl_tasks.models.generation.hf_generation import HfGeneration
from nrl_tasks.run_layout import RunLayout, join_uri, parse_step_dir
from nrl_tasks.stages.checkpoint import is_checkpoint_committed, local_checkpoint_dir, read_checkpoint_info
from nrl_tasks.stages.context import StepContext
from nrl_tasks.stages.data import format_prompt, tokenize_prompts
from nrl_tasks.stages.generate import generation_input, rollouts_from_generation, sample_seeds
from nrl_tasks.stages.holds import claim_checkpoint, is_deleting
from nrl_tasks.stages.multi_turn import first_turns
from nrl_tasks.stages.refs import ActionResult, DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, StageTimer, committed_ref, run_stage, save_output
from nrl_tasks.stages.score import compute_rewards
from storage import fs

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nrl_tasks.config.data import DataConfig, EnvConfig
    from nrl_tasks.config.master import MasterConfig
    from nrl_tasks.models.generation.interfaces import GenerationInterface
    from nrl_tasks.models.policy.interfaces import PolicyInterface
    from nrl_tasks.stages.multi_turn import MultiTurnRollout

__all__ = ["CheckpointVanishedError", "evaluate", "evaluate_records", "summarize_eval", "validate"]


def _prompt_batch(records: list[dict[str, str]], data_cfg: DataConfig, tokenizer: Any, max_prompt_tokens: int, repeats: int) -> BatchedDataDict:
    texts = [format_prompt(r["prompt"], data_cfg, tokenizer, max_tokens=max_prompt_tokens) for r in records]
    ids, lengths = tokenize_prompts(texts, tokenizer, max_length=max_prompt_tokens, overlong=data_cfg.overlong_prompts)
    batch = BatchedDataDict(
        {
            "input_ids": ids,
            "input_lengths": lengths,
            "record_index": torch.arange(len(records), dtype=torch.int64),
            "group_id": torch.arange(len(records), dtype=torch.int64),
            "prompt": texts,
            "answer": [r["answer"] for r in records],
        }
    )
    return batch.repeat_interleave(repeats) if repeats > 1 else batch


def evaluate_records(
    generation: GenerationInterface,
    tokenizer: Any,
    records: list[dict[str, str]],
    *,
    data_cfg: DataConfig,
    env_cfg: EnvConfig,
    max_prompt_tokens: int,
    seed: int,
    step: int,
    num_samples: int = 0,
    weights_version: int | None = None,
    batch_size: int = 64,
    reward_model: PolicyInterface | None = None,
    episodes: MultiTurnRollout | None = None,
) -> BatchedDataDict:
    """Greedy (and ``num_samples`` sampled) responses of ``records`` with their rewards;
    ``episodes``: the multi-turn runner (:func:`~nrl_tasks.stages.multi_turn.episode_runner`),
    needed when ``env_cfg.environment`` is set."""
    if env_cfg.environment is not None and episodes is None:
        raise ValueError(f"evaluating env.environment {env_cfg.environment!r} needs its episode runner (its actors)")

    parts: list[BatchedDataDict] = []
    for mode, repeats, greedy in (("greedy", 1, True), ("sample", num_samples, False)):
        if repeats <= 0:
            continue
        pb = _prompt_batch(records, data_cfg, tokenizer, max_prompt_tokens, repeats)
        pb["seeds"] = sample_seeds(seed, step, f"eval-{mode}", pb.size)
        for start in range(0, pb.size, batch_size):
            chunk = pb.slice(start, min(pb.size, start + batch_size))
            extra: dict[str, Any] = {}
            if episodes is not None:  # whole episodes: the environment's rewards, the model's tokens of every turn
                roll = episodes.run(chunk, *first_turns(records, chunk, data_cfg), weights_version, greedy=greedy)
                rewards, valid = roll["env_rewards"], torch.ones(roll.size, dtype=torch.bool)
                length = roll["token_mask"].sum(dim=1).to(torch.int64)
                extra = {"num_turns": roll["num_turns"], "message_log": list(roll["message_log"])}
            else:
                out = generation.generate(generation_input(chunk), greedy=greedy, weights_version=weights_version)
                roll = rollouts_from_generation(chunk, out, tokenizer)
                rewards, valid, _ = compute_rewards(roll, env_cfg, reward_model)
                length = roll["generation_lengths"]
            n = roll.size
            parts.append(
                BatchedDataDict(
                    {
                        "mode": [mode] * n,
                        "record_index": chunk["record_index"],
                        "sample_index": (torch.arange(start, start + n) % max(repeats, 1)).to(torch.int64),
                        "prompt": list(roll["prompt"]),
                        "answer": list(roll["answer"]),
                        "response": list(roll["response"]),
                        "reward": rewards.to(torch.float32),
                        "reward_valid": valid.to(torch.bool),
                        "generation_length": length,
                        **extra,
                    }
                )
            )
    if not parts:
        raise ValueError("nothing to evaluate: no records")
    return BatchedDataDict.from_batches(parts)


def summarize_eval(samples: BatchedDataDict) -> dict[str, float]:
    """``accuracy`` (greedy), ``pass_at_k``, ``sample_reward_mean``, ``num_prompts``, ``k``; with
    multi-turn episodes also ``turns_mean`` (over every episode)."""
    modes = list(samples["mode"])
    reward = samples["reward"].to(torch.float32)
    valid = samples["reward_valid"].to(torch.bool)
    rec = samples["record_index"]
    out: dict[str, float] = {}
    g = torch.tensor([m == "greedy" for m in modes])
    s = ~g
    if bool(g.any()):
        out["accuracy"] = float((reward[g] * valid[g]).mean())
        out["num_prompts"] = int(g.sum())
    if bool(s.any()):
        solved: dict[int, bool] = {}
        for r, v, ok in zip(rec[s].tolist(), reward[s].tolist(), valid[s].tolist()):
            solved[r] = solved.get(r, False) or (ok and v > 0)
        out["pass_at_k"] = sum(solved.values()) / len(solved)
        out["k"] = int(s.sum()) // max(len(solved), 1)
        out["sample_reward_mean"] = float((reward[s] * valid[s]).mean())
    if "num_turns" in samples:
        out["turns_mean"] = float(samples["num_turns"].to(torch.float64).mean())
    return out


@task(name="validate", task_run_name="validate-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def validate(ctx: StepContext, refit: ActionResult | None, weights_version: int) -> DatasetRef:
    """Greedy evaluation on the validation prompts with the generation workers at
    ``weights_version`` (the ``refit`` result that brought them there; ``None`` before training);
    persist ``val`` under the step (``step`` 0: before training)."""
    cfg = ctx.cfg

    def compute(_: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        records = ctx.run.records("val")[: cfg.rollout.max_val_samples]
        ctx.actor_call("validate", "generation", ctx.generation.workers)
        episodes = None
        if cfg.env.environment is not None:
            from nrl_tasks.stages.multi_turn import episode_runner

            episodes = episode_runner(cfg, ctx.tokenizer, ctx.generation, ctx.run.actors.environment)
        samples = evaluate_records(
            ctx.generation, ctx.tokenizer, records, data_cfg=cfg.data, env_cfg=cfg.env,
            max_prompt_tokens=cfg.max_prompt_tokens(), seed=cfg.rollout.seed, step=ctx.step, num_samples=0,
            weights_version=weights_version, batch_size=cfg.rollout.val_batch_size, reward_model=ctx.run.reward_model,
            episodes=episodes,
        )
        summary = summarize_eval(samples)
        figures = {"val_accuracy": summary.get("accuracy"), "val_num_prompts": summary.get("num_prompts")}
        if "turns_mean" in summary:
            figures["val_turns_mean"] = summary["turns_mean"]
        return samples, figures

    return run_stage(ctx, "validate", compute, output="val", weights_version=weights_version)


def _eval_key(dataset: str | None) -> str:
    """Sub-folder of an evaluation: ``val`` (the run's held-out split) or a hash of the dataset path."""
    if not dataset:
        return "val"
    import hashlib

    stem = dataset.rstrip("/").rsplit("/", 1)[-1].split(".", 1)[0]
    slug = "".join(c if c.isalnum() or c in "-_" else "-" for c in stem)[:40] or "data"
    return f"{slug}-{hashlib.sha256(dataset.encode()).hexdigest()[:8]}"


class CheckpointVanishedError(FileNotFoundError):
    """The checkpoint to evaluate is gone (deleted before or during its evaluation)."""


def _vanished(checkpoint: str, reason: str) -> dict[str, Any]:
    return {"checkpoint": checkpoint, "skipped": True, "vanished": True, "reason": reason}


@task(name="evaluate", task_run_name="evaluate-{run_id}-{checkpoint}", **TASK_DEFAULTS)
def evaluate(
    cfg: MasterConfig,
    run_id: str,
    checkpoint: str,
    records: list[dict[str, str]],
    *,
    dataset: str | None = None,
    num_samples: int = 4,
) -> dict[str, Any]:
    """Evaluate one committed checkpoint: fresh generation workers load its weights, answer
    ``records`` greedily and with ``num_samples`` samples, rewards are scored; the samples are
    persisted at ``<run>/evals/<checkpoint>/<dataset-key>/`` with the summary in the manifest.
    Idempotent: a committed evaluation is returned as is. Ray must be connected (the flow does it).

    The evaluation claims the checkpoint first (:func:`~nrl_tasks.stages.holds.claim_checkpoint`:
    retention keeps it meanwhile, and a concurrent evaluation of it on the same dataset is not
    started twice). Returns ``busy: True`` when another live evaluation holds the claim, and
    ``vanished: True`` (with ``reason``) when the checkpoint is gone before or during its
    evaluation, instead of raising."""

    opts = cfg.storage.storage_options or None
    layout = RunLayout(cfg.storage.root, run_id)
    key = _eval_key(dataset)
    uri = join_uri(layout.eval_uri(checkpoint), key)
    if (done := committed_ref(uri, opts)) is not None:
        return {**done.summary(), "checkpoint": checkpoint, "skipped": True}
    ck_uri = join_uri(layout.checkpoints_uri, checkpoint)
    if not is_checkpoint_committed(ck_uri, opts):
        return _vanished(checkpoint, f"{ck_uri} has no committed checkpoint")
    claim = claim_checkpoint(layout, checkpoint, key, opts)
    if claim is None:
        return {"checkpoint": checkpoint, "skipped": True, "busy": True}
    with claim:
        if (done := committed_ref(uri, opts)) is not None:  # finished by another while we claimed
            return {**done.summary(), "checkpoint": checkpoint, "skipped": True}
        # the claim is written: from here retention keeps the checkpoint, unless it was already at it
        if is_deleting(layout, checkpoint, opts) or not is_checkpoint_committed(ck_uri, opts):
            return _vanished(checkpoint, f"{ck_uri} is being deleted")
        try:
            return _evaluate_claimed(cfg, run_id, checkpoint, records, ck_uri, uri, dataset, num_samples, claim.holder)
        except Exception as exc:  # noqa: BLE001 - whatever the loader raises when the files go
            if _checkpoint_intact(ck_uri, opts):
                raise
            return _vanished(checkpoint, f"{ck_uri} disappeared during its evaluation ({type(exc).__name__}: {exc})")


def _checkpoint_intact(ck_uri: str, opts: dict[str, Any] | None) -> bool:
    """Committed, and (on local disk) its ``weights/`` still there."""

    if not is_checkpoint_committed(ck_uri, opts):
        return False
    return not fs.is_local(ck_uri) or fs.exists(join_uri(ck_uri, "weights"), storage_options=opts)


def _evaluate_claimed(
    cfg: MasterConfig, run_id: str, checkpoint: str, records: list[dict[str, str]], ck_uri: str, uri: str,
    dataset: str | None, num_samples: int, holder: str,
) -> dict[str, Any]:
    import shutil

    opts = cfg.storage.storage_options or None
    layout = RunLayout(cfg.storage.root, run_id)
    timer = StageTimer()
    info = read_checkpoint_info(ck_uri, opts)
    local, temporary = local_checkpoint_dir(ck_uri, opts)
    gen_cfg = cfg.gen.model_copy(update={"model_name": os.path.join(local, "weights")})
    ns = layout.namespace + "-eval"
    tag = holder.rsplit("-", 1)[-1]  # per evaluation: concurrent evaluations never share Ray actors
    cluster = RayVirtualCluster(
        [gen_cfg.num_workers], name=f"{run_id}-eval-{checkpoint}-{tag}", namespace=ns,
        num_cpus_per_bundle=gen_cfg.num_cpus_per_worker,
    )
    gen = env = None
    try:
        gen = HfGeneration(cluster, gen_cfg, name_prefix=f"eval-{checkpoint}-{tag}", namespace=ns)
        from transformers import AutoTokenizer

        tok_dir = os.path.join(local, "tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(tok_dir if os.path.isdir(tok_dir) else os.path.join(local, "weights"))
        episodes = None
        if cfg.env.environment is not None:  # the run's environment, on actors of this evaluation's own
            from nrl_tasks.environments.loading import EnvironmentWorkers
            from nrl_tasks.stages.multi_turn import episode_runner

            env = EnvironmentWorkers(
                cfg.env.environment, cfg.env.environment_kwargs, cfg.env.num_workers, namespace=ns,
                step_timeout_s=cfg.env.step_timeout_s,
            )
            episodes = episode_runner(cfg, tokenizer, gen, env)
        step = parse_step_dir(checkpoint) or 0
        # the task's own reward (env.reward_fn, else exact match), never a reward model the run
        # trained against: that one is its training signal (and its validation's score)
        env_cfg = cfg.env.model_copy(update={"reward_model": cfg.env.reward_model.model_copy(update={"enabled": False})})
        samples = evaluate_records(
            gen, tokenizer, records, data_cfg=cfg.data, env_cfg=env_cfg, max_prompt_tokens=cfg.max_prompt_tokens(),
            seed=cfg.rollout.seed, step=step, num_samples=num_samples, weights_version=None,
            batch_size=cfg.rollout.val_batch_size, episodes=episodes,
        )
    finally:
        if env is not None:
            env.shutdown()
        if gen is not None:
            gen.shutdown()
        cluster.shutdown()
        if temporary:
            shutil.rmtree(local, ignore_errors=True)
    summary = summarize_eval(samples)
    try:
        out = save_output(
            samples, uri, run_id=run_id, step=step, stage="eval", weights_version=info.get("weights_version"),
            storage_options=opts, seconds=timer.total(), checkpoint=checkpoint, dataset=dataset or "val",
            **{f"eval_{k}": v for k, v in summary.items()},
        )
    except storage.AlreadyCommittedError:  # committed by an evaluation that held no claim: keep that one
        done = committed_ref(uri, opts)
        assert done is not None
        return {**done.summary(), "checkpoint": checkpoint, "skipped": True}
    return {**out.summary(), "checkpoint": checkpoint, "skipped": False}
