"""``generate`` stage: draw the step's prompts (persisted as ``prompts``), sample the rollouts.

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

from typing import Any

import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.common import TASK_DEFAULTS, StageTimer, committed, save_output, stage_task
from nrl_tasks.stages.data import derive_seed, format_prompt, step_record_indices, tokenize_prompts
from nrl_tasks.stages.faults import arm_actor_kill, fault_point
from nrl_tasks.stages.recovery import STAGE_RETRY, ensure_generation, stage_attempts

__all__ = [
    "build_prompt_batch",
    "decode_responses",
    "ensure_prompts",
    "generate",
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
    data_cfg: Any,
    tokenizer: Any,
    max_prompt_tokens: int,
    seed_stage: str = "generate",
) -> BatchedDataDict:
    """The step's prompt batch, each prompt repeated ``num_generations`` times (adjacent)."""
    idx = step_record_indices(
        num_records=len(records), step=step, num_prompts=num_prompts, seed=seed, shuffle=data_cfg.shuffle
    )
    chosen = [records[i] for i in idx]
    texts = [format_prompt(r["prompt"], data_cfg, tokenizer) for r in chosen]
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


def ensure_prompts(cfg: Any, rt: Any, step: int) -> dict[str, Any]:
    """Draw and tokenise the step's prompts and persist them as ``prompts`` (idempotent).

    Runs inside the ``generate`` task (one Prefect task less per step); its dataset is still
    the record of what the step was asked."""
    uri = rt.layout.stage_uri(step, "prompts")
    if (done := committed(uri, rt.storage_options)) is not None:
        return done
    fault_point("prompts", step, "before")
    timer = StageTimer()
    batch = build_prompt_batch(
        rt.train_records(),
        step=step,
        num_prompts=cfg.grpo.num_prompts_per_step,
        num_generations=cfg.grpo.num_generations_per_prompt,
        seed=cfg.grpo.seed,
        data_cfg=cfg.data,
        tokenizer=rt.tokenizer,
        max_prompt_tokens=cfg.max_prompt_tokens(),
    )
    fault_point("prompts", step, "during")
    out = save_output(
        batch, uri, run_id=rt.run_id, step=step, stage="prompts", weights_version=None,
        storage_options=rt.storage_options, fsync=cfg.storage.fsync, seconds=timer.total(),
    )
    fault_point("prompts", step, "after")
    out["batch"] = batch
    return out


@stage_task(name="prompts", task_run_name="prompts-{run_id}-step{step}", **TASK_DEFAULTS)
def prompts(cfg: Any, run_id: str, step: int) -> dict[str, Any]:
    """The ``prompts`` dataset of a step as its own task (the flow lets ``generate`` do it)."""
    from flows.runtime import get_runtime

    out = ensure_prompts(cfg, get_runtime(cfg, run_id), step)
    out.pop("batch", None)
    return out


@stage_task(name="generate", task_run_name="generate-{run_id}-step{step}", **TASK_DEFAULTS, **STAGE_RETRY)
def generate(cfg: Any, run_id: str, step: int, weights_version: int) -> dict[str, Any]:
    """Sample ``num_generations`` responses per prompt on weights ``weights_version``; persist ``rollouts``.

    Retried on actor faults: dead or stuck generation workers are re-created and fully refitted
    to ``weights_version`` first; the per-sample seeds come from the persisted prompts, so the
    regenerated rollouts are the ones the first attempt would have produced.
    """
    import storage
    from flows.runtime import get_runtime

    rt = get_runtime(cfg, run_id)
    uri = rt.layout.stage_uri(step, "rollouts")
    if (done := committed(uri, rt.storage_options)) is not None:
        return {**done, "attempts": stage_attempts(skipped=True)}
    fault_point("generate", step, "before")
    timer = StageTimer()
    with timer.phase("recover"):
        recovery = ensure_generation(rt, cfg, weights_version)
    with timer.phase("load"):
        pm = ensure_prompts(cfg, rt, step)
        prompt_batch = pm.pop("batch", None)
        if prompt_batch is None:
            prompt_batch = storage.load_batch(rt.layout.stage_uri(step, "prompts"), **rt.storage_kw)
    arm_actor_kill("generation", "generate", step, rt.generation.workers)
    with timer.phase("generate"):
        gen_out = rt.generation.generate(generation_input(prompt_batch), greedy=False, weights_version=weights_version)
    fault_point("generate", step, "during")
    rollouts = rollouts_from_generation(prompt_batch, gen_out, rt.tokenizer)
    new_tokens = int(rollouts["generation_lengths"].sum())
    gen_s = timer.seconds["generate"]
    out = save_output(
        rollouts, uri, run_id=run_id, step=step, stage="rollouts", weights_version=weights_version,
        storage_options=rt.storage_options, fsync=cfg.storage.fsync, seconds=timer.total(), generate_seconds=gen_s,
        new_tokens=new_tokens, tokens_per_s=new_tokens / max(gen_s, 1e-9), prompts_seconds=pm.get("seconds"),
        truncated_frac=float(rollouts["truncated"].float().mean()),
        recovered=bool(recovery["recreated"] or recovery["refit"]),
    )
    fault_point("generate", step, "after")
    return {**out, "attempts": stage_attempts()}
