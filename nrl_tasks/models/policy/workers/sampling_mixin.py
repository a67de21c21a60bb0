"""Sampling and reward scoring with a policy worker's live weights (mixed into ``PolicyWorker``).

``generate`` is in-process HF sampling on this rank's rows, the call the HF generation workers
make (:func:`~nrl_tasks.models.generation.hf_sampling.sample_rows`: the same rows and seeds give the
same samples on the same weights); colocated generation (``generation.colocated.enabled``) runs
here. With sharded (FSDP2) weights every rank first gathers the whole weights once
(:func:`~nrl_tasks.models.policy.workers.parallel.gathered_weights`), so ranks may decode different
numbers of steps. ``score`` is the reward head of a sequence-classification policy (never wrapped),
``get_values`` PPO's value head at every token, ``get_topk_logits`` a teacher's top-k logits
(on-policy distillation).
"""

from __future__ import annotations


import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.models.generation.hf_sampling import sample_rows
from nrl_tasks.models.policy.workers.batches import check_inputs
from nrl_tasks.models.policy.workers.logprobs import forward_logits, last_token_scores, length_mask, token_values
from nrl_tasks.models.policy.workers.parallel import gathered_weights

__all__ = ["SamplingMixin"]


class SamplingMixin:
    """Expects ``self.model``, ``self.cfg``, ``self.tokenizer``, ``self.layout``, ``self.device`` and the
    worker's ``_require_ready``, ``_require_valid_weights``, ``_check_causal_lm``, ``_to_device``,
    ``_autocast``, ``_dummy_forwards``."""

    @torch.no_grad()
    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        """In-process HF sampling with this worker's live weights (colocated use)."""
        self._require_valid_weights("generate")
        self._check_causal_lm("generate")
        self._to_device()  # back from an offload, if any
        gen = self.cfg.generation
        if gen is None:
            raise ValueError("Policy.generate needs a 'generation' section in the policy config")
        check_inputs(data)
        self.model.eval()
        pad_or_tokenizer = self.tokenizer if self.tokenizer is not None else int(gen.pad_token_id or 0)
        with gathered_weights(self.model, self.layout):  # ranks stop decoding at different steps
            out = sample_rows(self.model, pad_or_tokenizer, data, gen, greedy=greedy)
        return BatchedDataDict(out)

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
        try:
            with self._autocast():
                scores = last_token_scores(self.model, ids, data["input_lengths"])
        except ValueError as exc:
            raise ValueError(f"score: {exc}") from None
        return BatchedDataDict({"scores": scores.cpu()})

    @torch.no_grad()
    def get_values(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        """``{"values": [B, S]}`` float32: PPO's value of the state before each token (the head one
        position back, :func:`token_values`; 0 at position 0 and on padding)."""
        self._require_ready()
        if not self.cfg.reward_model_cfg.enabled:
            raise ValueError("get_values needs a value model (reward_model_cfg.enabled, a one-output head)")
        self._to_device()
        check_inputs(data)
        self.model.eval()
        batch, width = data["input_ids"].shape
        out = torch.zeros(batch, width, dtype=torch.float32)
        mbs = micro_batch_size or self.cfg.effective_logprob_batch_size
        for start in range(0, batch, mbs):
            mb = data.slice(start, min(batch, start + mbs))
            ids = mb["input_ids"].to(self.device)
            with self._autocast():
                v = token_values(self.model, ids)
            keep = length_mask(mb["input_lengths"].to(self.device), width)
            out[start : start + mb.size] = torch.where(keep, v, 0.0).cpu()
        return BatchedDataDict({"values": out})

    @torch.no_grad()
    def get_topk_logits(self, data: BatchedDataDict, k: int, micro_batch_size: int | None = None) -> BatchedDataDict:
        """``topk_logits [B, S, k]`` (float32, divided by temperature) and ``topk_indices [B, S, k]``.

        Position ``t`` holds the top-k of the distribution predicting token ``t + 1``; padding 0.
        """
        self._require_valid_weights("get_topk_logits")
        self._check_causal_lm("get_topk_logits")
        self._to_device()  # back from an offload, if any
        check_inputs(data)
        batch, width = data["input_ids"].shape
        values = torch.zeros(batch, width, k, dtype=torch.float32)
        indices = torch.zeros(batch, width, k, dtype=torch.long)
        self.model.eval()
        mbs = micro_batch_size or self.cfg.effective_logprob_batch_size
        self._dummy_forwards(len(range(0, batch, mbs)), backward=False)  # ahead of this rank's own: same count
        for start in range(0, batch, mbs):
            mb = data.slice(start, min(batch, start + mbs))
            ids = mb["input_ids"].to(self.device)
            with self._autocast():
                logits = forward_logits(self.model, ids).float() / self.cfg.temperature
            top = logits.topk(k, dim=-1)
            keep = length_mask(mb["input_lengths"].to(self.device), ids.shape[1]).unsqueeze(-1)
            values[start : start + mb.size] = torch.where(keep, top.values, 0.0).cpu()
            indices[start : start + mb.size] = torch.where(keep, top.indices, 0).cpu()
        return BatchedDataDict({"topk_logits": values, "topk_indices": indices})
