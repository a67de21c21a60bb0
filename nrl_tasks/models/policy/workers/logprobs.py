"""Token logprobs in NeMo-RL's layout, for padded micro-batches and packed sequences.

Layout: ``[B, S]`` right-padded; position 0 is 0; position ``i`` holds
``log p(token_i | tokens_<i)`` computed from ``logits / temperature``; positions at or past a
row's length are 0.

Right padding and causal attention: a valid position never attends to the padding after it, so
padded rows run without an attention mask (the logprobs of the valid positions are those of the
unpadded row).

Packing: the rows of a bin are concatenated into one ``[1, T]`` sequence whose ``position_ids``
restart at 0 for each row; transformers then builds a block-diagonal causal mask (a token sees
only earlier tokens of its own row), so every row gets the logprobs it would get alone.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "forward_logits",
    "last_token_scores",
    "length_mask",
    "next_token_logprobs",
    "packed_forward_logprobs",
    "padded_forward_logprobs",
]


def length_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, width]`` bool, True at positions ``< lengths[b]``."""
    return torch.arange(width, device=lengths.device).unsqueeze(0) < lengths.to(torch.long).unsqueeze(1)


def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B, S-1]`` float32: ``log softmax(logits[:, t] / T)[input_ids[:, t+1]]``.

    ``logits [B, S, V]`` (any float dtype; computed in float32), ``input_ids [B, S]``.
    """
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:].to(torch.long).unsqueeze(-1)
    picked = logits.gather(-1, targets).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def forward_logits(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``model(input_ids)`` logits without a KV cache (no attention mask: see module doc)."""
    kwargs: dict[str, Any] = {"use_cache": False}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    return model(input_ids=input_ids, **kwargs).logits


def last_token_scores(model: Any, input_ids: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` float32: a one-output sequence classifier's head (``model.score``, as in HF's
    ``*ForSequenceClassification``) at each right-padded row's last valid token.

    The model's own forward runs (so a wrapped model gathers its weights as always) while a hook
    keeps the head's per-token output: HF pools it at the last token that is not
    ``pad_token_id``, which drops a response's own end-of-sequence token when the tokenizer pads
    with it; here the row's length decides."""
    lengths = input_lengths.to(device=input_ids.device, dtype=torch.long)
    if int(lengths.min()) < 1:
        raise ValueError("every row needs input_lengths >= 1")
    per_token = head_outputs(model, input_ids)
    return per_token[torch.arange(input_ids.shape[0], device=input_ids.device), lengths - 1].float()


def head_outputs(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]``: a one-output sequence classifier's head (``model.score``) at every position, from
    the model's own forward (a hook keeps the head's output before HF pools it)."""
    kept: list[torch.Tensor] = []
    hook = model.score.register_forward_hook(lambda _m, _i, out: kept.append(out))
    try:
        model(input_ids=input_ids, use_cache=False)
    finally:
        hook.remove()
    return kept[-1][..., 0]


def token_values(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` float32: PPO's value of the state before each token ``t`` (the head at position
    ``t - 1``; position 0, which no token leads to, is 0), aligned with the logprobs' convention."""
    head = head_outputs(model, input_ids).float()
    return torch.cat([torch.zeros_like(head[:, :1]), head[:, :-1]], dim=1)


def padded_forward_logprobs(
    model: Any, input_ids: torch.Tensor, input_lengths: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Logprobs ``[B, S]`` (NeMo-RL layout) of a right-padded micro-batch."""
    batch, width = input_ids.shape
    out = torch.zeros(batch, width, dtype=torch.float32, device=input_ids.device)
    if batch == 0 or width < 2:
        return out
    logits = forward_logits(model, input_ids)
    lp = next_token_logprobs(logits, input_ids, temperature)
    mask = length_mask(input_lengths.to(input_ids.device), width)[:, 1:]
    out = torch.cat([out[:, :1], torch.where(mask, lp, torch.zeros_like(lp))], dim=1)
    return out


def packed_forward_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    temperature: float = 1.0,
    pad_multiple: int = 1,
) -> torch.Tensor:
    """Logprobs ``[B, S]`` of the rows of one bin, computed as one packed sequence.

    Each row contributes its first ``ceil(len / pad_multiple) * pad_multiple`` tokens (capped at
    ``S``); rows of length 0 contribute nothing and get all-zero logprobs.
    """
    batch, width = input_ids.shape
    out = torch.zeros(batch, width, dtype=torch.float32, device=input_ids.device)
    lengths = [int(n) for n in input_lengths.tolist()]
    spans: list[tuple[int, int, int]] = []  # (row, start in packed, tokens)
    pieces, positions = [], []
    cursor = 0
    for row, n in enumerate(lengths):
        if n <= 0:
            continue
        take = min(width, -(-n // pad_multiple) * pad_multiple)
        pieces.append(input_ids[row, :take])
        positions.append(torch.arange(take, device=input_ids.device))
        spans.append((row, cursor, n))
        cursor += take
    if cursor < 2:
        return out
    packed = torch.cat(pieces).unsqueeze(0)
    position_ids = torch.cat(positions).unsqueeze(0)
    logits = forward_logits(model, packed, position_ids)
    lp = next_token_logprobs(logits, packed, temperature)[0]  # lp[t - 1] = log p(packed[t] | ...)
    rows_out = []
    for row, start, n in spans:
        if n >= 2:
            rows_out.append((row, lp[start : start + n - 1]))
    if not rows_out:
        return out
    # assemble without in-place writes into a tensor that needs grad
    result_rows = [out[r] for r in range(batch)]
    for row, values in rows_out:
        n = values.shape[0] + 1
        result_rows[row] = torch.cat([out[row, :1], values, out[row, n:]])
    return torch.stack(result_rows)
