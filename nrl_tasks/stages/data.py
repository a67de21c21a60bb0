"""Prompt datasets: the built-in arithmetic generator or a user file, and the per-step draw.

Records are ``{"prompt": str, "answer": str}``. A user file is JSONL, Parquet or Arrow
(IPC file or stream), local or ``s3://``; the columns are named by ``data.prompt_key`` and
``data.answer_key``. Problems (missing column or field, empty prompt, non-UTF-8 bytes) raise
``ValueError`` naming the file, row (and line, for JSONL) and field; :func:`check_prompt_lengths`
checks the whole dataset against the token budget once, when a run takes its data snapshot.

The draw is deterministic: the prompts of step ``k`` (steps count from 1) are positions
``(k-1)*P .. k*P-1`` of an endless stream made of one permutation of the records per epoch,
each seeded from ``(seed, epoch)``. The data cursor is therefore just the last trained step.

>>> order = epoch_permutation(5, seed=3, epoch=0)
>>> sorted(order) == list(range(5)), order == epoch_permutation(5, seed=3, epoch=0)
(True, True)
>>> step_record_indices(num_records=5, step=2, num_prompts=3, seed=0, shuffle=False)
[3, 4, 0]
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Sequence

import torch

import storage
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.run_layout import join_uri
from nrl_tasks.utils.jsonl import jsonl_lines

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nrl_tasks.config.data import DataConfig
    from nrl_tasks.config.master import MasterConfig
    from nrl_tasks.run_layout import RunLayout

__all__ = [
    "CHARS_PER_TOKEN",
    "batch_draw",
    "check_prompt_lengths",
    "clip_text",
    "completion_batch",
    "masked_batch",
    "prompt_messages",
    "render_messages",
    "derive_seed",
    "epoch_permutation",
    "file_split",
    "held_out_rows",
    "format_prompt",
    "gen_batch_record_indices",
    "load_prompt_file",
    "load_prompt_records",
    "step_record_indices",
    "read_records_snapshot",
    "snapshot_records",
    "text_budget",
    "tokenize_prompts",
]

CHARS_PER_TOKEN = 32
"""A generous bound on the characters one token stands for. Text fields (prompt, answer, chosen,
rejected, demonstration turns) are cut to :func:`text_budget` characters *before* they are
tokenised, so a 50 MB line costs 50 MB, not the many GB of tokenising it whole. Real BPE
vocabularies average 3-5 characters per token and their longest tokens are runs of 16-32 spaces or
dashes, so the tokens a run keeps (at most the token limit) always lie inside the cut."""


def derive_seed(seed: int, *parts: Any) -> int:
    """A 63-bit seed from ``(seed, *parts)`` (e.g. ``(seed, step, "generate", i)``), stable everywhere.

    >>> derive_seed(1, 2, "generate", 0) == derive_seed(1, 2, "generate", 0) != derive_seed(1, 2, "generate", 1)
    True
    """
    blob = json.dumps([int(seed), *[p if isinstance(p, (int, str)) else str(p) for p in parts]]).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") & ((1 << 63) - 1)


def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    """Permutation of ``range(n)`` for ``epoch`` (a ``torch.Generator`` seeded from (seed, epoch))."""
    g = torch.Generator().manual_seed(derive_seed(seed, "data", epoch))
    return torch.randperm(n, generator=g).tolist()


def step_record_indices(*, num_records: int, step: int, num_prompts: int, seed: int, shuffle: bool = True) -> list[int]:
    """Record indices of the ``num_prompts`` prompts of ``step`` (>= 1)."""
    if num_records <= 0:
        raise ValueError("the prompt dataset is empty")
    if step < 1:
        raise ValueError(f"steps count from 1, got {step}")
    out: list[int] = []
    perms: dict[int, list[int]] = {}
    for pos in range((step - 1) * num_prompts, step * num_prompts):
        epoch, i = divmod(pos, num_records)
        if not shuffle:
            out.append(i)
            continue
        if epoch not in perms:
            perms[epoch] = epoch_permutation(num_records, seed, epoch)
        out.append(perms[epoch][i])
    return out


def batch_draw(ctx: Any, split: str, seed: int) -> tuple[list[dict[str, str]], list[int]]:
    """The run's frozen rows of ``split`` and the ones step ``ctx.step`` of a supervised run (DPO,
    SFT) trains on: the step's block of ``policy.train_global_batch_size`` rows of the run's row
    order (``seed``; reshuffled every epoch with ``data.shuffle``)."""
    records, cfg = ctx.run.records(split), ctx.cfg
    return records, step_record_indices(num_records=len(records), step=ctx.step, seed=seed, shuffle=cfg.data.shuffle,
                                        num_prompts=cfg.policy.train_global_batch_size)


def gen_batch_record_indices(
    *, num_records: int, step: int, gen_batch: int, num_prompts: int, seed: int, shuffle: bool = True
) -> list[int]:
    """Record indices of generation batch ``gen_batch`` of ``step`` (``num_prompts`` of them):
    batch 0 is the step's block of the run's prompt order, batch ``j >= 1`` a block of a
    permutation of its own (see deviation 2 in :mod:`nrl_tasks.algorithms.dynamic_sampling`)."""
    if gen_batch == 0:
        return step_record_indices(num_records=num_records, step=step, num_prompts=num_prompts, seed=seed, shuffle=shuffle)
    own = derive_seed(seed, "dynamic_sampling", step)
    return step_record_indices(num_records=num_records, step=gen_batch, num_prompts=num_prompts, seed=own, shuffle=True)


def completion_batch(rows: Sequence[tuple[list[int], list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``(prompt tokens, completion tokens)`` rows: ``input_ids [B, S]``,
    ``input_lengths [B]`` and ``token_mask [B, S]`` (1 on the completion tokens); what the SFT
    warm start and DPO train on."""
    return masked_batch([(p + a, [0.0] * len(p) + [1.0] * len(a)) for p, a in rows], pad_token_id)


def masked_batch(rows: Sequence[tuple[list[int], list[float]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``(tokens, token mask)`` rows: ``input_ids [B, S]``, ``input_lengths [B]``,
    ``token_mask [B, S]`` (e.g. a multi-turn demonstration: 1 on its assistant turns only)."""
    width = max(len(t) for t, _ in rows)
    ids = torch.full((len(rows), width), int(pad_token_id), dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for k, (t, m) in enumerate(rows):
        if len(t) != len(m):
            raise ValueError(f"row {k}: {len(t)} tokens but a token mask of {len(m)}")
        ids[k, : len(t)] = torch.tensor(t, dtype=torch.int64)
        mask[k, : len(m)] = torch.tensor(m, dtype=torch.float32)
    lengths = torch.tensor([len(t) for t, _ in rows], dtype=torch.int64)
    return {"input_ids": ids, "input_lengths": lengths, "token_mask": mask}


# ----------------------------------------------------------------------------------------------
# reading user files


def _open_bytes(path: str, storage_options: dict[str, Any] | None) -> bytes:
    import fsspec

    try:
        with fsspec.open(path, "rb", **(storage_options or {})) as fh:
            return fh.read()
    except FileNotFoundError:
        raise ValueError(f"prompt file {path!r} does not exist") from None
    except Exception as exc:  # noqa: BLE001 - s3fs/permission errors come in many types
        raise ValueError(f"prompt file {path!r} cannot be read: {type(exc).__name__}: {exc}") from None


def _rows_from_table(table: Any) -> list[dict[str, Any]]:
    try:
        return table.to_pylist()
    except UnicodeDecodeError as exc:  # Arrow "binary" columns are fine; broken utf8 ones are not
        raise ValueError(f"holds text that is not UTF-8: {exc}") from None


def _read_rows(path: str, storage_options: dict[str, Any] | None) -> tuple[list[dict[str, Any]], list[str]]:
    """``(rows, where)``: the records and, for each, how errors name it (``line 5, row 3``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = _open_bytes(path, storage_options)
    lower = path.lower()
    if lower.endswith((".jsonl", ".json", ".ndjson")):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw[: exc.start].count(b"\n") + 1
            col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
            raise ValueError(
                f"prompt file {path!r} line {line}: not UTF-8 (byte {exc.start}, column {col}: "
                f"{raw[exc.start:exc.start + 1]!r}); re-encode the file as UTF-8"
            ) from None
        rows, where = [], []
        for n, line in jsonl_lines(text):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"prompt file {path!r} line {n}: invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"prompt file {path!r} line {n}: expected a JSON object, got {type(row).__name__}")
            where.append(f"line {n}, row {len(rows)}")
            rows.append(row)
        return rows, where
    try:
        table = None
        if lower.endswith(".parquet"):
            table = pq.read_table(io.BytesIO(raw))
        elif lower.endswith((".arrow", ".feather", ".ipc")):
            try:
                table = pa.ipc.open_file(pa.py_buffer(raw)).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_stream(pa.py_buffer(raw)).read_all()
    except pa.ArrowException as exc:
        raise ValueError(f"prompt file {path!r} cannot be parsed: {exc}") from None
    if table is None:
        raise ValueError(f"prompt file {path!r}: unsupported extension (use .jsonl, .parquet or .arrow)")
    try:
        rows = _rows_from_table(table)
    except ValueError as exc:
        raise ValueError(f"prompt file {path!r} {exc}") from None
    return rows, [f"row {i}" for i in range(len(rows))]


def load_prompt_file(
    path: str,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    storage_options: dict[str, Any] | None = None,
) -> list[dict[str, str]]:
    """Read a prompt file into ``[{"prompt", "answer", ...}]``: the row's other columns too (a
    multi-turn environment's episode metadata starts as the row; text as it is, other values as
    JSON text), under their own names where they are not ``prompt``/``answer``.

    ``answer_key`` may be absent from every row (answers ``""``, for reward functions that need
    none) but not from some rows only. Errors (``ValueError``) name the file, the row (and the
    line, for JSONL) and the field.
    """
    rows, where = _read_rows(path, storage_options)
    if not rows:
        raise ValueError(f"prompt file {path!r} holds no rows")
    with_answer = sum(answer_key in row for row in rows)
    out = []
    for row, at in zip(rows, where):
        if prompt_key not in row:
            raise ValueError(
                f"prompt file {path!r} {at}: missing field {prompt_key!r} (data.prompt_key); "
                f"fields: {sorted(map(str, row))[:10]}"
            )
        prompt = row[prompt_key]
        if not isinstance(prompt, str):
            raise ValueError(f"prompt file {path!r} {at}: field {prompt_key!r} is {type(prompt).__name__}, not str")
        if not prompt.strip():
            raise ValueError(f"prompt file {path!r} {at}: empty prompt (field {prompt_key!r})")
        if 0 < with_answer < len(rows) and answer_key not in row:
            raise ValueError(
                f"prompt file {path!r} {at}: missing field {answer_key!r} (data.answer_key), which "
                f"{with_answer} of {len(rows)} rows have"
            )
        answer = row.get(answer_key)
        extra = {str(k): v if isinstance(v, str) else json.dumps(v, default=str) for k, v in row.items()
                 if k not in (prompt_key, answer_key, "prompt", "answer") and v is not None}
        out.append({**extra, "prompt": prompt, "answer": "" if answer is None else str(answer)})
    return out


def load_prompt_records(data_cfg: DataConfig, split: str, seed: int, storage_options: dict[str, Any] | None = None) -> list[dict[str, str]]:
    """Records of ``split`` (``"train"`` or ``"val"``) for a ``DataConfig``."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if data_cfg.dataset == "arithmetic":
        from nrl_tasks.environments.arithmetic import make_arithmetic_prompts

        a = data_cfg.arithmetic
        num = a.num_train if split == "train" else a.num_val
        # train and val use different seeds (val: a held-out draw of the same distribution)
        return make_arithmetic_prompts(
            num,
            seed=derive_seed(seed, "arithmetic", split) % (2**31),
            max_operand=a.max_operand,
            ops=tuple(a.ops),
            few_shot=getattr(a, "few_shot", 0),
        )
    if data_cfg.dataset in ("calculator", "guess_number"):  # the built-in environments' prompts
        a = data_cfg.arithmetic
        num, env_seed = (a.num_train if split == "train" else a.num_val), derive_seed(seed, data_cfg.dataset, split) % (2**31)
        if data_cfg.dataset == "calculator":
            from nrl_tasks.environments.calculator import make_calculator_prompts

            return make_calculator_prompts(num, env_seed, max_operand=a.max_operand, ops=tuple(a.ops))
        from nrl_tasks.environments.guess_number import make_guess_prompts

        return make_guess_prompts(num, env_seed, max_target=a.max_operand)
    return file_split(data_cfg, split, seed, lambda path: load_prompt_file(
        path, prompt_key=data_cfg.prompt_key, answer_key=data_cfg.answer_key, storage_options=storage_options))


def file_split(data_cfg: DataConfig, split: str, seed: int, load: Callable[[str], list[dict[str, str]]]) -> list[dict[str, str]]:
    """The rows of ``split`` from the data files, read by ``load(path)``: ``data.<split>_path``, or
    with ``data.split_validation_size`` (and no ``data.val_path``) NeMo-RL's held-out slice of the
    train file (:func:`held_out_rows`, drawn with ``data.split_seed``, else ``seed``) as ``val``
    and the rest as ``train``."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if data_cfg.split_validation_size and not data_cfg.val_path:
        rows = load(data_cfg.train_path)
        held = held_out_rows(len(rows), data_cfg.split_validation_size, data_cfg.split_seed if data_cfg.split_seed is not None else seed)
        return [r for i, r in enumerate(rows) if (i in held) == (split == "val")]
    path = data_cfg.train_path if split == "train" else data_cfg.val_path
    if not path:
        raise ValueError(f"data.{split}_path is not set")
    return load(path)


def held_out_rows(n: int, fraction: float, seed: int) -> set[int]:
    """Indices of the ``ceil(fraction * n)`` rows (at least one, and one fewer than ``n``) held out
    of ``n`` for validation, drawn with ``seed``.

    >>> sorted(held_out_rows(20, 0.05, seed=7)) == sorted(held_out_rows(20, 0.05, seed=7)), len(held_out_rows(20, 0.05, 7))
    (True, 1)
    """
    if n < 2:
        raise ValueError(f"data.split_validation_size needs at least 2 rows in data.train_path, got {n}")
    k = min(n - 1, max(1, math.ceil(fraction * n)))
    g = torch.Generator().manual_seed(derive_seed(seed, "split_validation") % (2**63))
    return set(torch.randperm(n, generator=g)[:k].tolist())


# ----------------------------------------------------------------------------------------------
# formatting and tokenising


def text_budget(max_tokens: int) -> int:
    """Characters of a text field kept before tokenising when at most ``max_tokens`` of its tokens
    can be used: ``(max_tokens + 1) * CHARS_PER_TOKEN``.

    >>> text_budget(63)
    2048
    """
    return (int(max_tokens) + 1) * CHARS_PER_TOKEN


def clip_text(text: str, max_tokens: int, *, keep: Literal["head", "tail"]) -> str:
    """``text`` cut to :func:`text_budget` characters: its start (``keep="head"``: a response whose
    first tokens are kept) or its end (``"tail"``: a prompt or row whose last tokens are kept).

    >>> clip_text("abcdef" * 100, 1, keep="tail")[-6:], len(clip_text("x" * 10**6, 1, keep="head"))
    ('abcdef', 64)
    """
    budget = text_budget(max_tokens)
    if len(text) <= budget:
        return text
    return text[:budget] if keep == "head" else text[-budget:]


def prompt_messages(prompt: str, data_cfg: DataConfig) -> list[dict[str, str]]:
    """The conversation a prompt opens: ``data.system_prompt`` (if set), then the user's
    ``data.prompt_template`` around ``prompt``."""
    system = [{"role": "system", "content": data_cfg.system_prompt}] if data_cfg.system_prompt else []
    return [*system, {"role": "user", "content": data_cfg.prompt_template.replace("{prompt}", prompt)}]


def format_prompt(prompt: str, data_cfg: DataConfig, tokenizer: Any = None, *, max_tokens: int | None = None) -> str:
    """Apply ``data.prompt_template`` and, when ``data.chat_template``, the tokenizer's chat template.

    With ``max_tokens`` (the prompt token budget) the prompt is first cut to its last
    :func:`text_budget` characters (:func:`clip_text`): only its last tokens can be kept."""
    if max_tokens is not None:
        prompt = clip_text(prompt, max_tokens, keep="tail")
    return render_messages(prompt_messages(prompt, data_cfg), data_cfg, tokenizer)


def render_messages(messages: Sequence[dict[str, str]], data_cfg: DataConfig, tokenizer: Any = None) -> str:
    """The text a conversation opens a response with: the tokenizer's chat template with the
    generation prompt when ``data.chat_template``, else the messages' contents, one a line."""
    if data_cfg.chat_template:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("data.chat_template is true but the tokenizer has no chat template")
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in messages)  # system prompt (if any), newline, prompt


def tokenize_prompts(
    texts: Sequence[str],
    tokenizer: Any,
    *,
    max_length: int,
    overlong: str = "reject",
    pad_token_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[B, S]`` (int64, right-padded) and lengths ``[B]`` of ``texts``.

    A prompt longer than ``max_length`` tokens raises ``ValueError`` (``overlong="reject"``) or
    keeps its last ``max_length`` tokens (``"truncate"``). A text longer than
    ``text_budget(max_length)`` characters is over-long before it is tokenised: rejected, or cut
    to its last characters first (:func:`clip_text`). Empty prompts are rejected.
    """
    pad = pad_token_id if pad_token_id is not None else tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    rows: list[list[int]] = []
    for i, text in enumerate(texts):
        if len(text) > text_budget(max_length) and overlong == "reject":
            raise ValueError(
                f"prompt {i} has {len(text)} characters, more than {max_length} tokens can hold "
                f"({CHARS_PER_TOKEN} characters per token; data.max_input_seq_length); "
                f"set data.overlong_prompts=truncate to keep its last tokens: {text[:80]!r}"
            )
        text = clip_text(text, max_length, keep="tail")
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise ValueError(f"prompt {i} tokenizes to nothing: {text!r}")
        if len(ids) > max_length:
            if overlong == "reject":
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens > {max_length} (data.max_input_seq_length); "
                    f"set data.overlong_prompts=truncate to keep its last tokens: {text[:80]!r}"
                )
            ids = ids[-max_length:]
        rows.append(ids)
    width = max(len(r) for r in rows) if rows else 0
    input_ids = torch.full((len(rows), width), int(pad), dtype=torch.int64)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    return input_ids, lengths


def check_prompt_lengths(
    records: Sequence[dict[str, str]],
    data_cfg: DataConfig,
    tokenizer: Any,
    max_length: int,
    *,
    source: str = "the prompt dataset",
) -> int:
    """Check every record's formatted prompt against the token budget before a run starts.

    With ``data.overlong_prompts == "reject"`` a prompt longer than ``max_length`` tokens raises
    ``ValueError`` naming ``source``, the record and its token count (up to 5 listed); with
    ``"truncate"`` nothing raises (:func:`tokenize_prompts` keeps the last ``max_length`` tokens).
    A prompt longer than ``text_budget(max_length)`` characters is over-long without being
    tokenised whole (only its cut is). Returns the number of over-long prompts.
    """
    if max_length < 1:
        raise ValueError(f"the prompt token budget must be >= 1, got {max_length}")
    budget = text_budget(max_length)
    over: list[tuple[int, str]] = []
    for start in range(0, len(records), 1024):
        chunk = records[start : start + 1024]
        texts = [format_prompt(r["prompt"], data_cfg, tokenizer, max_tokens=max_length) for r in chunk]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        for j, (rec, row) in enumerate(zip(chunk, ids)):
            if not row:
                raise ValueError(f"{source} record {start + j}: the prompt tokenizes to nothing: {texts[j]!r}")
            if len(rec["prompt"]) > budget:
                over.append((start + j, f"{len(rec['prompt'])} characters"))
            elif len(row) > max_length:
                over.append((start + j, f"{len(row)} tokens"))
    if over and data_cfg.overlong_prompts == "reject":
        shown = ", ".join(f"record {i} ({n})" for i, n in over[:5])
        more = f" and {len(over) - 5} more" if len(over) > 5 else ""
        raise ValueError(
            f"{source}: {len(over)} prompt(s) longer than {max_length} tokens (data.max_input_seq_length, or "
            f"policy.max_total_sequence_length - generation.max_new_tokens): {shown}{more}; "
            "set data.overlong_prompts=truncate to keep their last tokens"
        )
    return len(over)


def records_columns(records: Iterable[dict[str, str]]) -> dict[str, list[str]]:
    """``{"prompt": [...], "answer": [...]}`` from records."""
    records = list(records)
    return {"prompt": [r["prompt"] for r in records], "answer": [r["answer"] for r in records]}


def snapshot_records(
    layout: RunLayout, cfg: MasterConfig, split: str, tokenizer: Any = None, storage_options: dict[str, Any] | None = None,
    *, load: Any = None,
) -> list[dict[str, str]]:
    """The run's frozen copy of prompt split ``split`` at ``<run>/data/<split>``: read back when
    committed, else loaded from the configured source (``load(data_cfg, split, seed, opts)``:
    :func:`load_prompt_records` by default; the built-in tasks' rows drawn with ``grpo.seed``),
    checked (over-long prompts: one clear error now, not at step k, when a ``tokenizer`` is given)
    and saved."""

    kw = {"storage_options": storage_options} if storage_options else {}
    uri = join_uri(layout.run_uri, "data", split)
    found = read_records_snapshot(uri, storage_options)
    if found is not None:
        return found
    recs = (load or load_prompt_records)(cfg.data, split, cfg.rollout.seed, storage_options)
    if tokenizer is not None:
        src = getattr(cfg.data, f"{split}_path", None) or f"{cfg.data.dataset} {split} split"
        check_prompt_lengths(recs, cfg.data, tokenizer, cfg.max_prompt_tokens(), source=src)
    # every field of a row, not only prompt and answer: a multi-turn environment's first metadata
    # is the whole row, and a later process of the run (resume, extension) must give it the same
    batch = BatchedDataDict({
        "prompt": [r["prompt"] for r in recs], "answer": [r["answer"] for r in recs],
        _EXTRA: [json.dumps({k: v for k, v in r.items() if k not in ("prompt", "answer")}, ensure_ascii=False) for r in recs],
    })
    storage.save_batch(batch, uri, **kw, run_id=layout.run_id, stage=f"data-{split}", step=0)
    return recs


#: the snapshot column holding each row's fields besides ``prompt`` and ``answer`` (JSON text)
_EXTRA = "fields"


def read_records_snapshot(uri: str, storage_options: dict[str, Any] | None = None) -> list[dict[str, str]] | None:
    """The records of a committed prompt snapshot at ``uri`` with every field they were saved
    with (``None``: not committed). Snapshots written before the ``fields`` column hold
    ``prompt`` and ``answer`` only."""

    kw = {"storage_options": storage_options} if storage_options else {}
    if not storage.is_committed(uri, **kw):
        return None
    b = storage.load_batch(uri, **kw)
    extra = b[_EXTRA] if _EXTRA in b else [None] * len(b["prompt"])
    return [{**(json.loads(e) if e else {}), "prompt": p, "answer": a} for p, a, e in zip(b["prompt"], b["answer"], extra)]
