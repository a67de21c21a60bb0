"""DAPO's dynamic sampling: train only on prompt groups whose rewards differ, sampling more until
the batch is full.

Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (arXiv 2503.14476),
section 3.2: a group whose ``G`` rewards are all equal (all right or all wrong) has zero advantage
under any group baseline, so it adds nothing to the policy gradient but still dilutes the batch.
DAPO over-samples and keeps only groups with ``0 < #correct < G``, generating further batches until
``num_prompts_per_step`` groups qualify. With NeMo-RL's keys:

- ``grpo.use_dynamic_sampling``: on/off;
- ``grpo.batch_multiplier``: each generation batch draws ``batch_multiplier * num_prompts_per_step``
  prompts;
- ``grpo.dynamic_sampling_max_gen_batches``: at most this many generation batches per step; a step
  that still lacks groups then fails with :class:`DynamicSamplingError` naming the keys.

The qualifying groups are taken in generation order (batch 0 first, then by prompt index) and the
first ``num_prompts_per_step`` of them form the step's batch; their ``group_id`` is renumbered
``0 .. num_prompts_per_step - 1``. Metrics (NeMo-RL's names): ``dynamic_sampling_num_gen_batches``
and ``dynamic_sampling_num_discarded_valid_samples`` (samples of qualifying groups beyond the
batch), plus ``dynamic_sampling_zero_std_groups`` and ``unfiltered_reward_mean`` (over everything
generated).

Deviations from NeMo-RL, on purpose:

1. **Whole groups.** NeMo-RL masks rows whose per-row reward std is zero; with its leave-one-out
   std that can keep three rows of a group of four and drop one. Here a group qualifies as a
   whole when its valid rewards are not all equal (max > min); rows with an invalid reward count
   as absent, and a group with fewer than two valid rewards does not qualify.
2. **Prompt draws are a pure function of (seed, step, generation batch).** NeMo-RL pulls extra
   batches from the same dataloader, so one step's extra batches shift the prompts of every later
   step. Here batch 0 of step ``s`` takes the ``s``-th block of ``batch_multiplier *
   num_prompts_per_step`` prompts of the run's prompt order, and batch ``j >= 1`` a block of its
   own permutation seeded by ``(seed, step, j)``: a regenerated or resumed step draws exactly the
   prompts it drew before, without knowing what earlier steps needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "DynamicSamplingError",
    "GroupSelection",
    "groups_with_signal",
    "select_groups",
]


class DynamicSamplingError(ValueError):
    """Too few groups with reward variance after the last allowed generation batch."""


def groups_with_signal(rewards: torch.Tensor, valid: torch.Tensor, group_id: torch.Tensor) -> list[int]:
    """The group ids (ascending) whose valid rewards are not all equal.

    >>> r = torch.tensor([1., 0., 1., 1., 0., 0., 2., 2.])
    >>> v = torch.tensor([True, True, True, True, True, True, True, False])
    >>> groups_with_signal(r, v, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
    [0]
    """
    out = []
    for g in torch.unique(group_id).tolist():
        rows = (group_id == g) & valid.bool()
        vals = rewards[rows]
        if vals.numel() >= 2 and bool(vals.max() > vals.min()):
            out.append(int(g))
    return out


@dataclass(frozen=True)
class GroupSelection:
    """Which groups of which generation batch form the step's batch."""

    #: ``(gen batch index, group id)`` in the order they enter the batch
    picked: tuple[tuple[int, int], ...]
    #: qualifying groups left out because the batch was full
    surplus_groups: int
    #: groups dropped for zero reward variance
    zero_std_groups: int
    #: generation batches looked at
    gen_batches: int


def select_groups(signal: Sequence[Sequence[int]], groups_per_batch: Sequence[int], num_groups: int) -> GroupSelection:
    """Pick the first ``num_groups`` qualifying groups over generation batches in order.

    ``signal[j]``: qualifying group ids of batch ``j`` (:func:`groups_with_signal`);
    ``groups_per_batch[j]``: how many groups batch ``j`` has. Raises
    :class:`DynamicSamplingError` when fewer than ``num_groups`` qualify.

    >>> s = select_groups([[1, 3], [0, 2, 3]], [4, 4], 3)
    >>> s.picked, s.surplus_groups, s.zero_std_groups
    (((0, 1), (0, 3), (1, 0)), 2, 3)
    """
    pool = [(j, g) for j, ids in enumerate(signal) for g in ids]
    if len(pool) < num_groups:
        raise DynamicSamplingError(
            f"dynamic sampling found {len(pool)} of the {num_groups} groups with reward variance it needs "
            f"(grpo.num_prompts_per_step) in {len(signal)} generation batch(es) "
            "(grpo.dynamic_sampling_max_gen_batches): raise grpo.dynamic_sampling_max_gen_batches or "
            "grpo.batch_multiplier, or use easier prompts or more grpo.num_generations_per_prompt"
        )
    zero = sum(n - len(ids) for n, ids in zip(groups_per_batch, signal))
    return GroupSelection(tuple(pool[:num_groups]), len(pool) - num_groups, zero, len(signal))
