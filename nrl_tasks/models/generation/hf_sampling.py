"""Batched sampling with a KV cache for Hugging Face causal LMs: the shared decode loop.

Used by the ``hf`` generation workers and by ``Policy.generate``. Prompts come right-padded
(NeMo-RL's layout), are left-padded internally so that all rows decode in lock step with one
``DynamicCache`` (explicit ``position_ids`` make the padding invisible to RoPE), and the result
is right-padded again (see :mod:`nrl_tasks.models.generation.interfaces` for the output layout).

Sampling conventions:

* ``logprobs`` are ``log_softmax(logits / temperature)`` of the chosen token over the whole
  vocabulary, *before* top-k / top-p filtering: the same quantity ``Policy.get_logprobs``
  computes, so that ``generation_logprobs`` and ``prev_logprobs`` agree. Greedy decoding picks
  ``argmax`` and reports the same quantity.
* Sampling draws from the top-k / top-p filtered, renormalised distribution of
  ``logits / temperature`` with ``torch.multinomial``.
* ``seeds[i]`` seeds a ``torch.Generator`` owned by row ``i`` that draws exactly one sample per
  generated token of that row, so a row's sample depends only on its seed, its prompt and the
  logits. Logits can differ in the last bits with the batch composition (left-padding width,
  batched matmul kernels), so "same seed, same sample" holds exactly for the same batch and
  otherwise up to such ties. Without ``seeds`` all rows share ``generator`` (or torch's global
  generator).
* A row stops at its first stop token id (the tokenizer's/model's EOS is one unless
  ``ignore_eos``) or once its decoded generated text contains one of its stop strings; the token
  that completed the stop is kept. Stop strings are matched on a decoded tail of the last
  ``max(len(stop)) + 4`` generated tokens (enough for any tokenizer whose tokens decode to at
  least one character). ``truncated`` is set when a row hit ``max_new_tokens`` (or the model's
  context length) without stopping.
* Rows with the same prompt (a GRPO group) share one prefill: the prompt runs once and its
  KV cache is repeated for them.
* Rows that finished leave the compute batch (and the KV cache) once at most 3/4 of it is
  still decoding, so ragged stops do not keep costing compute.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "build_generation_output",
    "cache_keyword",
    "filter_top_k_top_p",
    "forward_parameters",
    "generate_batch",
    "merge_stop_strings",
    "new_cache",
    "resolve_pad_and_stop_ids",
    "sample_rows",
]

_TAIL_EXTRA_TOKENS = 4
#: Finished rows are dropped from the compute batch (and the KV cache) once at most this
#: fraction of it is still decoding.
_PRUNE_FRACTION = 0.75


def resolve_pad_and_stop_ids(
    model: Any,
    tokenizer_or_pad_id: Any,
    stop_token_ids: Sequence[int] | None,
    *,
    ignore_eos: bool = False,
    pad_token_id: int | None = None,
) -> tuple[int, list[int]]:
    """Return ``(pad_id, stop_ids)`` from explicit settings, the tokenizer and the model config.

    ``pad_id``: ``pad_token_id`` if given, else an int ``tokenizer_or_pad_id``, else the
    tokenizer's pad id, else its EOS id. ``stop_ids``: ``stop_token_ids`` plus every EOS id of
    the tokenizer and of ``model.generation_config`` unless ``ignore_eos``.
    """
    tokenizer = None if isinstance(tokenizer_or_pad_id, int) else tokenizer_or_pad_id
    eos_ids: list[int] = []
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        eos_ids.append(int(tokenizer.eos_token_id))
    gen_cfg = getattr(model, "generation_config", None)
    model_eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
    if model_eos is None:
        model_eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if model_eos is not None:
        eos_ids.extend(int(x) for x in (model_eos if isinstance(model_eos, (list, tuple)) else [model_eos]))

    if pad_token_id is None:
        if isinstance(tokenizer_or_pad_id, int):
            pad_token_id = tokenizer_or_pad_id
        elif tokenizer is not None and getattr(tokenizer, "pad_token_id", None) is not None:
            pad_token_id = int(tokenizer.pad_token_id)
        elif eos_ids:
            pad_token_id = eos_ids[0]
        else:
            raise ValueError("pad_token_id: none given and the tokenizer/model has neither a pad nor an EOS id")

    stops = [int(x) for x in (stop_token_ids or [])]
    if not ignore_eos:
        stops.extend(eos_ids)
    return int(pad_token_id), sorted(set(stops))


def filter_top_k_top_p(scores: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Mask ``scores [B, V]`` to ``-inf`` outside the top-k and the top-p nucleus (new tensor).

    The nucleus is the smallest prefix of tokens sorted by probability whose mass reaches
    ``top_p``; the most likely token is always kept.
    """
    out = scores
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def _per_row_stop_strings(stop_strings: Any, batch: int) -> list[list[str]]:
    """Normalise ``None`` | ``[str, ...]`` (all rows) | ``[[str, ...] | None, ...]`` (per row)."""
    if stop_strings is None:
        return [[] for _ in range(batch)]
    if isinstance(stop_strings, str):
        raise TypeError("stop_strings must be a list of strings or a per-row list of lists, not a str")
    items = list(stop_strings)
    if all(isinstance(s, str) for s in items):
        if any(not s for s in items):
            raise ValueError("stop_strings must not contain empty strings")
        return [list(items) for _ in range(batch)]
    if len(items) != batch:
        raise ValueError(f"stop_strings: per-row list has {len(items)} entries for a batch of {batch}")
    rows: list[list[str]] = []
    for i, row in enumerate(items):
        if row is None:
            rows.append([])
        elif isinstance(row, str) or not all(isinstance(s, str) and s for s in row):
            raise TypeError(f"stop_strings[{i}] must be None or a list of non-empty strings, got {row!r}")
        else:
            rows.append(list(row))
    return rows


def _validate(
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    seeds: torch.Tensor | None,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int | None,
) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a 2-D tensor [B, S], got {getattr(input_ids, 'shape', type(input_ids))}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    batch, width = input_ids.shape
    if not isinstance(input_lengths, torch.Tensor) or tuple(input_lengths.shape) != (batch,):
        raise ValueError(f"input_lengths must have shape [{batch}], got {getattr(input_lengths, 'shape', None)}")
    if batch and (int(input_lengths.min()) < 1 or int(input_lengths.max()) > width):
        raise ValueError(f"input_lengths must lie in [1, {width}] (input_ids width), got {input_lengths.tolist()}")
    if seeds is not None and (not isinstance(seeds, torch.Tensor) or tuple(seeds.shape) != (batch,)):
        raise ValueError(f"seeds must be a tensor of shape [{batch}], got {getattr(seeds, 'shape', type(seeds))}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")


def _select_rows(cache: Any, keep: torch.Tensor) -> None:
    """Keep only batch rows ``keep`` of a KV cache (finished rows stop costing compute)."""
    select = getattr(cache, "batch_select_indices", None)
    if select is not None:
        select(keep)
    else:  # older caches
        cache.reorder_cache(keep)


def new_cache(model: Any) -> Any:
    """An empty ``DynamicCache`` for ``model`` (also used by the policy's shared-prompt forward)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older signature
        return DynamicCache()


def forward_parameters(model: Any) -> Mapping[str, Any]:
    """The parameters of ``model.forward`` (empty when its signature cannot be read)."""
    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}


def cache_keyword(model: Any) -> str:
    """The KV-cache keyword of ``model.forward``: ``cache`` since transformers 5.2x, formerly
    ``past_key_values``."""
    return "cache" if "cache" in forward_parameters(model) else "past_key_values"


def _forward_kwargs(model: Any) -> tuple[str, dict[str, Any]]:
    """The KV-cache keyword of ``model.forward`` and extra kwargs (``logits_to_keep=1`` where
    supported)."""
    params = forward_parameters(model)
    return cache_keyword(model), ({"logits_to_keep": 1} if "logits_to_keep" in params else {})


@torch.no_grad()
def _decode_chunk(
    model: Any,
    tokenizer: Any,
    prompts: list[torch.Tensor],
    *,
    pad_id: int,
    stop_ids: list[int],
    stop_strings: list[list[str]],
    budgets: list[int],
    temperature: float,
    top_p: float,
    top_k: int | None,
    greedy: bool,
    row_generators: list[torch.Generator] | None,
    shared_generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode one chunk; returns ``(gen_ids [b, T], gen_logprobs [b, T], gen_lengths [b], stopped [b])``."""
    device = next(model.parameters()).device
    b = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    width = int(lengths.max())
    max_steps = max(budgets)
    # each distinct prompt is prefilled once; its rows then share its keys and values
    distinct: dict[tuple[int, ...], int] = {}
    prompt_of_row = [distinct.setdefault(tuple(p.tolist()), len(distinct)) for p in prompts]
    ids = torch.full((len(distinct), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(distinct), width), dtype=torch.long)
    for key, u in distinct.items():
        ids[u, width - len(key) :] = torch.tensor(key, dtype=torch.long)
        mask[u, width - len(key) :] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, mask, position_ids = ids.to(device), mask.to(device), position_ids.to(device)
    next_pos = lengths.to(device).unsqueeze(1)
    stop_tensor = torch.tensor(stop_ids, dtype=torch.long, device=device)
    budget_t = torch.tensor(budgets, dtype=torch.long, device=device)
    tails = [max((len(s) for s in row), default=0) + _TAIL_EXTRA_TOKENS for row in stop_strings]

    gen = torch.full((b, max_steps), pad_id, dtype=torch.long, device=device)
    gen_lp = torch.zeros((b, max_steps), dtype=torch.float32, device=device)
    gen_len = torch.zeros(b, dtype=torch.long, device=device)
    active = torch.ones(b, dtype=torch.bool, device=device)
    stopped = torch.zeros(b, dtype=torch.bool, device=device)

    cache_kw, extra = _forward_kwargs(model)
    cache = extra[cache_kw] = new_cache(model)
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True, **extra)
    logits = out.logits[:, -1, :]
    if len(distinct) < b:
        expand = torch.tensor(prompt_of_row, device=device)
        _select_rows(cache, expand)
        logits, mask = logits[expand], mask[expand]
    # the compute batch holds the rows still decoding: ``rows`` maps its positions to chunk rows
    rows = torch.arange(b, device=device)
    for step in range(max_steps):
        act = active[rows]
        scores = logits.float() / temperature
        logp = torch.log_softmax(scores, dim=-1)
        if greedy:
            tok = scores.argmax(dim=-1)
        else:
            probs = torch.softmax(filter_top_k_top_p(scores, top_k, top_p), dim=-1)
            if row_generators is not None:
                tok = torch.full((len(rows),), pad_id, dtype=torch.long, device=device)
                for j in act.nonzero().flatten().tolist():
                    tok[j] = torch.multinomial(probs[j], 1, generator=row_generators[int(rows[j])])[0]
            else:
                tok = torch.multinomial(probs, 1, generator=shared_generator).squeeze(1)
        tok = torch.where(act, tok, torch.full_like(tok, pad_id))
        gen[rows, step] = tok
        gen_lp[rows, step] = torch.where(act, logp.gather(1, tok.unsqueeze(1)).squeeze(1), 0.0)
        gen_len[rows] += act.long()

        hit = act & torch.isin(tok, stop_tensor) if stop_ids else torch.zeros_like(act)
        for j in act.nonzero().flatten().tolist():
            i = int(rows[j])
            if stop_strings[i] and not hit[j]:
                n = int(gen_len[i])
                text = tokenizer.decode(gen[i, max(0, n - tails[i]) : n].tolist(), skip_special_tokens=False)
                if any(s in text for s in stop_strings[i]):
                    hit[j] = True
        stopped[rows] |= hit
        act = act & ~hit & (gen_len[rows] < budget_t[rows])
        active[rows] = act
        n_act = int(act.sum())
        if n_act == 0:
            break
        if n_act <= _PRUNE_FRACTION * len(rows):
            keep = act.nonzero().flatten()
            _select_rows(cache, keep)
            rows, tok, mask, next_pos = rows[keep], tok[keep], mask[keep], next_pos[keep]
        mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=device)], dim=1)
        out = model(input_ids=tok.unsqueeze(1), attention_mask=mask, position_ids=next_pos, use_cache=True, **extra)
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    return gen.cpu(), gen_lp.cpu(), gen_len.cpu(), stopped.cpu()


def generate_batch(
    model: Any,
    tokenizer_or_pad_id: Any,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    stop_strings: Any = None,
    seeds: torch.Tensor | None = None,
    greedy: bool = False,
    ignore_eos: bool = False,
    pad_token_id: int | None = None,
    max_batch_size: int | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """Generate continuations for right-padded prompts ``input_ids [B, S]`` with a KV cache.

    ``tokenizer_or_pad_id``: a tokenizer (needed for ``stop_strings``) or the pad id.
    ``stop_strings``: ``None``, one list for every row, or one list (or ``None``) per row.
    ``seeds [B]``: per-row generator seeds (see the module docstring). ``max_batch_size``
    splits the batch into chunks decoded one after another. Returns CPU tensors
    ``output_ids [B, S + T]`` (T = longest generation), ``logprobs [B, S + T]`` float32,
    ``generation_lengths [B]``, ``unpadded_sequence_lengths [B]`` and ``truncated [B]`` bool.
    """
    if top_k is not None and top_k == -1:
        top_k = None
    _validate(input_ids, input_lengths, seeds, max_new_tokens, temperature, top_p, top_k)
    tokenizer = None if isinstance(tokenizer_or_pad_id, int) else tokenizer_or_pad_id
    pad_id, stop_ids = resolve_pad_and_stop_ids(
        model, tokenizer_or_pad_id, stop_token_ids, ignore_eos=ignore_eos, pad_token_id=pad_token_id
    )
    batch, width = input_ids.shape
    rows_stop = _per_row_stop_strings(stop_strings, batch)
    if tokenizer is None and any(rows_stop):
        raise ValueError("stop_strings need a tokenizer, but tokenizer_or_pad_id is a pad id")
    lengths = input_lengths.to(torch.long).cpu()
    ids_cpu = input_ids.to(torch.long).cpu()

    max_ctx = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    budgets = []
    for i in range(batch):
        room = max_new_tokens if max_ctx is None else min(max_new_tokens, int(max_ctx) - int(lengths[i]))
        if room < 1:
            raise ValueError(f"input_lengths[{i}]={int(lengths[i])} leaves no room in the model context ({max_ctx})")
        budgets.append(room)

    device = next(model.parameters()).device
    row_generators = None
    if seeds is not None and not greedy:
        row_generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds.tolist()]

    was_training = model.training
    model.eval()
    chunk = max_batch_size or max(batch, 1)
    pieces = []
    try:
        for start in range(0, batch, chunk):
            end = min(start + chunk, batch)
            pieces.append(
                _decode_chunk(
                    model,
                    tokenizer,
                    [ids_cpu[i, : int(lengths[i])] for i in range(start, end)],
                    pad_id=pad_id,
                    stop_ids=stop_ids,
                    stop_strings=rows_stop[start:end],
                    budgets=budgets[start:end],
                    temperature=float(temperature),
                    top_p=float(top_p),
                    top_k=top_k,
                    greedy=greedy,
                    row_generators=row_generators[start:end] if row_generators is not None else None,
                    shared_generator=generator,
                )
            )
    finally:
        model.train(was_training)

    gen_ids: list[torch.Tensor] = []
    gen_lps: list[torch.Tensor] = []
    stopped: list[bool] = []
    for gen, gen_lp, gen_len, stop in pieces:
        for j in range(gen.shape[0]):
            g = int(gen_len[j])
            gen_ids.append(gen[j, :g])
            gen_lps.append(gen_lp[j, :g])
            stopped.append(bool(stop[j]))
    return build_generation_output(ids_cpu, lengths, gen_ids, gen_lps, [not s for s in stopped], pad_id)


def build_generation_output(
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    generated: Sequence[Sequence[int] | torch.Tensor],
    generated_logprobs: Sequence[Sequence[float] | torch.Tensor],
    truncated: Sequence[bool],
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """Lay out per-row generations in NeMo-RL's output format (see ``interfaces``).

    ``output_ids [B, S + T]``: row ``i`` holds its ``input_lengths[i]`` prompt tokens, then its
    generated ids, then ``pad_token_id``; ``T`` is the longest generation. ``logprobs`` (float32)
    holds each generated token's logprob at its position, 0 elsewhere.
    """
    batch, width = input_ids.shape
    if not len(generated) == len(generated_logprobs) == len(truncated) == batch:
        raise ValueError(
            f"build_generation_output: {len(generated)} generations, {len(generated_logprobs)} logprob rows, "
            f"{len(truncated)} truncated flags for a batch of {batch}"
        )
    lengths = input_lengths.to(torch.long).cpu()
    gen_lengths = torch.tensor([len(g) for g in generated], dtype=torch.long)
    longest = int(gen_lengths.max()) if batch else 0
    out_ids = torch.full((batch, width + longest), int(pad_token_id), dtype=torch.long)
    out_lp = torch.zeros((batch, width + longest), dtype=torch.float32)
    for i in range(batch):
        n, g = int(lengths[i]), int(gen_lengths[i])
        if len(generated_logprobs[i]) != g:
            raise ValueError(f"build_generation_output: row {i} has {g} tokens but {len(generated_logprobs[i])} logprobs")
        out_ids[i, :n] = input_ids[i, :n]
        out_ids[i, n : n + g] = torch.as_tensor(generated[i], dtype=torch.long)
        out_lp[i, n : n + g] = torch.as_tensor(generated_logprobs[i], dtype=torch.float32)
    return {
        "output_ids": out_ids,
        "logprobs": out_lp,
        "generation_lengths": gen_lengths,
        "unpadded_sequence_lengths": lengths + gen_lengths,
        "truncated": torch.tensor(list(truncated), dtype=torch.bool),
    }


def merge_stop_strings(global_stops: list[str] | None, per_row: Any, batch: int) -> list[list[str]] | None:
    """Per-row stop strings: the configured ones plus the row's own (``data["stop_strings"]``)."""
    base = list(global_stops or [])
    if per_row is None:
        return [list(base) for _ in range(batch)] if base else None
    rows = list(per_row)
    if len(rows) != batch:
        raise ValueError(f"data['stop_strings'] has {len(rows)} entries for a batch of {batch}")
    merged = []
    for i, row in enumerate(rows):
        if row is None:
            merged.append(list(base))
        elif isinstance(row, str):
            raise TypeError(f"data['stop_strings'][{i}] must be a list of strings or None, got a str")
        else:
            merged.append(base + [s for s in row if s not in base])
    return merged


def sample_rows(
    model: Any, tokenizer_or_pad_id: Any, data: Mapping[str, Any], cfg: Any, *, greedy: bool = False,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`generate_batch` on one :class:`GenerationDatumSpec` shard (``input_ids``,
    ``input_lengths``, optional ``seeds`` and per-row ``stop_strings``) with the sampling settings of
    ``cfg`` (a :class:`~nrl_tasks.models.generation.interfaces.GenerationConfig`); the row's stop
    strings are added to ``cfg.stop_strings``. The one call the generation workers and the policy's
    colocated sampling share."""
    for key in ("input_ids", "input_lengths"):
        if key not in data:
            raise ValueError(f"generate: data is missing key {key!r}")
    input_ids = data["input_ids"]
    return generate_batch(
        model,
        tokenizer_or_pad_id,
        input_ids,
        data["input_lengths"],
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        stop_token_ids=cfg.stop_token_ids,
        stop_strings=merge_stop_strings(cfg.stop_strings, data.get("stop_strings"), int(input_ids.shape[0])),
        seeds=data.get("seeds"),
        greedy=greedy,
        ignore_eos=cfg.ignore_eos,
        pad_token_id=cfg.pad_token_id,
        max_batch_size=cfg.max_batch_size,
        generator=generator,
    )
