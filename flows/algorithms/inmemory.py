"""The same GRPO steps as the flow, as a plain Python loop with batches kept in memory.

No Prefect, no persistence: the baseline of ``benchmarks/bench_pipeline.py``, and the proof that
the flow is this algorithm: with the same config and seed it ends with bit-identical weights to
the flow (``tests/flows/test_dataflow.py``, in ``make test``).
It calls the same stage functions (``build_prompt_batch``, ``rollouts_from_generation``,
``compute_rewards``, ``compute_logprobs``, ``compute_advantages``, ``build_train_data``,
``run_train``, ``refit_weights``) on the same kind of actors.
"""

from __future__ import annotations

import time
from typing import Any

from flows.config import MasterConfig
from nrl_tasks.stages.advantages import compute_advantages
from nrl_tasks.stages.generate import build_prompt_batch, generation_input, rollouts_from_generation
from nrl_tasks.stages.logprob import compute_logprobs, reference_needed
from nrl_tasks.stages.refit import refit_weights
from nrl_tasks.stages.score import compute_rewards
from nrl_tasks.stages.train import build_train_data, run_train

__all__ = ["run_in_memory"]


def run_in_memory(rt: Any, cfg: MasterConfig, num_steps: int, records: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Run ``num_steps`` GRPO steps on the runtime's actors; per-step seconds of each stage."""

    out = []
    for step in range(1, num_steps + 1):
        v = step - 1
        row: dict[str, Any] = {"step": step}
        t_step = time.perf_counter()
        t = time.perf_counter()
        pb = build_prompt_batch(
            records, step=step, num_prompts=cfg.grpo.num_prompts_per_step,
            num_generations=cfg.grpo.num_generations_per_prompt, seed=cfg.grpo.seed, data_cfg=cfg.data,
            tokenizer=rt.tokenizer, max_prompt_tokens=cfg.max_prompt_tokens(),
        )
        row["prompts_s"] = time.perf_counter() - t
        t = time.perf_counter()
        gen_out = rt.generation.generate(generation_input(pb), greedy=False, weights_version=v)
        rollouts = rollouts_from_generation(pb, gen_out, rt.tokenizer)
        row["generate_s"] = time.perf_counter() - t
        t = time.perf_counter()
        rewards, valid, _ = compute_rewards(rollouts, cfg.env, rt.reward_model)
        row["score_s"] = time.perf_counter() - t
        t = time.perf_counter()
        lp = compute_logprobs(rt.policy, rollouts, need_reference=reference_needed(cfg))
        row["logprob_s"] = time.perf_counter() - t
        t = time.perf_counter()
        adv = compute_advantages(rollouts["group_id"], rewards, valid, cfg.grpo)
        row["advantages_s"] = time.perf_counter() - t
        t = time.perf_counter()
        metrics = run_train(
            rt.policy, build_train_data(rollouts, lp, adv), cfg.loss_fn,
            gbs=cfg.policy.train_global_batch_size, mbs=cfg.policy.train_micro_batch_size,
        )
        row["train_s"] = time.perf_counter() - t
        t = time.perf_counter()
        refit_weights(rt.policy, rt.generation, step, timeout_s=cfg.grpo.refit.timeout_s)
        row["refit_s"] = time.perf_counter() - t
        row["step_s"] = time.perf_counter() - t_step
        row["reward_mean"] = float(rewards[valid].mean()) if bool(valid.any()) else None
        row["loss"] = metrics.get("loss")
        out.append(row)
    return out
