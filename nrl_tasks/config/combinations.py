"""Cross-section checks of the run config: keys valid alone that do not go together. Called by
:class:`nrl_tasks.config.master.MasterConfig`'s validator; every message names the keys involved."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nrl_tasks.config.bounds import MAX_ROWS

if TYPE_CHECKING:
    from nrl_tasks.config.master import MasterConfig

__all__ = ["combination_errors"]


def _algorithm_errors(cfg: "MasterConfig") -> list[str]:
    """The algorithm menu's combinations (loss, advantages, reward shaping, async GRPO)."""
    errs: list[str] = []
    batch = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    if cfg.loss_fn.force_on_policy_ratio and cfg.policy.train_global_batch_size != batch:
        errs.append(
            "loss_fn.force_on_policy_ratio needs one optimizer step per rollout batch: policy.train_global_batch_size "
            f"({cfg.policy.train_global_batch_size}) must equal grpo.num_prompts_per_step * "
            f"grpo.num_generations_per_prompt ({batch})"
        )
    shaping = cfg.grpo.reward_shaping
    shaping_gen = cfg.generation or getattr(cfg.policy, "generation", None)
    if shaping.enabled and shaping.max_response_length is None and shaping_gen is not None:
        if shaping.overlong_buffer_length > shaping_gen.max_new_tokens:
            errs.append(
                f"grpo.reward_shaping.overlong_buffer_length ({shaping.overlong_buffer_length}) exceeds "
                f"generation.max_new_tokens ({shaping_gen.max_new_tokens}), the default max_response_length"
            )
    if cfg.loss_fn.use_kl_in_reward and cfg.grpo.adv_estimator.name != "reinforce_plus_plus":
        errs.append(
            "loss_fn.use_kl_in_reward needs grpo.adv_estimator.name=reinforce_plus_plus (the estimator that puts the "
            f"KL into the reward; got {cfg.grpo.adv_estimator.name!r})"
        )
    if cfg.grpo.async_grpo.enabled and not cfg.loss_fn.use_importance_sampling_correction:
        errs.append(
            "grpo.async_grpo.enabled needs loss_fn.use_importance_sampling_correction=true (rollouts come from "
            "older weights than the ones trained)"
        )
    grpo = cfg.grpo
    if grpo.use_dynamic_sampling and grpo.async_grpo.enabled:
        errs.append(
            "grpo.use_dynamic_sampling does not go with grpo.async_grpo.enabled (a step's extra generation batches "
            "depend on its rewards, which async GRPO has not scored when it submits the next generation)"
        )
    if not grpo.use_dynamic_sampling and grpo.batch_multiplier != 1:
        errs.append(f"grpo.batch_multiplier ({grpo.batch_multiplier}) is only used with grpo.use_dynamic_sampling=true")
    if grpo.max_rollout_turns > 1 and cfg.env.environment is None:
        errs.append(f"grpo.max_rollout_turns = {grpo.max_rollout_turns} needs env.environment (who answers the turns)")
    rows = grpo.batch_multiplier * grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    if grpo.use_dynamic_sampling and rows > MAX_ROWS:
        errs.append(
            f"grpo.batch_multiplier * grpo.num_prompts_per_step * grpo.num_generations_per_prompt = {rows} rollouts "
            f"per generation batch exceeds {MAX_ROWS}"
        )
    return errs


def _supervised_errors(cfg: "MasterConfig") -> list[str]:
    """A DPO, SFT or RM run (``dpo`` / ``sft`` / ``rm`` set): no generation needed; DPO's and RM's
    batch sizes count pairs. RM trains a reward model: ``policy.reward_model_cfg.enabled``, one
    policy worker (data-parallel reward-model training is not built), padded micro-batches."""
    errs = []
    name = "dpo" if cfg.dpo is not None else "rm" if cfg.rm is not None else "sft"
    unit = " pairs" if name in ("dpo", "rm") else ""
    gbs, mbs, dp = cfg.policy.train_global_batch_size, cfg.policy.train_micro_batch_size, cfg.cluster.policy_workers
    if gbs % (mbs * dp):
        errs.append(
            f"policy.train_global_batch_size = {gbs}{unit} is not a multiple of policy.train_micro_batch_size * "
            f"cluster.policy_workers = {mbs} * {dp}"
        )
    if cfg.grpo.async_grpo.enabled or cfg.grpo.use_dynamic_sampling:
        errs.append(f"{name} does not use grpo.async_grpo.enabled or grpo.use_dynamic_sampling (GRPO options)")
    if cfg.dpo is not None and cfg.dpo.preference_loss_weight == 0 and cfg.dpo.sft_loss_weight == 0:
        errs.append(
            "dpo.preference_loss_weight and dpo.sft_loss_weight are both 0: the loss would be 0 and nothing would "
            "train (set one of them > 0)"
        )
    rm = cfg.policy.reward_model_cfg.enabled
    if name == "rm":
        if not rm:
            errs.append("rm: a reward-model run trains a sequence classifier: set policy.reward_model_cfg.enabled=true "
                        "(NeMo-RL's rm.yaml does)")
        if cfg.cluster.policy_workers != 1:
            errs.append(f"rm with cluster.policy_workers = {cfg.cluster.policy_workers}: data-parallel reward-model "
                        "training is not built yet (use 1)")
        if cfg.policy.sequence_packing.enabled or cfg.policy.dynamic_batching.enabled:
            errs.append("rm: policy.sequence_packing / policy.dynamic_batching are not built for reward models "
                        "(padded micro-batches)")
    elif rm:
        errs.append(f"policy.reward_model_cfg.enabled with a {name.upper()} run: only `nrl rm` trains a reward model "
                    "(GRPO scores with one through env.reward_model)")
    return errs


def _distillation_errors(cfg: "MasterConfig") -> list[str]:
    """An on-policy distillation run (``distillation`` set): a teacher, distillation's loss keys,
    GRPO's options off, padded micro-batches (the loss reads the student's whole logits: dynamic
    batching, not packing)."""
    from nrl_tasks.algorithms.distillation import DistillationLossConfig

    errs = []
    if cfg.teacher is None:
        errs.append("distillation needs a `teacher` section (the teacher's policy config: teacher.model_name at least)")
    elif cfg.teacher.reward_model_cfg.enabled or cfg.policy.reward_model_cfg.enabled:
        errs.append("distillation: teacher and student are causal LMs (drop reward_model_cfg.enabled)")
    if not isinstance(cfg.loss_fn, DistillationLossConfig):
        keys = sorted(cfg.loss_fn.model_fields_set)
        errs.append(f"distillation reads loss_fn.kl_type, mixed_kl_weight and zero_outside_topk; loss_fn.{keys[0]} is a "
                    "GRPO key" if keys else "distillation: loss_fn is not distillation's")
    if cfg.grpo.async_grpo.enabled or cfg.grpo.use_dynamic_sampling:
        errs.append("distillation does not use grpo.async_grpo.enabled or grpo.use_dynamic_sampling (GRPO options)")
    if cfg.policy.sequence_packing.enabled:
        errs.append("distillation: policy.sequence_packing is not built for its loss (it reads the student's whole "
                    "logits of padded rows; policy.dynamic_batching works)")
    d = cfg.distillation
    if d is not None and d.max_rollout_turns > 1 and cfg.env.environment is None:
        errs.append(f"distillation.max_rollout_turns = {d.max_rollout_turns} needs env.environment (who answers the turns)")
    return errs


def _ppo_errors(cfg: "MasterConfig") -> list[str]:
    """A PPO run (``ppo`` set): GRPO's loss (``loss_fn``) and the generation checks apply; what is
    not built for PPO is refused naming its key (see :mod:`nrl_tasks.config.ppo`)."""
    from nrl_tasks.algorithms.loss_functions import ClippedPGLossConfig

    p, errs = cfg.ppo, []
    if not isinstance(cfg.loss_fn, ClippedPGLossConfig):
        return ["ppo trains the policy with loss_fn's clipped policy gradient (GRPO's keys), not distillation's"]
    for key, on in (("ppo.async_ppo.enabled", p.async_ppo.enabled), ("ppo.use_dynamic_sampling", p.use_dynamic_sampling),
                    ("ppo.overlong_filtering", p.overlong_filtering),
                    ("ppo.seq_logprob_error_threshold", p.seq_logprob_error_threshold is not None),
                    ("grpo.async_grpo.enabled", cfg.grpo.async_grpo.enabled),
                    ("grpo.use_dynamic_sampling", cfg.grpo.use_dynamic_sampling)):
        if on:
            errs.append(f"{key}: not built for PPO here (synchronous PPO with GAE; set it off)")
    if p.batch_multiplier != 1:
        errs.append(f"ppo.batch_multiplier ({p.batch_multiplier}) is only used with ppo.use_dynamic_sampling")
    kl = cfg.loss_fn.reference_policy_kl_penalty > 0
    if kl and p.skip_reference_policy_logprobs_calculation:
        errs.append("ppo.skip_reference_policy_logprobs_calculation with loss_fn.reference_policy_kl_penalty > 0: the KL "
                    "term reads the reference policy's logprobs (skip them only without it)")
    if cfg.loss_fn.force_on_policy_ratio:
        errs.append("loss_fn.force_on_policy_ratio does not go with PPO's ppo_epochs passes over a batch")
    if cfg.cluster.policy_workers != 1:
        errs.append(f"ppo with cluster.policy_workers = {cfg.cluster.policy_workers}: the value model's data-parallel "
                    "training is not built yet (use 1)")
    if cfg.value is not None and cfg.value.sequence_packing.enabled:
        errs.append("value.sequence_packing.enabled: packing is not built for the value model's per-token head "
                    "(dynamic batching works; the policy may pack)")
    if cfg.policy.reward_model_cfg.enabled or (cfg.value is not None and cfg.value.reward_model_cfg.enabled
                                               and cfg.value.reward_model_cfg.reward_model_type != "regression"):
        errs.append("ppo: the policy is a causal LM and the value model a regression head (value.reward_model_cfg."
                    "reward_model_type: regression)")
    if p.max_rollout_turns > 1 and cfg.env.environment is None:
        errs.append(f"ppo.max_rollout_turns = {p.max_rollout_turns} needs env.environment (who answers the turns)")
    if p.policy_training_start_step >= p.max_num_steps:
        errs.append(f"ppo.policy_training_start_step ({p.policy_training_start_step}) >= ppo.max_num_steps "
                    f"({p.max_num_steps}): the policy would never train")
    return errs


def combination_errors(cfg: "MasterConfig") -> list[str]:
    """Every problem of keys that are valid alone but not together (each message names the keys)."""
    if cfg.dpo is not None or cfg.sft is not None or cfg.rm is not None:
        return _supervised_errors(cfg)
    if cfg.distillation is not None:
        errs = _distillation_errors(cfg)
    elif cfg.ppo is not None:
        errs = _ppo_errors(cfg)
    else:
        errs = _algorithm_errors(cfg)
    pol_gen = getattr(cfg.policy, "generation", None)
    if cfg.generation is None and pol_gen is None:
        errs.append("generation: missing (set `generation` or `policy.generation`)")
        return errs
    if cfg.generation is not None and pol_gen is not None and cfg.generation != pol_gen:
        errs.append("generation and policy.generation are both set and differ: set only one")
    gen = cfg.generation or pol_gen
    r, sec = cfg.rollout, cfg.rollout_section
    b = r.num_prompts_per_step * r.num_generations_per_prompt
    gbs, mbs = cfg.policy.train_global_batch_size, cfg.policy.train_micro_batch_size
    dp = cfg.cluster.policy_workers
    if b > MAX_ROWS:
        errs.append(
            f"{sec}.num_prompts_per_step * {sec}.num_generations_per_prompt = {b} rollouts per step exceeds {MAX_ROWS}"
        )
    if b % gbs:
        errs.append(
            f"{sec}.num_prompts_per_step * {sec}.num_generations_per_prompt = {b} is not a multiple of "
            f"policy.train_global_batch_size = {gbs}"
        )
    if gbs % (mbs * dp):
        errs.append(
            f"policy.train_global_batch_size = {gbs} is not a multiple of policy.train_micro_batch_size * "
            f"cluster.policy_workers = {mbs} * {dp}"
        )
    if gen.max_new_tokens >= cfg.policy.max_total_sequence_length:
        errs.append(
            f"generation.max_new_tokens = {gen.max_new_tokens} leaves no room for the prompt in "
            f"policy.max_total_sequence_length = {cfg.policy.max_total_sequence_length}"
        )
    elif cfg.data.max_input_seq_length is not None and (
        cfg.data.max_input_seq_length + gen.max_new_tokens > cfg.policy.max_total_sequence_length
    ):
        errs.append(
            f"data.max_input_seq_length + generation.max_new_tokens = "
            f"{cfg.data.max_input_seq_length + gen.max_new_tokens} exceeds policy.max_total_sequence_length = "
            f"{cfg.policy.max_total_sequence_length}"
        )
    if (r.val_period or r.val_at_end) and cfg.data.dataset == "file" and not (
            cfg.data.val_path or cfg.data.split_validation_size):
        errs.append(f"{sec}.val_period > 0 (or {sec}.val_at_end) with data.dataset 'file' needs data.val_path "
                    "(or data.split_validation_size)")
    if getattr(gen, "backend", "hf") == "vllm" and cfg.cluster.gpus_per_node == 0:
        errs.append("generation.backend 'vllm' needs cluster.gpus_per_node >= 1 (use 'hf' on CPU)")
    return errs + _colocation_errors(cfg, gen)


def _colocation_errors(cfg: "MasterConfig", gen: Any) -> list[str]:
    """``generation.colocated.enabled``: generation runs in the policy workers, one phase at a time."""
    if not gen.colocated.enabled:
        return []
    errs = []
    if cfg.grpo.async_grpo.enabled:
        errs.append(
            "generation.colocated.enabled does not go with grpo.async_grpo.enabled: colocated generation and "
            "training share the devices, so nothing can overlap (set one of them to false)"
        )
    if gen.num_workers != 1:
        errs.append(
            f"generation.num_workers ({gen.num_workers}) is not used with generation.colocated.enabled=true: "
            "generation runs on the policy's ranks (cluster.policy_workers); leave it at 1"
        )
    return errs
