"""Preference pairs for DPO: reading them, the run's frozen copy, and the pair batch of a step.

**Sources.** ``data.dataset: file``: ``data.train_path`` (JSONL, Parquet or Arrow, local or S3)
with a ``prompt`` (``data.prompt_key``), a ``chosen`` and a ``rejected`` response per row, each a
non-empty string; errors name the file, the row (and the line) and the field. ``data.dataset:
arithmetic``: the built-in task's train prompts, chosen ``" <right answer>"``, rejected
``" <answer + d>"`` with ``d`` in ``{-3..-1, 1..3}`` drawn from ``(seed, row)``. The responses are
appended to the formatted prompt as they are (a file that wants a space says so).

**Snapshot.** The first run of a DPO run freezes its pairs at ``<run>/data/preferences`` (an Arrow
dataset, its manifest recording ``records_sha256``: :func:`records_digest`); every later step and
every resume reads that copy, so editing the source file never changes a run. A damaged copy is
rebuilt by a resume from its source when the source still holds the same pairs (the digest
matches; :func:`snapshot_repair`).

**Pair batch** (rows interleaved: ``2i`` chosen, ``2i + 1`` rejected, same prompt):
``input_ids [2P, S]``, ``input_lengths [2P]``, ``token_mask [2P, S]`` (1 on response tokens and
the EOS that ends them), ``sample_mask [2P]``, ``pair_index [2P]`` (pair within the step),
``record_index [2P]`` (row of the snapshot). A pair longer than ``policy.max_total_sequence_length``
loses prompt tokens from the left first, then response tokens from the right; before tokenising,
the prompt and the responses are cut by characters to what that can keep
(:func:`~nrl_tasks.stages.data.clip_text`), so a huge response costs no more than a short one.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import torch

import storage
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.run_layout import join_uri
from nrl_tasks.stages.data import (
    _read_rows, clip_text, completion_batch, derive_seed, file_split, format_prompt, load_prompt_records,
)
from nrl_tasks.stages.errors import DamagedRunError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nrl_tasks.config.data import DataConfig
    from nrl_tasks.config.master import MasterConfig
    from nrl_tasks.run_layout import RunLayout

__all__ = ["build_pair_batch", "builtin_preferences", "load_preference_file", "records_digest", "snapshot_preferences", "snapshot_repair", "snapshot_uri",
           "load_preferences", "pairs_seed", "source_preferences"]

FIELDS = ("chosen", "rejected")


def load_preference_file(path: str, *, prompt_key: str = "prompt", storage_options: dict[str, Any] | None = None
                         ) -> list[dict[str, str]]:
    """``[{"prompt", "chosen", "rejected"}]`` from a preference file (see the module docstring)."""
    rows, where = _read_rows(path, storage_options)
    if not rows:
        raise ValueError(f"preference file {path!r} holds no rows")
    out = []
    for row, at in zip(rows, where):
        rec = {}
        for key, name in ((prompt_key, "prompt"), *((f, f) for f in FIELDS)):
            if key not in row:
                raise ValueError(f"preference file {path!r} {at}: missing field {key!r}; fields: {sorted(map(str, row))[:10]}")
            value = row[key]
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"preference file {path!r} {at}: field {key!r} must be a non-empty string, got {value!r:.60}")
            rec[name] = value
        if rec["chosen"] == rec["rejected"]:
            raise ValueError(f"preference file {path!r} {at}: 'chosen' and 'rejected' are the same text")
        out.append(rec)
    return out


def builtin_preferences(data_cfg: DataConfig, seed: int, split: str = "train") -> list[dict[str, str]]:
    """Pairs on the built-in arithmetic task's prompts of ``split`` (see the module docstring)."""
    out = []
    for i, r in enumerate(load_prompt_records(data_cfg, split, seed)):
        rng = random.Random(derive_seed(seed, "dpo-rejected" if split == "train" else f"dpo-rejected-{split}", i))
        wrong = int(r["answer"]) + rng.choice((-3, -2, -1, 1, 2, 3))
        out.append({"prompt": r["prompt"], "chosen": f" {r['answer']}", "rejected": f" {wrong}"})
    return out


def records_digest(records: list[dict[str, str]]) -> str:
    """sha256 of the pairs ``records`` (their text, in order): what a snapshot's manifest records."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(records, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def pairs_seed(cfg: MasterConfig) -> int:
    """The seed of a run reading preference pairs: ``rm.seed`` (reward-model training) or ``dpo.seed``."""
    return (cfg.rm if cfg.rm is not None else cfg.dpo).seed


def source_preferences(cfg: MasterConfig, storage_options: dict[str, Any] | None = None, split: str = "train") -> list[dict[str, str]]:
    """The pairs of the run's configured source of ``split``: :func:`load_preferences` with :func:`pairs_seed`."""
    return load_preferences(cfg.data, split, pairs_seed(cfg), storage_options)


def load_preferences(data_cfg: DataConfig, split: str, seed: int, storage_options: dict[str, Any] | None = None) -> list[dict[str, str]]:
    """The pairs of ``split``: ``data.<split>_path`` (or the train file's held-out slice:
    ``data.split_validation_size``, :func:`~nrl_tasks.stages.data.file_split`), or the built-in
    task's split drawn with ``seed``."""
    if data_cfg.dataset == "file":
        return file_split(data_cfg, split, seed, lambda path: load_preference_file(
            path, prompt_key=data_cfg.prompt_key, storage_options=storage_options))
    return builtin_preferences(data_cfg, seed, split)


def snapshot_repair(layout: RunLayout, cfg: MasterConfig, storage_options: dict[str, Any] | None = None) -> str | None:
    """Check run ``layout.run_id``'s frozen pairs fully (sizes, checksums); ``None`` when they are
    sound or not frozen yet, their URI when they are damaged and the source still holds the same
    pairs (a resume deletes them and freezes them again: the same pairs), ``DamagedRunError``
    naming the file and the way on when they cannot be rebuilt."""

    kw = {"storage_options": storage_options} if storage_options else {}
    uri = snapshot_uri(layout)
    if not storage.is_committed(uri, **kw):
        return None
    try:
        storage.load_batch(uri, verify=True, mmap=False, **kw)
        return None
    except (ValueError, OSError) as exc:
        damage = f"{type(exc).__name__}: {exc}"
    try:
        recorded = storage.read_manifest(uri, **kw).meta.get("records_sha256")
    except (ValueError, OSError):
        recorded = None
    source = cfg.data.train_path if cfg.data.dataset == "file" else "the built-in arithmetic pairs"
    try:
        same = recorded is not None and records_digest(source_preferences(cfg, storage_options)) == recorded
    except (ValueError, OSError) as exc:
        raise DamagedRunError(
            f"run {layout.run_id!r} cannot resume: its frozen preference pairs {uri} are damaged ({damage}) and their "
            f"source data.train_path {source!r} does not read ({exc}); restore {uri} from a copy or start a new run"
        ) from None
    if same:
        return uri
    raise DamagedRunError(
        f"run {layout.run_id!r} cannot resume: its frozen preference pairs {uri} are damaged ({damage}) and "
        + (f"their source {source!r} no longer holds the pairs the run froze (records_sha256 {recorded})"
           if recorded else "their manifest records no digest to check a rebuild from the source against")
        + f"; restore {uri} from a copy or start a new run"
    )


def snapshot_uri(layout: RunLayout, split: str = "train") -> str:
    """Where run ``layout.run_id`` keeps its frozen pairs: ``<run>/data/preferences`` (the
    held-out ones: ``preferences-val``)."""

    return join_uri(layout.run_uri, "data", "preferences" if split == "train" else f"preferences-{split}")


def snapshot_preferences(
    layout: RunLayout, cfg: MasterConfig, storage_options: dict[str, Any] | None = None, split: str = "train",
) -> list[dict[str, str]]:
    """The run's frozen pairs of ``split`` at ``<run>/data/preferences`` (``preferences-val``):
    read back when committed, else loaded from the configured source and saved."""

    kw = {"storage_options": storage_options} if storage_options else {}
    uri = snapshot_uri(layout, split)
    keys = ("prompt", *FIELDS)
    if storage.is_committed(uri, **kw):
        b = storage.load_batch(uri, **kw)
        return [dict(zip(keys, vals)) for vals in zip(*(b[k] for k in keys))]
    recs = source_preferences(cfg, storage_options, split)
    storage.save_batch(BatchedDataDict({k: [r[k] for r in recs] for k in keys}), uri, **kw,
                       run_id=layout.run_id, stage=f"data-{uri.rstrip('/').rsplit('/', 1)[-1]}", step=0,
                       records_sha256=records_digest(recs))
    return recs


def build_pair_batch(records: list[dict[str, str]], indices: list[int], tokenizer: Any, data_cfg: DataConfig, max_len: int
                     ) -> BatchedDataDict:
    """The interleaved pair batch of records ``indices`` (see the module docstring)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    rows: list[tuple[list[int], list[int]]] = []
    for i in indices:
        r = records[i]
        prompt = tokenizer(format_prompt(r["prompt"], data_cfg, tokenizer, max_tokens=max_len), add_special_tokens=False)["input_ids"]
        for field in FIELDS:
            resp = clip_text(r[field], max_len, keep="head")  # only its first tokens can be kept
            resp = (tokenizer(resp, add_special_tokens=False)["input_ids"] + [eos])[: max_len - 1]
            rows.append((prompt[max(0, len(prompt) - (max_len - len(resp))):], resp))
    return BatchedDataDict({
        **completion_batch(rows, pad),
        "sample_mask": torch.ones(len(rows), dtype=torch.float32),
        "pair_index": torch.arange(len(indices), dtype=torch.int64).repeat_interleave(2),
        "record_index": torch.tensor(indices, dtype=torch.int64).repeat_interleave(2),
    })
