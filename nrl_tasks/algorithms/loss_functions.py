"""Policy-gradient losses with NeMo-RL's names and calling convention.

Every loss function is called as
``loss_fn(next_token_logprobs, data, global_valid_seqs, global_valid_toks) -> (loss, metrics)``:

- ``next_token_logprobs``: ``[B, S-1]`` log-probabilities (already divided by the sampling
  temperature) of the tokens ``input_ids[:, 1:]`` under the policy being trained; it must
  carry the gradient.
- ``data``: a ``BatchedDataDict`` (any mapping) with ``[B, S]`` tensors in the ``get_logprobs``
  convention (position 0 is 0, position i scores token i) plus ``sample_mask [B]``; every
  ``[B, S]`` key is sliced ``[:, 1:]`` to align with ``next_token_logprobs``.
- ``global_valid_seqs`` / ``global_valid_toks``: number of valid sequences / tokens of the
  whole *global* batch (all micro-batches, all data-parallel ranks). Losses are sums divided
  by these counts, so the losses of the micro-batches of a global batch add up to the
  global-batch mean. ``None`` normalises by the micro-batch's own counts.
- ``metrics``: floats normalised the same way: sum them over micro-batches and ranks to get
  the global value (``num_valid_samples`` and other counts are plain counts, also summed).

Deviations from NeMo-RL:

- The functions take the gathered ``next_token_logprobs`` ``[B, S-1]`` instead of the full
  logits ``[B, S, V]`` (the policy worker gathers them once; no vocab-parallel variants).
- The configuration is a pydantic model (unknown keys are rejected) instead of a TypedDict,
  and invalid inputs raise ``ValueError`` naming the key and shape instead of ``assert``.
- ``NLLLossFn`` is NeMo-RL's ``NLLLoss`` (an alias keeps the old name) without the DPO options.
- ``truncated_importance_sampling_ratio`` without ``truncated_importance_sampling_type`` means
  ``tis`` (:mod:`nrl_tasks.algorithms.importance_sampling`).
- Per-micro-batch metrics say how to combine them (``metric_reductions``; default: sum).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, Protocol

import torch
from pydantic import Field, model_validator
from torch import Tensor

from nrl_tasks.algorithms.importance_sampling import actor_importance_weights
from nrl_tasks.algorithms.loss_metrics import mismatch_metrics, ratio_extrema
from nrl_tasks.algorithms.utils import calculate_kl, masked_mean
from nrl_tasks.config.base import Section

__all__ = [
    "ClippedPGLossConfig",
    "ClippedPGLossFn",
    "LossFunction",
    "LossType",
    "NLLLoss",
    "NLLLossFn",
]


class LossType(enum.Enum):
    """How a loss is normalised: by valid tokens or by valid sequences of the global batch."""

    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class LossFunction(Protocol):
    """What ``Policy.train`` calls (see module docstring for the convention)."""

    loss_type: LossType

    def __call__(
        self,
        next_token_logprobs: Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float | None,
        global_valid_toks: Tensor | float | None,
    ) -> tuple[Tensor, dict[str, float]]: ...


class ClippedPGLossConfig(Section):
    """NeMo-RL's ``loss_fn`` section for GRPO/PPO (same keys and defaults); the variants:

    - REINFORCE / RLOO: ``disable_ppo_ratio`` (the ratio is log pi itself, no clipping);
    - truly on-policy: ``force_on_policy_ratio`` (ratio ``exp(curr - sg(curr)) = 1``; no
      ``prev_logprobs`` needed; one optimizer step per rollout batch);
    - DAPO clip-higher: ``ratio_clip_max > ratio_clip_min``; dual clip: ``ratio_clip_c``;
    - GSPO: ``sequence_level_importance_ratios`` with ``token_level_loss: false``;
    - CISPO: ``use_cispo`` (https://arxiv.org/abs/2506.13585);
    - off-policy correction: ``use_importance_sampling_correction`` and truncation
      ``truncated_importance_sampling_type`` / ``_ratio`` / ``_ratio_min``;
    - REINFORCE++: ``use_kl_in_reward`` (the KL penalty moves from the loss to the reward);
    - VAPO: ``positive_example_nll_weight`` (NLL on samples with reward > 0);
    - Dr. GRPO (https://arxiv.org/abs/2503.20783): ``constant_length_normalization = L`` divides
      the token sums by ``L`` per sequence (``global_valid_seqs * L``) instead of by the number of
      valid tokens, so long and short responses weigh alike per token; with
      ``grpo.adv_estimator.name: dr_grpo`` (no std division) it is Dr. GRPO.
    """

    reference_policy_kl_penalty: float = Field(0.01, ge=0.0, description="beta; 0 disables the KL term")
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    kl_input_clamp_value: float | None = Field(20.0, gt=0.0)
    kl_output_clamp_value: float | None = Field(10.0, gt=0.0)
    use_kl_in_reward: bool = False
    ratio_clip_min: float = Field(0.2, ge=0.0, description="ratio clipped below at 1 - ratio_clip_min")
    ratio_clip_max: float = Field(0.2, ge=0.0, description="ratio clipped above at 1 + ratio_clip_max")
    ratio_clip_c: float | None = Field(None, description="dual-clip constant c > 1 (None: off)")
    disable_ppo_ratio: bool = False
    force_on_policy_ratio: bool = False
    use_cispo: bool = False
    use_on_policy_kl_approximation: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = None
    truncated_importance_sampling_ratio: float | None = Field(None, gt=0.0)
    truncated_importance_sampling_ratio_min: float | None = Field(None, ge=0.0)
    sequence_level_importance_ratios: bool = False
    token_level_loss: bool = True
    positive_example_nll_weight: float = Field(0.0, ge=0.0)
    constant_length_normalization: int | None = Field(None, ge=1, description="Dr. GRPO: the constant L")

    @model_validator(mode="after")
    def _check(self) -> ClippedPGLossConfig:
        def refuse(*keys: str, why: str) -> None:
            raise ValueError(f"loss_fn: {' with '.join(keys)}: {why}")

        if self.ratio_clip_c is not None and self.ratio_clip_c <= 1:
            raise ValueError(f"ratio_clip_c must be > 1 (a lower bound on -A*ratio), got {self.ratio_clip_c}")
        if self.disable_ppo_ratio and self.force_on_policy_ratio:
            refuse("disable_ppo_ratio", "force_on_policy_ratio", why="choose one ratio (log pi, or 1)")
        if self.sequence_level_importance_ratios and self.token_level_loss:
            refuse("sequence_level_importance_ratios", "token_level_loss=true", why="GSPO needs token_level_loss=false")
        if self.use_cispo:
            for key in ("disable_ppo_ratio", "force_on_policy_ratio", "sequence_level_importance_ratios"):
                if getattr(self, key):
                    refuse("use_cispo", key, why="CISPO weights each token by its own clipped ratio")
            if self.ratio_clip_c is not None:
                refuse("use_cispo", "ratio_clip_c", why="CISPO has no dual clip")
            if not self.token_level_loss:
                refuse("use_cispo", "token_level_loss=false", why="CISPO is a token-level loss")
        if self.constant_length_normalization is not None and not self.token_level_loss:
            refuse("constant_length_normalization", "token_level_loss=false", why="Dr. GRPO's normaliser is token level")
        kind, hi, lo = (self.truncated_importance_sampling_type, self.truncated_importance_sampling_ratio,
                        self.truncated_importance_sampling_ratio_min)
        if (kind is not None or hi is not None or lo is not None) and not self.use_importance_sampling_correction:
            refuse("truncated_importance_sampling_*", why="needs use_importance_sampling_correction=true")
        if kind is not None and hi is None:
            refuse("truncated_importance_sampling_type", why="needs truncated_importance_sampling_ratio (the upper bound)")
        if lo is not None and hi is not None and lo > hi:
            refuse("truncated_importance_sampling_ratio_min", "truncated_importance_sampling_ratio",
                   why=f"the lower bound {lo} is above the upper bound {hi}")
        if kind in ("icepop", "seq-mask-tis") and lo is None:
            refuse(f"truncated_importance_sampling_type={kind}", why="needs truncated_importance_sampling_ratio_min")
        if kind == "seq-mask-tis" and self.sequence_level_importance_ratios:
            refuse("seq-mask-tis", "sequence_level_importance_ratios", why="seq-mask-tis masks sequences of token weights")
        return self

    @property
    def kl_in_loss(self) -> float:
        """The KL coefficient of the loss (0 with ``use_kl_in_reward``: the reward carries it)."""
        return 0.0 if self.use_kl_in_reward else self.reference_policy_kl_penalty

    @property
    def needs_prev_logprobs(self) -> bool:
        """Whether the loss reads ``prev_logprobs`` (the ratio's or the IS weights' denominator)."""
        return not self.force_on_policy_ratio


def _slice_data(data: Mapping[str, Any], keys: tuple[str, ...], like: Tensor) -> dict[str, Tensor]:
    """``data[key][:, 1:]`` as float tensors on ``like``'s device, with shape checks."""
    if like.ndim != 2:
        raise ValueError(f"next_token_logprobs must be [B, S-1], got shape {tuple(like.shape)}")
    out: dict[str, Tensor] = {}
    for key in keys:
        if key not in data:
            raise ValueError(f"loss input is missing key {key!r} (have {sorted(data.keys())})")
        value = torch.as_tensor(data[key])
        if value.ndim != 2 or value.shape[0] != like.shape[0] or value.shape[1] - 1 != like.shape[1]:
            raise ValueError(
                f"data[{key!r}] must be [B, S] = [{like.shape[0]}, {like.shape[1] + 1}] to match "
                f"next_token_logprobs {tuple(like.shape)}, got {tuple(value.shape)}"
            )
        out[key] = value[:, 1:].to(device=like.device, dtype=torch.float32)
    return out


def _sample_mask(data: Mapping[str, Any], like: Tensor) -> Tensor:
    if "sample_mask" not in data:
        raise ValueError("loss input is missing key 'sample_mask'")
    sample_mask = torch.as_tensor(data["sample_mask"]).to(device=like.device, dtype=torch.float32)
    if sample_mask.shape != (like.shape[0],):
        raise ValueError(f"data['sample_mask'] must be [B] = [{like.shape[0]}], got {tuple(sample_mask.shape)}")
    return sample_mask


class _MaskedInputs(NamedTuple):
    logprobs: Tensor  # [B, S-1] float32, the policy's next-token logprobs (keeps the gradient)
    token_mask: Tensor  # [B, S-1] float32, 1 on response tokens
    sample_mask: Tensor  # [B] float32, 1 on sequences that count
    mask: Tensor  # [B, S-1] float32, token_mask * sample_mask
    columns: dict[str, Tensor]  # [B, S-1] float32 each, 0 wherever mask is 0


def _masked_inputs(
    next_token_logprobs: Tensor, data: Mapping[str, Any], keys: tuple[str, ...] = ()
) -> _MaskedInputs:
    """The prologue every loss shares: checked, aligned, masked inputs.

    ``next_token_logprobs`` ``[B, S-1]`` (nats) is cast to float32; ``data["token_mask"]`` and
    ``data[k]`` for ``k`` in ``keys`` (``[B, S]``, ``get_logprobs`` convention) are sliced
    ``[:, 1:]`` to ``[B, S-1]`` float32, ``data["sample_mask"]`` ``[B]`` is read as float32.
    The ``keys`` columns are zeroed where ``mask == 0`` (padding, prompt, dropped samples) so
    NaN/inf there cannot leak into values or gradients. ``ValueError`` names a missing key or
    a wrong shape.
    """
    logprobs = next_token_logprobs.float()
    d = _slice_data(data, ("token_mask", *keys), logprobs)
    sample_mask = _sample_mask(data, logprobs)
    token_mask = d["token_mask"]
    mask = token_mask * sample_mask.unsqueeze(-1)
    keep = mask > 0
    columns = {k: torch.where(keep, d[k], torch.zeros_like(d[k])) for k in keys}
    return _MaskedInputs(logprobs, token_mask, sample_mask, mask, columns)


class ClippedPGLossFn:
    """Clipped policy-gradient loss (PPO / GRPO and the variants of :class:`ClippedPGLossConfig`).

    Per response token t, with ratio ``r_t = pi(a_t) / pi_old(a_t)`` and advantage ``A_t``::

        L_t = max(-A_t * r_t, -A_t * clip(r_t, 1 - eps_min, 1 + eps_max))     # PPO clip
        L_t = min(L_t, -A_t * c)  where A_t < 0                               # dual clip
        L_t = -A_t * sg(clip(r_t, 1 - eps_min, 1 + eps_max)) * log pi(a_t)    # CISPO instead
        loss = sum_t w_t L_t / N + beta * sum_t clamp(v_t KL_t) / N + mu * NLL(reward > 0)

    ``r_t`` is ``log pi(a_t)`` itself with ``disable_ppo_ratio`` (REINFORCE/RLOO), ``exp(log pi -
    sg(log pi)) = 1`` with ``force_on_policy_ratio``, and one ratio per sequence
    ``exp(mean_t(log pi - log pi_old))`` with ``sequence_level_importance_ratios`` (GSPO). ``N`` is
    the global number of valid tokens (token level) or, for the sequence-level loss, each
    sequence's token mean is summed and divided by the global number of valid sequences.
    ``w_t``: the importance-sampling weights (:mod:`nrl_tasks.algorithms.importance_sampling`)
    with ``use_importance_sampling_correction``, else 1. ``KL_t`` is k1/k2/k3 of
    :func:`~nrl_tasks.algorithms.utils.calculate_kl` with weights ``v_t = exp(log pi - sg(log pi))``
    (value 1; the gradient gains ``KL_t * grad log pi``, as the KL is estimated on samples of the
    policy being optimised, https://arxiv.org/abs/2506.09477), or ``exp(log pi - log pi_gen)``
    with the on-policy KL approximation; ``beta`` is 0 with ``use_kl_in_reward``. ``NLL`` (VAPO,
    https://arxiv.org/abs/2504.05118, weight ``positive_example_nll_weight``) is the mean NLL of the
    micro-batch's tokens of samples with ``data["rewards"] > 0``. References: PPO
    https://arxiv.org/abs/1707.06347, GRPO https://arxiv.org/abs/2402.03300, dual clip
    https://arxiv.org/abs/1912.09729, clip-higher (DAPO) https://arxiv.org/abs/2503.14476.
    """

    #: how per-micro-batch metrics combine (the rest: summed, being globally normalised)
    metric_reductions = {
        "probs_ratio_min": "min", "probs_ratio_clamped_min": "min",
        "probs_ratio_max": "max", "probs_ratio_clamped_max": "max", "sampling_importance_ratio_max": "max",
        "positive_nll_loss": "mean",
    }

    def __init__(self, cfg: ClippedPGLossConfig | Mapping[str, Any] | None = None) -> None:
        self.cfg = cfg if isinstance(cfg, ClippedPGLossConfig) else ClippedPGLossConfig(**(cfg or {}))
        self.loss_type = LossType.TOKEN_LEVEL if self.cfg.token_level_loss else LossType.SEQUENCE_LEVEL

    def _keys(self) -> tuple[str, ...]:
        cfg = self.cfg
        return ("advantages", "generation_logprobs", *(("prev_logprobs",) if cfg.needs_prev_logprobs else ()),
                *(("reference_policy_logprobs",) if cfg.kl_in_loss != 0 else ()))

    def _ratios(self, curr: Tensor, prev: Tensor, token_mask: Tensor) -> tuple[Tensor, Tensor]:
        """``(ratios, clamped)`` ``[B, S-1]`` (see the class docstring)."""
        cfg = self.cfg
        if cfg.force_on_policy_ratio:
            r = torch.exp(curr - curr.detach())
            return r, r
        if cfg.disable_ppo_ratio:
            return curr, curr
        log_r = curr - prev
        if cfg.sequence_level_importance_ratios:
            r = torch.exp(masked_mean(log_r, token_mask, dim=-1)).unsqueeze(-1).expand_as(curr)
        else:
            r = torch.exp(log_r)
        return r, r.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)

    def __call__(
        self,
        next_token_logprobs: Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float | None,
        global_valid_toks: Tensor | float | None,
    ) -> tuple[Tensor, dict[str, float]]:
        cfg = self.cfg
        curr, token_mask, sample_mask, mask, d = _masked_inputs(next_token_logprobs, data, self._keys())
        adv, gen = d["advantages"], d["generation_logprobs"]
        prev = d["prev_logprobs"] if cfg.needs_prev_logprobs else torch.where(mask > 0, curr.detach(), torch.zeros_like(curr))

        length = cfg.constant_length_normalization
        if length is not None:  # Dr. GRPO: L tokens per sequence, whatever their length
            seqs = global_valid_seqs if global_valid_seqs is not None else sample_mask.sum()
            norm_toks = seqs * length
        else:
            norm_toks = global_valid_toks

        def reduce(per_token: Tensor) -> Tensor:
            if self.loss_type == LossType.TOKEN_LEVEL:
                return masked_mean(per_token, mask, global_normalization_factor=norm_toks)
            per_seq = masked_mean(per_token, token_mask, dim=-1)
            return masked_mean(per_seq, sample_mask, global_normalization_factor=global_valid_seqs)

        ratios, clamped = self._ratios(curr, prev, token_mask)
        if cfg.use_cispo:
            pg = -adv * clamped.detach() * curr
        else:
            pg = torch.max(-adv * ratios, -adv * clamped)
        if cfg.ratio_clip_c is not None:
            pg = torch.where(adv < 0, torch.min(pg, -adv * cfg.ratio_clip_c), pg)

        is_w, is_metrics = actor_importance_weights(prev, gen, token_mask, sample_mask, cfg, global_valid_toks, global_valid_seqs)
        actor_loss = reduce((is_w if cfg.use_importance_sampling_correction else 1.0) * pg)

        beta = cfg.kl_in_loss
        if beta != 0:
            ref = d["reference_policy_logprobs"]
            base = gen if cfg.use_on_policy_kl_approximation else curr.detach()
            v = torch.nan_to_num(torch.exp(curr - base), nan=0.0, posinf=0.0, neginf=0.0)
            kl_t = calculate_kl(curr, ref, cfg.reference_policy_kl_type, cfg.kl_input_clamp_value,
                                cfg.kl_output_clamp_value, importance_sampling_weights=v)
            kl = reduce(kl_t)
        else:
            kl = torch.zeros((), device=curr.device)

        nll = torch.zeros((), device=curr.device)
        if cfg.positive_example_nll_weight > 0:
            if "rewards" not in data:
                raise ValueError("loss_fn.positive_example_nll_weight > 0 needs data['rewards'] [B]")
            correct = mask * (torch.as_tensor(data["rewards"]).to(curr.device).float() > 0).float().unsqueeze(-1)
            if bool(correct.sum() > 0):
                nll = masked_mean(-curr, correct)
        loss = actor_loss + beta * kl + cfg.positive_example_nll_weight * nll

        with torch.no_grad():
            tok_mean = lambda x: masked_mean(x, mask, global_normalization_factor=global_valid_toks).item()  # noqa: E731
            if cfg.sequence_level_importance_ratios:
                is_mean = masked_mean(is_w.squeeze(-1), sample_mask, global_normalization_factor=global_valid_seqs).item()
                is_valid = is_w.squeeze(-1)[sample_mask > 0]
            else:
                is_mean, is_valid = tok_mean(is_w), is_w[mask > 0]
            metrics = {
                "loss": loss.item(),
                "actor_loss": actor_loss.item(),
                "kl_penalty": kl.item(),
                "probs_ratio": tok_mean(ratios),
                "probs_ratio_clamped": tok_mean(clamped),
                **ratio_extrema(ratios, clamped, mask),
                **mismatch_metrics(prev, gen, mask, cfg.reference_policy_kl_type, global_valid_toks),
                "sampling_importance_ratio": is_mean,
                "sampling_importance_ratio_max": float(is_valid.max()) if is_valid.numel() else 0.0,
                **is_metrics,
                "approx_entropy": -tok_mean(torch.exp(curr - gen) * curr),
                "num_valid_samples": sample_mask.sum().item(),
                "positive_nll_loss": nll.item(),
            }
        return loss, metrics


class NLLLossFn:
    """Token-level negative log-likelihood (SFT): ``-sum_t mask_t * logp_t / N_valid_tokens``."""

    loss_type = LossType.TOKEN_LEVEL

    def __call__(
        self,
        next_token_logprobs: Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float | None,
        global_valid_toks: Tensor | float | None,
    ) -> tuple[Tensor, dict[str, float]]:
        logprobs, _, sample_mask, mask, _ = _masked_inputs(next_token_logprobs, data)
        loss = -masked_mean(logprobs, mask, global_normalization_factor=global_valid_toks)
        return loss, {
            "loss": loss.item(),
            "num_unmasked_tokens": mask.sum().item(),
            "num_valid_samples": sample_mask.sum().item(),
        }


NLLLoss = NLLLossFn
"""NeMo-RL's name for :class:`NLLLossFn`."""
