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
- ``NLLLossFn`` is NeMo-RL's ``NLLLoss`` (an alias keeps the old name) without the DPO options;
  there is no ``disable_ppo_ratio``/``force_on_policy_ratio``/sequence-level-ratio variant.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from nrl_tasks.algorithms.utils import calculate_kl, masked_mean

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


class ClippedPGLossConfig(BaseModel):
    """NeMo-RL's ``loss_fn`` section for GRPO/PPO (same keys and defaults)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    reference_policy_kl_penalty: float = Field(0.01, ge=0.0, description="beta; 0 disables the KL term")
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    kl_input_clamp_value: float | None = Field(20.0, gt=0.0)
    kl_output_clamp_value: float | None = Field(10.0, gt=0.0)
    ratio_clip_min: float = Field(0.2, ge=0.0, description="ratio clipped below at 1 - ratio_clip_min")
    ratio_clip_max: float = Field(0.2, ge=0.0, description="ratio clipped above at 1 + ratio_clip_max")
    ratio_clip_c: float | None = Field(None, description="dual-clip constant c > 1 (None: off)")
    use_on_policy_kl_approximation: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_ratio: float | None = Field(None, gt=0.0)
    token_level_loss: bool = True

    @model_validator(mode="after")
    def _check(self) -> ClippedPGLossConfig:
        if self.ratio_clip_c is not None and self.ratio_clip_c <= 1:
            raise ValueError(f"ratio_clip_c must be > 1 (a lower bound on -A*ratio), got {self.ratio_clip_c}")
        if self.truncated_importance_sampling_ratio is not None and not self.use_importance_sampling_correction:
            raise ValueError("truncated_importance_sampling_ratio needs use_importance_sampling_correction=true")
        return self


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
    """Clipped policy-gradient loss (PPO / GRPO) with a KL penalty to the reference policy.

    Per response token t, with ratio ``r_t = pi(a_t) / pi_old(a_t)`` and advantage ``A_t``::

        L_t = max(-A_t * r_t, -A_t * clip(r_t, 1 - eps_min, 1 + eps_max))     # PPO clip
        L_t = min(L_t, -A_t * c)  where A_t < 0                               # dual clip
        loss = sum_t w_t L_t / N + beta * sum_t KL_t / N                      # token level

    ``N`` is the global number of valid tokens (token level) or, for the sequence-level loss,
    each sequence's token mean is summed and divided by the global number of valid sequences.
    ``w_t = min(pi_old / pi_gen, truncation)`` when importance-sampling correction is on (the
    generator's logprobs differ from the trainer's), else 1. ``KL_t`` is k1/k2/k3 of
    :func:`~nrl_tasks.algorithms.utils.calculate_kl`, weighted by ``pi / pi_gen`` (detached)
    with the on-policy KL approximation. References: PPO https://arxiv.org/abs/1707.06347,
    GRPO https://arxiv.org/abs/2402.03300, dual clip https://arxiv.org/abs/1912.09729,
    asymmetric clip (DAPO) https://arxiv.org/abs/2503.14476.
    """

    def __init__(self, cfg: ClippedPGLossConfig | Mapping[str, Any] | None = None) -> None:
        self.cfg = cfg if isinstance(cfg, ClippedPGLossConfig) else ClippedPGLossConfig(**(cfg or {}))
        self.loss_type = LossType.TOKEN_LEVEL if self.cfg.token_level_loss else LossType.SEQUENCE_LEVEL

    def __call__(
        self,
        next_token_logprobs: Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float | None,
        global_valid_toks: Tensor | float | None,
    ) -> tuple[Tensor, dict[str, float]]:
        cfg = self.cfg
        keys = ("advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs")
        curr, token_mask, sample_mask, mask, d = _masked_inputs(next_token_logprobs, data, keys)
        adv, prev, gen, ref = (d[k] for k in keys)

        def reduce(per_token: Tensor) -> Tensor:
            if self.loss_type == LossType.TOKEN_LEVEL:
                return masked_mean(per_token, mask, global_normalization_factor=global_valid_toks)
            per_seq = masked_mean(per_token, token_mask, dim=-1)
            return masked_mean(per_seq, sample_mask, global_normalization_factor=global_valid_seqs)

        # PPO clipped surrogate (+ dual clip for negative advantages)
        ratios = torch.exp(curr - prev)
        ratios_clamped = ratios.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
        clip_loss = torch.max(-adv * ratios, -adv * ratios_clamped)
        if cfg.ratio_clip_c is not None:
            clip_loss = torch.where(adv < 0, torch.min(clip_loss, -adv * cfg.ratio_clip_c), clip_loss)

        # off-policy correction between the generator (e.g. vLLM) and the trainer
        is_weights = torch.nan_to_num(torch.exp(prev - gen), nan=0.0, posinf=0.0, neginf=0.0)
        if cfg.truncated_importance_sampling_ratio is not None:
            is_weights = is_weights.clamp(max=cfg.truncated_importance_sampling_ratio)
        actor_loss = reduce((is_weights if cfg.use_importance_sampling_correction else 1.0) * clip_loss)

        # KL(pi || pi_ref) penalty
        if cfg.reference_policy_kl_penalty != 0:
            kl_weights = torch.ones_like(curr)
            if cfg.use_on_policy_kl_approximation:
                kl_weights = torch.nan_to_num(torch.exp(curr - gen).detach(), nan=0.0, posinf=0.0, neginf=0.0)
            kl_t = calculate_kl(
                curr, ref, cfg.reference_policy_kl_type, cfg.kl_input_clamp_value, cfg.kl_output_clamp_value
            )
            kl = reduce(kl_weights * kl_t)
        else:
            kl = torch.zeros((), device=curr.device)
        loss = actor_loss + cfg.reference_policy_kl_penalty * kl

        with torch.no_grad():
            tok_mean = lambda x: masked_mean(x, mask, global_normalization_factor=global_valid_toks).item()  # noqa: E731
            metrics = {
                "loss": loss.item(),
                "actor_loss": actor_loss.item(),
                "kl_penalty": kl.item(),
                "probs_ratio": tok_mean(ratios),
                "probs_ratio_clamped": tok_mean(ratios_clamped),
                "token_mult_prob_error": tok_mean(torch.exp((gen - prev).abs() * mask)),
                "sampling_importance_ratio": tok_mean(is_weights),
                "sampling_importance_ratio_max": float(is_weights[mask > 0].max()) if bool((mask > 0).any()) else 0.0,
                "approx_entropy": -tok_mean(torch.exp(curr - gen) * curr),
                "num_valid_samples": sample_mask.sum().item(),
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
