"""``prompts`` and ``generate`` stages: draw the step's prompts, sample the rollouts.

Rollout batch columns (``B = num_prompts * num_generations``, rows of a group adjacent):

- ``input_ids [B, S]`` int64: prompt, response, then padding (what ``logprob``/``train`` read)
- ``input_lengths [B]``: prompt + response tokens; ``prompt_lengths [B]``; ``generation_lengths [B]``
- ``token_mask [B, S]`` float32: 1 on response tokens, 0 on prompt and padding
- ``generation_logprobs [B, S]`` float32: the sampler's logprobs at response positions
- ``truncated [B]`` bool; ``seeds [B]`` int64 (per-request sampling seeds)
- ``group_id [B]`` int64 (prompt index within the step), ``record_index [B]`` (dataset row)
- ``prompt``, ``response``, ``answer``: lists of str

Every draw is seeded from ``(seed, step, "generate", row)``, so regenerating a step with the
same weights gives the same rollouts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from prefect import task

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.context import StepContext
from nrl_tasks.stages.data import derive_seed, format_prompt, gen_batch_record_indices, step_record_indices, tokenize_prompts
from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, run_stage
from nrl_tasks.stages.schedule import StepSchedule

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nrl_tasks.config.data import DataConfig

__all__ = [
    "build_prompt_batch",
    "decode_responses",
    "generate",
    "generation_input",
    "prompts",
    "rollouts_from_generation",
    "sample_seeds",
]


def sample_seeds(seed: int, step: int, stage: str, num: int) -> torch.Tensor:
    """``[num]`` int64 per-request seeds derived from ``(seed, step, stage, i)``."""
    return torch.tensor([derive_seed(seed, step, stage, i) for i in range(num)], dtype=torch.int64)


def build_prompt_batch(
    records: list[dict[str, str]],
    *,
    step: int,
    num_prompts: int,
    num_generations: int,
    seed: int,
    data_cfg: DataConfig,
    tokenizer: Any,
    max_prompt_tokens: int,
    seed_stage: str = "generate",
    gen_batch: int | None = None,
) -> BatchedDataDict:
    """The step's prompt batch, each prompt repeated ``num_generations`` times (adjacent); with
    ``gen_batch`` the prompts of that generation batch of the step (dynamic sampling)."""
    if gen_batch is None:
        idx = step_record_indices(
            num_records=len(records), step=step, num_prompts=num_prompts, seed=seed, shuffle=data_cfg.shuffle
        )
    else:
        idx = gen_batch_record_indices(
            num_records=len(records), step=step, gen_batch=gen_batch, num_prompts=num_prompts, seed=seed,
            shuffle=data_cfg.shuffle,
        )
        seed_stage = seed_stage if gen_batch == 0 else f"{seed_stage}-gb{gen_batch}"
    chosen = [records[i] for i in idx]
    texts = [format_prompt(r["prompt"], data_cfg, tokenizer, max_tokens=max_prompt_tokens) for r in chosen]
    input_ids, lengths = tokenize_prompts(
        texts, tokenizer, max_length=max_prompt_tokens, overlong=data_cfg.overlong_prompts
    )
    batch = BatchedDataDict(
        {
            "input_ids": input_ids,
            "input_lengths": lengths,
            "group_id": torch.arange(num_prompts, dtype=torch.int64),
            "record_index": torch.tensor(idx, dtype=torch.int64),
            "prompt": texts,
            "answer": [r["answer"] for r in chosen],
        }
    )
    batch = batch.repeat_interleave(num_generations)
    batch["seeds"] = sample_seeds(seed, step, seed_stage, batch.size)
    return batch


def decode_responses(tokenizer: Any, input_ids: torch.Tensor, prompt_lengths: torch.Tensor, gen_lengths: torch.Tensor) -> list[str]:
    """Response text of each row (special tokens dropped)."""
    out = []
    for row, p, g in zip(input_ids.tolist(), prompt_lengths.tolist(), gen_lengths.tolist()):
        out.append(tokenizer.decode(row[p : p + g], skip_special_tokens=True))
    return out


def rollouts_from_generation(prompt_batch: BatchedDataDict, gen_out: Any, tokenizer: Any) -> BatchedDataDict:
    """Merge the prompt batch and a ``GenerationOutputSpec`` batch into the rollout batch."""
    output_ids = gen_out["output_ids"].to(torch.int64)
    prompt_lengths = prompt_batch["input_lengths"].to(torch.int64)
    gen_lengths = gen_out["generation_lengths"].to(torch.int64)
    total = gen_out["unpadded_sequence_lengths"].to(torch.int64)
    width = output_ids.shape[1]
    pos = torch.arange(width).unsqueeze(0)
    token_mask = ((pos >= prompt_lengths.unsqueeze(1)) & (pos < total.unsqueeze(1))).to(torch.float32)
    return BatchedDataDict(
        {
            "input_ids": output_ids,
            "input_lengths": total,
            "prompt_lengths": prompt_lengths,
            "generation_lengths": gen_lengths,
            "token_mask": token_mask,
            "generation_logprobs": gen_out["logprobs"].to(torch.float32) * token_mask,
            "truncated": gen_out["truncated"].to(torch.bool),
            "seeds": prompt_batch["seeds"],
            "group_id": prompt_batch["group_id"],
            "record_index": prompt_batch["record_index"],
            "prompt": list(prompt_batch["prompt"]),
            "answer": list(prompt_batch["answer"]),
            "response": decode_responses(tokenizer, output_ids, prompt_lengths, gen_lengths),
        }
    )


def generation_input(prompt_batch: BatchedDataDict) -> BatchedDataDict:
    """The ``GenerationDatumSpec`` part of a prompt batch."""
    return BatchedDataDict(
        {"input_ids": prompt_batch["input_ids"], "input_lengths": prompt_batch["input_lengths"], "seeds": prompt_batch["seeds"]}
    )


@task(name="prompts", task_run_name="prompts-{ctx.run_id}-{ctx.label}", **TASK_DEFAULTS)
def prompts(ctx: StepContext) -> DatasetRef:
    """Draw and tokenise the step's prompts from the run's train snapshot; persist ``prompts``.

    On a generation batch's context (dynamic sampling) it draws that batch's
    ``grpo.batch_multiplier * grpo.num_prompts_per_step`` prompts."""
    cfg = ctx.cfg
    multiplier = 1 if ctx.gen_batch is None else cfg.grpo.batch_multiplier

    def compute(_: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        batch = build_prompt_batch(
            ctx.run.records("train"),
            step=ctx.step,
            gen_batch=ctx.gen_batch,
            num_prompts=multiplier * cfg.rollout.num_prompts_per_step,
            num_generations=cfg.rollout.num_generations_per_prompt,
            seed=cfg.rollout.seed,
            data_cfg=cfg.data,
            tokenizer=ctx.tokenizer,
            max_prompt_tokens=cfg.max_prompt_tokens(),
        )
        return batch, {}

    return run_stage(ctx, "prompts", compute)


@task(name="generate", task_run_name="generate-{ctx.run_id}-{ctx.label}", **TASK_DEFAULTS)
def generate(ctx: StepContext, prompts: DatasetRef, weights_version: int) -> DatasetRef:
    """Sample ``num_generations`` responses per prompt on weights ``weights_version``; persist ``rollouts``.

    ``weights_version`` must be the step's scheduled version
    (:meth:`~nrl_tasks.stages.schedule.StepSchedule.generation_version`: ``step - 1``, or
    ``max(0, step - 1 - a)`` in async GRPO); another is refused with ``ValueError`` before
    anything runs. The generation workers must hold exactly that version (``StaleWeightsError``
    otherwise: an actor fault the flow recovers from with a full refit). The per-sample seeds
    come from the persisted prompts, so a regenerated step gives the rollouts the first attempt
    would have.
    """
    scheduled = StepSchedule.from_config(ctx.cfg).generation_version(ctx.step)
    if int(weights_version) != scheduled:
        raise ValueError(
            f"generate of step {ctx.step}: asked for weights version {weights_version}, the run's schedule generates "
            f"it on version {scheduled} (grpo.async_grpo.enabled / max_trajectory_age_steps)"
        )

    def compute(inputs: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        prompt_batch = inputs["prompts"]
        gen = ctx.generation
        ctx.actor_call("generate", "generation", gen.workers)
        if ctx.cfg.env.environment is not None:  # episodes: the environment answers each turn
            from nrl_tasks.stages.multi_turn import multi_turn_rollouts

            rollouts, figures = multi_turn_rollouts(ctx, prompt_batch, weights_version)
            gen_s = figures["generate_seconds"]
            return rollouts, {
                **figures, "tokens_per_s": figures["new_tokens"] / max(gen_s, 1e-9), "prompts_seconds": prompts.seconds,
                "truncated_frac": float(rollouts["truncated"].float().mean()),
            }
        with timer.phase("generate"):
            gen_out = gen.generate(generation_input(prompt_batch), greedy=False, weights_version=weights_version)
        rollouts = rollouts_from_generation(prompt_batch, gen_out, ctx.tokenizer)
        new_tokens = int(rollouts["generation_lengths"].sum())
        gen_s = timer.seconds["generate"]
        return rollouts, {
            "generate_seconds": gen_s, "new_tokens": new_tokens, "tokens_per_s": new_tokens / max(gen_s, 1e-9),
            "prompts_seconds": prompts.seconds, "truncated_frac": float(rollouts["truncated"].float().mean()),
        }

    return run_stage(ctx, "generate", compute, inputs={"prompts": prompts}, weights_version=weights_version)
