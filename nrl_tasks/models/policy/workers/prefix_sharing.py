"""Token logprobs of a micro-batch whose rows share prompts, with each prompt run once.

GRPO trains on ``num_generations_per_prompt`` completions of every prompt, so most rows of a
micro-batch start with the same tokens (a chat template's system line and the question). The
causal model's hidden states at a position depend only on the tokens up to it, so the rows of a
prompt share them up to the prompt's end: :func:`shared_prefix_logprobs` runs each distinct
prompt once (``[G, P]``), keeps its keys and values as a KV cache, repeats the cache for the
rows of that prompt and runs only the rows' own tokens (``[B, S - P]``) on top of it. The
gradient flows through the cache back into the prompt pass, where the rows' contributions
add up (the backward of the repeat), so loss and gradient equal a full forward's in exact
arithmetic; in float32 they agree to rounding (the attention sums split differently).

The result has the layout of :func:`~.logprobs.padded_forward_logprobs` (``[B, S]``, position
``i`` holds ``log p(token_i | tokens_<i)``, 0 at position 0 and at or past a row's length) and
holds a value at every position, prompt positions included, unless ``prompt_logprobs=False``:
then (the train path, whose loss reads only ``token_mask`` positions) the prompt passes compute
the LM head only at each prompt's last position (HF's ``logits_to_keep``; the head is ~20% of
SmolLM2's FLOPs a token and its logits the largest activations), and a row's positions before its
first own token hold 0. A loss cannot meet NaN there: the losses zero the stored columns at
masked positions, so the ratio there is ``exp(0 - 0)``.

``prefix_lengths[b]`` is how many leading tokens row ``b`` may share: its prompt, i.e. the
position of its first loss token (``token_mask``). Rows group by their prefix's tokens; a row
whose prompt no other row has is its own group. The start all the prompts have in common (a
chat template's system line and turn header, ``common_length``) runs once before them, for
all of them, when the micro-batch holds at least :data:`MIN_COMMON_PROMPTS` prompts.
:func:`prefix_plan` returns ``None`` when nothing would be saved (no prompt shared) so the
caller runs the plain forward.

Not used with packed sequences (their rows already run as one sequence) nor with a model that
FSDP2 wraps (there every rank must run the same number of forwards; see ``PolicyWorker``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nrl_tasks.models.generation.hf_sampling import cache_keyword, forward_parameters, new_cache
from nrl_tasks.models.policy.workers.logprobs import next_token_logprobs

#: the prompts' common start runs as its own pass from this many tokens and this many prompts
#: on: with 2 prompts of SmolLM2's chat template (a 27-token common start) the extra pass cost
#: more than it saved (train 6.0-6.3 s vs 5.2-5.5 s a step), with 8 prompts it saved 10-20%
MIN_COMMON_TOKENS = 4
MIN_COMMON_PROMPTS = 4

__all__ = [
    "MIN_COMMON_PROMPTS",
    "MIN_COMMON_TOKENS",
    "PrefixPlan",
    "prefix_lengths_from_mask",
    "prefix_plan",
    "shared_prefix_logprobs",
]


@dataclass(frozen=True)
class PrefixPlan:
    """Which rows share which prompt: ``group_of_row [B]`` indexes ``prefixes``, each
    ``(first row, prefix length)``; ``lengths`` are the rows' lengths."""

    group_of_row: list[int]
    prefixes: list[tuple[int, int]]
    lengths: list[int]
    common_length: int = 0

    @property
    def tokens_saved(self) -> int:
        """Prompt tokens not run again: sum over rows of their prefix minus one run per prompt
        (and the prompts' common start run once)."""
        per_row = sum(self.prefixes[g][1] for g in self.group_of_row)
        return per_row - sum(p for _, p in self.prefixes) + self.common_length * max(0, len(self.prefixes) - 1)


def prefix_lengths_from_mask(token_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's first position with ``token_mask > 0`` (its prompt length), or its
    length when it has none."""
    on = token_mask > 0
    return torch.where(on.any(dim=1), on.to(torch.int8).argmax(dim=1), lengths.to(torch.long))


def prefix_plan(input_ids: torch.Tensor, lengths: torch.Tensor, prefix_lengths: torch.Tensor) -> PrefixPlan | None:
    """Group the rows of ``input_ids [B, S]`` by their first ``prefix_lengths`` tokens.

    A row's prefix is clamped to ``[1, length - 1]`` (at least one token of its own after it).
    ``None`` when a row is shorter than 2 tokens or no two rows share a prefix.
    """
    ids = input_ids.cpu()
    lens = [int(n) for n in lengths.tolist()]
    if not lens or min(lens) < 2:
        return None
    groups: dict[tuple[int, ...], int] = {}
    prefixes: list[tuple[int, int]] = []
    group_of_row: list[int] = []
    for row, (n, p) in enumerate(zip(lens, prefix_lengths.tolist())):
        p = max(1, min(int(p), n - 1))
        key = tuple(ids[row, :p].tolist())
        if key not in groups:
            groups[key] = len(prefixes)
            prefixes.append((row, p))
        group_of_row.append(groups[key])
    if len(prefixes) == len(lens):
        return None
    return PrefixPlan(group_of_row, prefixes, lens, _common_length(ids, prefixes))


def _common_length(ids: torch.Tensor, prefixes: list[tuple[int, int]]) -> int:
    """Leading tokens all the prompts have, leaving each at least one of its own; 0 when there
    are fewer than :data:`MIN_COMMON_PROMPTS` prompts or :data:`MIN_COMMON_TOKENS` in common."""
    if len(prefixes) < MIN_COMMON_PROMPTS:
        return 0
    limit = min(p for _, p in prefixes) - 1
    rows = ids[[row for row, _ in prefixes], :limit]
    same = (rows == rows[:1]).all(dim=0)
    common = int(same.to(torch.int8).argmin()) if not bool(same.all()) else limit
    return common if common >= MIN_COMMON_TOKENS else 0


def shared_prefix_logprobs(
    model: Any, input_ids: torch.Tensor, plan: PrefixPlan, temperature: float = 1.0, *, prompt_logprobs: bool = True
) -> torch.Tensor:
    """Logprobs ``[B, S]`` (the layout of ``padded_forward_logprobs``) with each prompt run once;
    ``prompt_logprobs=False``: 0 at the prompt positions, whose logits are not computed (see the
    module docstring)."""
    device = input_ids.device
    batch, width = input_ids.shape
    groups = len(plan.prefixes)
    prefix_len = [p for _, p in plan.prefixes]
    row_prefix = [prefix_len[g] for g in plan.group_of_row]
    p_max = max(prefix_len)
    s_max = max(n - p for n, p in zip(plan.lengths, row_prefix))

    # the prompts, right-padded (causal: a valid position never sees the padding after it)
    prefix_ids = torch.zeros(groups, p_max, dtype=torch.long, device=device)
    for g, (row, p) in enumerate(plan.prefixes):
        prefix_ids[g, :p] = input_ids[row, :p]
    cache_kw = cache_keyword(model)
    cache = new_cache(model)
    common = plan.common_length
    last_pos = torch.tensor(prefix_len, device=device) - 1  # [G] each prompt's last position
    # without prompt logprobs, logits only at the prompts' last positions (``keep``, ascending)
    keep = torch.unique(last_pos) if not prompt_logprobs and "logits_to_keep" in forward_parameters(model) else None
    if common:
        # the start every prompt has (a chat template's system line) runs once for all of them
        head = model(input_ids=prefix_ids[:1, :common], use_cache=True, **{cache_kw: cache},
                     **({} if keep is None else {"logits_to_keep": 1})).logits
        cache.batch_select_indices(torch.zeros(groups, dtype=torch.long, device=device))
        position_ids = torch.arange(common, p_max, device=device).unsqueeze(0).expand(groups, -1)
        tail = model(input_ids=prefix_ids[:, common:], position_ids=position_ids, use_cache=True,
                     **{cache_kw: cache}, **({} if keep is None else {"logits_to_keep": keep - common})).logits
        pre_logits = tail if keep is not None else torch.cat([head.expand(groups, -1, -1), tail], dim=1)
    else:
        pre_logits = model(input_ids=prefix_ids, use_cache=True, **{cache_kw: cache},
                           **({} if keep is None else {"logits_to_keep": keep})).logits
    # every row gets its prompt's keys and values (the backward sums the rows' gradients)
    cache.batch_select_indices(torch.tensor(plan.group_of_row, device=device))

    # the rows' own tokens after their prompts, at their true positions, masking the padding
    # between a shorter prompt and the longest one
    own_ids = torch.zeros(batch, s_max, dtype=torch.long, device=device)
    mask = torch.ones(batch, p_max + s_max, dtype=torch.long, device=device)
    for row, (n, p) in enumerate(zip(plan.lengths, row_prefix)):
        own_ids[row, : n - p] = input_ids[row, p:n]
        mask[row, p:p_max] = 0
    position_ids = torch.tensor(row_prefix, device=device).unsqueeze(1) + torch.arange(s_max, device=device)
    own_logits = model(
        input_ids=own_ids, attention_mask=mask, position_ids=position_ids, use_cache=True, **{cache_kw: cache}
    ).logits

    # each pass scores its own next tokens; a row's first own token is predicted by its
    # prompt's last position
    if prompt_logprobs:
        pre_lp = next_token_logprobs(pre_logits, prefix_ids, temperature)  # [G, P - 1]
    else:
        pre_lp = pre_logits.new_zeros(groups, p_max - 1, dtype=torch.float32)
    # with ``keep``, pre_logits is [G, len(keep), V]: a prompt's last position is its column in keep
    column = last_pos if keep is None else torch.searchsorted(keep, last_pos)
    rows_group = torch.tensor(plan.group_of_row, device=device)
    last = pre_logits[rows_group, column[rows_group]]
    own_lp = next_token_logprobs(own_logits, own_ids, temperature)  # [B, s - 1]
    bridge = torch.log_softmax(last.float() / temperature, dim=-1).gather(-1, own_ids[:, :1]).squeeze(-1)  # [B]

    # assemble [B, S] by indexing one flat vector: [pre_lp | bridge | own_lp | 0]
    flat = torch.cat([pre_lp.reshape(-1), bridge, own_lp.reshape(-1), pre_lp.new_zeros(1)])
    zero_at = flat.numel() - 1
    index = torch.full((batch, width), zero_at, dtype=torch.long)
    bridge_at, own_at = pre_lp.numel(), pre_lp.numel() + batch
    for row, (n, p) in enumerate(zip(plan.lengths, row_prefix)):
        g = plan.group_of_row[row]
        index[row, 1:p] = g * (p_max - 1) + torch.arange(p - 1)  # prompt tokens 1..p-1
        index[row, p] = bridge_at + row
        index[row, p + 1 : n] = own_at + row * (s_max - 1) + torch.arange(n - p - 1)
    return flat[index.to(device)]
