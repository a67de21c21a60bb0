"""``dynamic_sampling`` stage (DAPO): the step's ``prompts``, ``rewards`` and ``rollouts`` from its
generation batches.

With ``grpo.use_dynamic_sampling`` the data stages of a step read (:func:`flows.algorithms.step.data_stages`)::

    for j in 0, 1, ...:                       # until num_prompts_per_step groups have reward variance
        p[j] = prompts(ctx_j); r[j] = generate(ctx_j, p[j], v); s[j] = score(ctx_j, r[j])
    sampled = dynamic_sampling(ctx, p, r, s)  # the step's prompts, rewards, rollouts
    logprobs = logprob(ctx, sampled["rollouts"], v); ...    # as without dynamic sampling

``ctx_j`` is the step's generation-batch context (``ctx.gen_batch_ctx(j)``, datasets under
``steps/step_N/gen_batches/<j>/``). This stage picks the groups
(:func:`nrl_tasks.algorithms.dynamic_sampling.select_groups`), renumbers their ``group_id``
``0 .. num_prompts_per_step - 1`` and commits the step's three datasets (``rollouts`` last: a step
whose ``rollouts`` are committed has all three). What follows reads the step's datasets exactly as
without dynamic sampling, so logprob, train, replay, retention and the resume plan need nothing
new. Like every stage it is idempotent: the selection is a pure function of the committed
generation batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from prefect import task

import storage
from nrl_tasks.algorithms.dynamic_sampling import groups_with_signal, select_groups
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.context import StepContext
from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, committed_ref, save_output

__all__ = ["SAMPLED", "dynamic_sampling", "sampled_refs"]

#: the step datasets this stage commits, in commit order
SAMPLED: tuple[str, ...] = ("prompts", "rewards", "rollouts")


def sampled_refs(ctx: StepContext) -> dict[str, DatasetRef] | None:
    """The step's committed sampled datasets, or ``None`` unless all three are committed."""
    run = ctx.run
    refs = {d: committed_ref(ctx.uri(d), run.storage_options) for d in SAMPLED}
    return refs if all(r is not None for r in refs.values()) else None


def _check(ctx: StepContext, name: str, refs: Sequence[DatasetRef]) -> None:
    for j, ref in enumerate(refs):
        if not isinstance(ref, DatasetRef) or ref.step != ctx.step or ref.stage != name:
            raise ValueError(f"dynamic_sampling of step {ctx.step} was handed {ref!r} as generation batch {j}'s {name!r}")


def _take(batches: Sequence[BatchedDataDict], picked: Sequence[tuple[int, int]], group_ids: Sequence[torch.Tensor],
          size: int) -> BatchedDataDict:
    """Rows of the picked groups in order, ``group_id`` renumbered when the batch has one."""
    parts = []
    for new_id, (j, g) in enumerate(picked):
        rows = torch.nonzero(group_ids[j] == g).flatten()
        part = batches[j].select_indices(rows)
        if "group_id" in part:
            part["group_id"] = torch.full((len(rows),), new_id, dtype=torch.int64)
        parts.append(part)
    out = BatchedDataDict.from_batches(parts)
    if out.size != size:
        raise AssertionError(f"dynamic sampling assembled {out.size} rows, expected {size}")
    return out


def _sum(refs: Sequence[DatasetRef], key: str) -> float:
    return float(sum(r.get(key) or 0.0 for r in refs))


@task(name="dynamic_sampling", task_run_name="dynamic_sampling-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def dynamic_sampling(
    ctx: StepContext, prompts: list[DatasetRef], rollouts: list[DatasetRef], rewards: list[DatasetRef]
) -> dict[str, DatasetRef]:
    """Commit the step's ``prompts``, ``rewards`` and ``rollouts`` from generation batches
    ``0 .. len(rollouts) - 1`` (see the module docstring); raises
    :class:`~nrl_tasks.algorithms.dynamic_sampling.DynamicSamplingError` when too few groups qualify."""

    run, cfg = ctx.run, ctx.cfg
    done = sampled_refs(ctx)
    if done is not None:
        return done
    for name, refs in (("prompts", prompts), ("rollouts", rollouts), ("rewards", rewards)):
        _check(ctx, name, refs)
    if not (len(prompts) == len(rollouts) == len(rewards) >= 1):
        raise ValueError(f"dynamic_sampling of step {ctx.step}: {len(prompts)} prompts, {len(rollouts)} rollouts and "
                         f"{len(rewards)} rewards batches")
    attempt = run.count_attempt(ctx.step, "dynamic_sampling")
    try:
        ctx.emit("dynamic_sampling", "start")
        loaded = {name: [storage.load_batch(r.uri, **ctx.storage_kw) for r in refs]
                  for name, refs in (("prompts", prompts), ("rollouts", rollouts), ("rewards", rewards))}
        gids = [b["group_id"] for b in loaded["rollouts"]]
        signal = [groups_with_signal(s["rewards"], s["reward_valid"], g) for s, g in zip(loaded["rewards"], gids)]
        num_groups, group = cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt
        sel = select_groups(signal, [len(torch.unique(g)) for g in gids], num_groups)
        out = {name: _take(batches, sel.picked, gids, num_groups * group) for name, batches in loaded.items()}
        ctx.emit("dynamic_sampling", "computed")
        all_r = torch.cat([s["rewards"][s["reward_valid"].bool()] for s in loaded["rewards"]]).double()
        sel_r, sel_ok = out["rewards"]["rewards"], out["rewards"]["reward_valid"].bool()
        gen_s = _sum(rollouts, "generate_seconds")
        new_tokens = int(_sum(rollouts, "new_tokens"))
        figures = {
            "prompts": {"seconds": _sum(prompts, "seconds")},
            "rewards": {
                "seconds": _sum(rewards, "seconds"), "reward_mean": float(sel_r[sel_ok].double().mean()),
                "invalid_rewards": int((~sel_ok).sum()),
                "unfiltered_reward_mean": float(all_r.mean()) if all_r.numel() else None,
            },
            "rollouts": {
                "seconds": _sum(rollouts, "seconds"), "generate_seconds": gen_s, "new_tokens": new_tokens,
                "tokens_per_s": new_tokens / max(gen_s, 1e-9),
                "truncated_frac": float(out["rollouts"]["truncated"].float().mean()),
                "dynamic_sampling_num_gen_batches": sel.gen_batches,
                "dynamic_sampling_num_discarded_valid_samples": sel.surplus_groups * group,
                "dynamic_sampling_zero_std_groups": sel.zero_std_groups,
            },
        }
        versions = {"prompts": None, "rewards": None, "rollouts": rollouts[0].weights_version}
        refs = {}
        for name in SAMPLED:  # a crash between commits: the next run commits the rest, identically
            ref = committed_ref(ctx.uri(name), run.storage_options)
            if ref is None:
                ref = save_output(
                    out[name], ctx.uri(name), run_id=run.run_id, step=ctx.step, stage=name,
                    weights_version=versions[name], storage_options=run.storage_options, fsync=run.fsync,
                    attempts=attempt, sampled_from=len(rollouts), **figures[name],
                )
            refs[name] = ref
        ctx.emit("dynamic_sampling", "committed")
    except BaseException:
        run.last_failure = (ctx.step, "dynamic_sampling")
        raise
    # the step's generate attempts: the most any generation batch needed
    refs["rollouts"] = refs["rollouts"].with_attempts(max(r.attempts for r in rollouts))
    return refs
