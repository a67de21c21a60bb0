"""Sampling and reward scoring with a policy worker's live weights (mixed into ``PolicyWorker``).

``generate`` is in-process HF sampling (the decode loop the generation workers share) on this
rank's rows; with sharded (FSDP2) weights every rank first gathers the whole weights once
(:func:`~nrl_tasks.models.policy.workers.parallel.gathered_weights`), so ranks may decode different
numbers of steps. ``score`` is the reward head of a sequence-classification policy (never wrapped).
"""

from __future__ import annotations

from typing import Any

import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.models.policy.workers.batches import check_inputs
from nrl_tasks.models.policy.workers.parallel import gathered_weights

__all__ = ["SamplingMixin"]


class SamplingMixin:
    """Expects ``self.model``, ``self.cfg``, ``self.tokenizer``, ``self.layout``, ``self.device`` and the
    worker's ``_require_ready``, ``_require_valid_weights``, ``_check_causal_lm``, ``_to_device``,
    ``_autocast``."""

    @torch.no_grad()
    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        """In-process HF sampling with this worker's live weights (colocated use)."""
        self._require_valid_weights("generate")
        self._check_causal_lm("generate")
        self._to_device()  # back from an offload, if any
        gen = self.cfg.generation
        if gen is None:
            raise ValueError("Policy.generate needs a 'generation' section in the policy config")
        try:
            from nrl_tasks.models.generation.hf_sampling import generate_batch
        except ImportError as exc:  # pragma: no cover - module ships with the package
            raise NotImplementedError(f"Policy.generate needs nrl_tasks.models.generation.hf_sampling: {exc}") from exc
        check_inputs(data)
        self.model.eval()
        stop_strings = data.get("stop_strings", gen.stop_strings)
        with gathered_weights(self.model, self.layout):  # ranks stop decoding at different steps
            out = self._sample(generate_batch, data, gen, stop_strings, greedy)
        return BatchedDataDict(out)

    def _sample(self, generate_batch: Any, data: BatchedDataDict, gen: Any, stop_strings: Any, greedy: bool) -> dict:
        """One ``generate_batch`` call on this rank's rows with the live model."""
        return generate_batch(
            self.model,
            self.tokenizer if self.tokenizer is not None else int(gen.pad_token_id or 0),
            data["input_ids"],
            data["input_lengths"],
            max_new_tokens=gen.max_new_tokens,
            temperature=gen.temperature,
            top_p=gen.top_p,
            top_k=gen.top_k,
            stop_token_ids=gen.stop_token_ids,
            stop_strings=stop_strings,
            seeds=data.get("seeds"),
            greedy=greedy,
            ignore_eos=gen.ignore_eos,
            pad_token_id=gen.pad_token_id,
            max_batch_size=gen.max_batch_size,
        )

    @torch.no_grad()
    def score(self, data: BatchedDataDict) -> BatchedDataDict:
        """``{"scores": [B]}`` float32: the reward head at each row's last valid token."""
        self._require_ready()
        if not self.cfg.reward_model_cfg.enabled:
            raise ValueError("Policy.score needs reward_model_cfg.enabled (a sequence-classification model)")
        self._to_device()
        check_inputs(data)
        if data.size == 0:
            return BatchedDataDict({"scores": torch.zeros(0, dtype=torch.float32)})
        self.model.eval()
        ids = data["input_ids"].to(self.device)
        lengths = data["input_lengths"].to(self.device).to(torch.long)
        if int(lengths.min()) < 1:
            raise ValueError("score: every row needs input_lengths >= 1")
        base = getattr(self.model, self.model.base_model_prefix)
        with self._autocast():
            hidden = base(input_ids=ids, use_cache=False).last_hidden_state
            logits = self.model.score(hidden).float()  # [B, S, num_labels]
        last = logits[torch.arange(ids.shape[0], device=ids.device), lengths - 1]
        return BatchedDataDict({"scores": last[:, 0].cpu()})
