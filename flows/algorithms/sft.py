"""SFT warm start: supervised fine-tuning on (prompt, answer) pairs with ``NLLLossFn``.

``sft(config, run_id, num_steps)`` trains the configured policy on the prompt dataset's
reference answers (completion ``" " + answer + EOS``; only completion tokens count in the loss;
a record's multi-turn ``demonstration``, where it has one, instead: its assistant turns)
on the same Ray-hosted ``Policy``, then saves an HF-loadable checkpoint under
``<storage>/<run_id>/checkpoints/step_NNNNNN/weights``, which a GRPO run can start from
(``policy.model_name=<that folder>``). Each training step is a Prefect task; the draw of step
``k`` is deterministic (same scheme as GRPO, on a separate seed stream).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from prefect import flow, get_run_logger, task
from prefect.utilities.annotations import quote

from flows.config import MasterConfig
from flows.config.resolve import new_run_id, resolve_config
from flows.run.session import RunIntent, run_session, tag_this_flow_run
from nrl_tasks.run_layout import validate_run_id
from nrl_tasks.stages.context import RunContext
from nrl_tasks.stages.runner import TASK_DEFAULTS

__all__ = ["build_sft_batch", "sft"]


def build_sft_batch(records: list[dict[str, str]], tokenizer: Any, data_cfg: Any, max_len: int) -> Any:
    """``input_ids, input_lengths, token_mask, sample_mask`` for prompt + ``" answer"`` + EOS, or,
    for a record with a ``demonstration`` (a multi-turn episode's messages after the prompt, e.g.
    the calculator's tool call, result and answer), prompt + that episode with only its assistant
    turns in the loss (:func:`~nrl_tasks.stages.multi_turn.demonstration_tokens`); at most the
    last ``max_len`` tokens of a row."""
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
    from nrl_tasks.stages.data import clip_text, format_prompt, masked_batch
    from nrl_tasks.stages.multi_turn import demonstration_tokens

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    rows = []
    for r in records:
        p = tokenizer(format_prompt(r["prompt"], data_cfg, tokenizer, max_tokens=max_len), add_special_tokens=False)["input_ids"]
        if r.get("demonstration"):
            ids, mask = demonstration_tokens(
                tokenizer, p, r["demonstration"], chat_template=data_cfg.chat_template, eos_id=eos, max_tokens=max_len
            )
        else:  # texts cut by characters first: only the row's last max_len tokens are kept
            a = tokenizer(clip_text(" " + r["answer"], max_len, keep="tail"), add_special_tokens=False)["input_ids"] + [eos]
            ids, mask = p + a, [0.0] * len(p) + [1.0] * len(a)
        rows.append((ids[-max_len:], mask[-max_len:]))
    return BatchedDataDict({**masked_batch(rows, pad), "sample_mask": torch.ones(len(rows))})


@task(name="sft-train", task_run_name="sft-{run.run_id}-step{step}", **TASK_DEFAULTS)
def sft_step(run: RunContext, step: int, batch_size: int, seed: int) -> dict[str, float]:
    """One NLL update on the records of ``step``."""
    from nrl_tasks.algorithms.loss_functions import NLLLossFn
    from nrl_tasks.stages.data import step_record_indices
    from nrl_tasks.stages.train import train_metrics

    cfg = run.cfg
    recs = run.records("train")
    idx = step_record_indices(num_records=len(recs), step=step, num_prompts=batch_size, seed=seed, shuffle=True)
    data = build_sft_batch([recs[i] for i in idx], run.tokenizer, cfg.data, cfg.policy.max_total_sequence_length)
    t = time.perf_counter()
    res = run.policy.train(data, NLLLossFn(), gbs=batch_size, mbs=min(cfg.policy.train_micro_batch_size, batch_size))
    m = train_metrics(res)
    return {"step": step, "loss": m.get("loss"), "seconds": time.perf_counter() - t}


@flow(name="sft", flow_run_name="sft-{run_id}", validate_parameters=False, persist_result=False)
def sft(
    config: str | dict | MasterConfig | None = None,
    run_id: str | None = None,
    num_steps: int = 60,
    batch_size: int = 32,
    overrides: list[str] | None = None,
    storage: str | None = None,
    lr: float | None = None,
) -> dict[str, Any]:
    """Supervised warm start; returns ``{"run_id", "weights", "checkpoint", "losses"}``.

    ``lr`` overrides ``policy.optimizer.kwargs.lr`` for the warm start only."""
    from nrl_tasks.stages.checkpoint import save_checkpoint

    log = get_run_logger()
    run_id = validate_run_id(run_id) if run_id else new_run_id("sft")
    tag_this_flow_run(run_id)  # before the config is read, like every flow of a run session
    overrides = list(overrides or []) + ([f"policy.optimizer.kwargs.lr={lr}"] if lr is not None else [])
    cfg = resolve_config(config, overrides, storage)
    # no per-step persistence: an SFT started again under the same id (a resumed GRPO flow's warm
    # start) trains again from its first step, deterministically
    with run_session(cfg, run_id, algorithm="sft", intent=RunIntent(restartable=True), log=log) as session:
        with session.running(max_steps=num_steps):
            rt = session.start_runtime(with_actors=False)
            rt.start_policy()
            run = session.context()
            losses = []
            seed = cfg.grpo.seed + 1_000_003  # a draw independent of the GRPO run's
            for step in range(1, num_steps + 1):
                session.fence()
                out = sft_step(quote(run), step, batch_size, seed)
                losses.append(out["loss"])
                if step % 10 == 0 or step == num_steps:
                    log.info("sft step %d/%d loss %.4f", step, num_steps, out["loss"])
            uri = session.layout.checkpoint_uri(num_steps)
            save_checkpoint(
                rt.policy, uri, {"run_id": run_id, "step": num_steps, "weights_version": rt.policy.weights_version, "kind": "sft"},
                save_optimizer=False, storage_options=run.storage_options,
            )
    return {"run_id": run_id, "checkpoint": uri, "weights": f"{uri}/weights", "losses": losses}
