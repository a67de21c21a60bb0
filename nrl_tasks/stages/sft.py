"""The stages of one SFT step (``nrl sft``; its recipe: :mod:`flows.algorithms.sft`) and its data::

    batch = sft_batch(ctx)               # the step's rows of the run's frozen data, tokenised  -> batch
    trained = sft_train(ctx, batch)      # one optimizer step (NLLLossFn)                        -> train
    sft_validate(ctx)                    # when due: held-out rows' loss                         -> val

**Data.** A row is NeMo-RL's chat form, ``{"messages": [{"role": "user", "content": ...},
{"role": "assistant", "content": ...}, ...]}`` (the loss on the assistant turns only; the
messages before the first assistant turn are the prompt, rendered as a generation would see them:
the tokenizer's chat template with ``data.chat_template``), or a (``data.prompt_key``,
``data.answer_key``) pair (the completion ``" " + answer``), or, on the built-in tasks, the task's
prompt and reference answer (a multi-turn environment's ``demonstration`` where the row has one).
Every row ends with an EOS the loss counts; a row longer than ``policy.max_total_sequence_length``
keeps its last tokens. Errors name the file, row (and line) and field.

The draw of step ``k`` is the ``k``-th block of ``policy.train_global_batch_size`` rows of the
run's row order (``sft.seed``; reshuffled every epoch with ``data.shuffle``). ``train`` records the
weights checksum after the update, which a resume's replay (:func:`sft_update` from the persisted
``batch``) must reproduce.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from prefect import task

from nrl_tasks.algorithms.loss_functions import NLLLossFn
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.context import RunContext, StepContext
from nrl_tasks.stages.data import (
    _read_rows,
    batch_draw,
    clip_text,
    file_split,
    format_prompt,
    load_prompt_records,
    masked_batch,
    render_messages,
)
from nrl_tasks.stages.graph import StageGraph, StageSpec
from nrl_tasks.stages.multi_turn import demonstration_tokens
from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, run_stage
from nrl_tasks.stages.supervised import supervised_validation
from nrl_tasks.stages.train import finite_or_none, timed_update, train_metrics

__all__ = ["SFT_GRAPH", "build_sft_batch", "load_sft_records", "sft_batch", "sft_train", "sft_update", "sft_validate"]

#: an SFT step's stages
SFT_GRAPH = StageGraph((
    StageSpec("sft_batch", "batch", label="batch"),
    StageSpec("sft_train", "train", ("batch",), ("policy",), retried=True, label="train"),
))

_ROLES = ("system", "user", "assistant", "tool", "environment")


def _chat_record(messages: Any, path: str, at: str) -> dict[str, str]:
    """A chat row as a record: its messages (JSON text), and for display its prompt (the last
    message before the first assistant turn) and answer (the last assistant turn)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"SFT file {path!r} {at}: field 'messages' must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"SFT file {path!r} {at}: messages[{i}] must be {{'role': str, 'content': str}}, got {m!r:.80}")
        if m["role"] not in _ROLES:
            raise ValueError(f"SFT file {path!r} {at}: messages[{i}] has role {m['role']!r}, not one of {list(_ROLES)}")
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        raise ValueError(f"SFT file {path!r} {at}: 'messages' needs a prompt message and then an assistant turn to learn")
    if messages[-1]["role"] != "assistant":
        raise ValueError(f"SFT file {path!r} {at}: 'messages' must end with an assistant turn, not {messages[-1]['role']!r}")
    clean = [{"role": m["role"], "content": m["content"]} for m in messages]
    return {"prompt": clean[first - 1]["content"], "answer": clean[-1]["content"], "messages": json.dumps(clean, ensure_ascii=False)}


def load_sft_file(path: str, *, prompt_key: str = "prompt", answer_key: str = "answer",
                  storage_options: dict[str, Any] | None = None) -> list[dict[str, str]]:
    """The records of an SFT file: chat rows (``messages``) or (prompt, answer) pairs (see the
    module docstring)."""
    rows, where = _read_rows(path, storage_options)
    if not rows:
        raise ValueError(f"SFT file {path!r} holds no rows")
    out = []
    for row, at in zip(rows, where):
        if "messages" in row:
            out.append(_chat_record(row["messages"], path, at))
            continue
        for key in (prompt_key, answer_key):
            if key not in row:
                raise ValueError(f"SFT file {path!r} {at}: missing field 'messages' or {key!r}; fields: {sorted(map(str, row))[:10]}")
            if not isinstance(row[key], (str, int, float)) or not str(row[key]).strip():
                raise ValueError(f"SFT file {path!r} {at}: field {key!r} must be a non-empty string, got {row[key]!r:.60}")
        out.append({"prompt": str(row[prompt_key]), "answer": str(row[answer_key])})
    return out


def load_sft_records(data_cfg: Any, split: str, seed: int, storage_options: dict[str, Any] | None = None) -> list[dict[str, str]]:
    """Records of ``split`` (``"train"``/``"val"``): ``data.<split>_path`` (or the train file's
    held-out slice: ``data.split_validation_size``, :func:`~nrl_tasks.stages.data.file_split`) or
    the built-in task's."""
    if data_cfg.dataset != "file":
        return load_prompt_records(data_cfg, split, seed, storage_options)
    return file_split(data_cfg, split, seed, lambda path: load_sft_file(
        path, prompt_key=data_cfg.prompt_key, answer_key=data_cfg.answer_key, storage_options=storage_options))


def build_sft_batch(records: list[dict[str, str]], tokenizer: Any, data_cfg: Any, max_len: int) -> BatchedDataDict:
    """``input_ids, input_lengths, token_mask, sample_mask`` of ``records`` (see the module
    docstring): a chat row's assistant turns, a pair's ``" answer"``, a built-in row's
    ``demonstration`` (a multi-turn episode's messages after the prompt) or answer; at most the
    last ``max_len`` tokens of a row."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    rows = []
    for r in records:
        if r.get("messages"):
            log = json.loads(r["messages"])
            first = next(i for i, m in enumerate(log) if m["role"] == "assistant")
            prompt = [{**m, "content": clip_text(m["content"], max_len, keep="tail")} for m in log[:first]]
            p = tokenizer(render_messages(prompt, data_cfg, tokenizer), add_special_tokens=False)["input_ids"]
            ids, mask = demonstration_tokens(tokenizer, p, log[first:], chat_template=data_cfg.chat_template, eos_id=eos,
                                             max_tokens=max_len)
        else:
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


@task(name="sft_batch", task_run_name="sft_batch-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def sft_batch(ctx: StepContext) -> DatasetRef:
    """Draw and tokenise the step's rows of the run's frozen data; persist ``batch``."""
    cfg = ctx.cfg

    def compute(_: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        recs, idx = batch_draw(ctx, "train", cfg.sft.seed)
        b = build_sft_batch([recs[i] for i in idx], ctx.tokenizer, cfg.data, cfg.policy.max_total_sequence_length)
        b["record_index"] = torch.tensor(idx, dtype=torch.int64)
        return b, {"tokens": int(b["token_mask"].sum())}

    return run_stage(ctx, "sft_batch", compute, output="batch")


def sft_update(run: RunContext, batches: Any) -> dict[str, float]:
    """One NLL update of ``run``'s policy on a step's ``batch``: what :func:`sft_train` computes
    and a replay repeats. Scalar metrics."""
    cfg, b = run.cfg, batches["batch"]
    data = BatchedDataDict({k: b[k] for k in ("input_ids", "input_lengths", "token_mask", "sample_mask")})
    loss_fn = NLLLossFn()
    result = run.policy.train(data, loss_fn, gbs=cfg.policy.train_global_batch_size, mbs=cfg.policy.train_micro_batch_size)
    return train_metrics(result, getattr(loss_fn, "metric_reductions", None))


@task(name="sft_train", task_run_name="sft_train-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def sft_train(ctx: StepContext, batch: DatasetRef) -> DatasetRef:
    """One NLL update on the step's batch (policy at version ``step - 1`` before, ``step``
    after); persist its metrics and the weights checksum as ``train``."""

    def compute(inputs: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        metrics, row = timed_update(ctx, "sft_train", sft_update, inputs, timer)
        tokens = int(inputs["batch"]["token_mask"].sum())
        return BatchedDataDict(row), finite_or_none({
            "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"), "train_seconds": timer.seconds["train"],
            "tokens_per_s": tokens / max(timer.seconds["train"], 1e-9), "weights_checksum": ctx.policy.weights_checksum(),
        }, f"sft_train of step {ctx.step}")

    return run_stage(ctx, "sft_train", compute, inputs={"batch": batch}, output="train", weights_version=ctx.step)


@task(name="validate", task_run_name="validate-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def sft_validate(ctx: StepContext) -> DatasetRef:
    """The held-out rows' NLL (``val_loss``, mean over their loss tokens) on the policy after
    step ``ctx.step``; persist ``val``."""
    cfg = ctx.cfg
    recs = ctx.run.records("val")

    def build(n: int) -> BatchedDataDict:
        return build_sft_batch(recs[:n], ctx.tokenizer, cfg.data, cfg.policy.max_total_sequence_length)

    return supervised_validation(ctx, build, NLLLossFn(), rows=len(recs), val_cfg=cfg.sft)
