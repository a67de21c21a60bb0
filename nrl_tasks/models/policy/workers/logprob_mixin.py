"""Logprob inference with a policy worker's live weights (mixed into ``PolicyWorker``): the
policy's logprobs of a batch (``get_logprobs``, NeMo-RL's layout: position 0 is 0, position ``i``
holds ``log p(token_i | tokens_<i)``, padding 0) and the reference policy's
(``get_reference_policy_logprobs``: the initial weights swapped in, or with LoRA the base model
with the adapters disabled). Micro-batching, the shared-prompt forward and the lockstep of a
wrapped model's forwards are the worker's (``_microbatches``, ``_mb_logprobs``, ``_dummy_forwards``).
"""

from __future__ import annotations

import contextlib

import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.models.policy.workers.batches import check_inputs
from nrl_tasks.models.policy.workers.parallel import local_tensor

__all__ = ["LogprobMixin"]


class LogprobMixin:
    """Expects ``self.model``, ``self.cfg``, ``self.layout``, ``self.reference``,
    ``self.init_reference_model`` and the worker's ``_require_ready``, ``_require_valid_weights``,
    ``_check_causal_lm``, ``_to_device``, ``_microbatches``, ``_mb_logprobs``, ``_dummy_forwards``,
    ``_swappable``."""

    @torch.no_grad()
    def get_logprobs(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        """``{"logprobs": [B, S]}`` float32 on CPU for this shard (NeMo-RL layout)."""
        self._require_valid_weights("get_logprobs")
        self._check_causal_lm("get_logprobs")
        self._to_device()  # back from an offload, if any
        check_inputs(data)
        width = data["input_ids"].shape[1]
        self.model.eval()
        mbs, packed = [], False
        if data.size:
            mbs, packed = self._microbatches(data, micro_batch_size or self.cfg.effective_logprob_batch_size)
        rows = []
        for mb in mbs:
            lp = self._mb_logprobs(mb, packed).cpu()
            if lp.shape[1] < width:
                lp = torch.nn.functional.pad(lp, (0, width - lp.shape[1]))
            rows.append(lp)
        self._dummy_forwards(len(mbs), backward=False)
        if not rows:
            return BatchedDataDict({"logprobs": torch.zeros(0, width, dtype=torch.float32)})
        return BatchedDataDict({"logprobs": torch.cat(rows)})

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """``{"reference_logprobs": [B, S]}``: logprobs under the initial weights (with LoRA: the
        base model, adapters disabled)."""
        self._require_ready()
        if self.reference is None and not (self.cfg.lora is not None and self.init_reference_model):
            raise ValueError("this policy was created with init_reference_model=False: no reference weights")
        with self._use_reference():
            out = self.get_logprobs(data, micro_batch_size)
        return BatchedDataDict({"reference_logprobs": out["logprobs"]})

    @contextlib.contextmanager
    def _use_reference(self):
        if self.cfg.lora is not None:
            with self.model.disable_adapter():
                yield
            return
        live = self._swappable()
        if self.layout.wrapped:
            # FSDP2 gathers layers from its own shard storage: copy the reference values in and back
            with torch.no_grad():
                saved = {n: local_tensor(t).detach().clone() for n, t in live.items()}
                try:
                    for n, t in live.items():
                        local_tensor(t).copy_(self.reference[n])
                    yield
                finally:
                    for n, t in live.items():
                        local_tensor(t).copy_(saved[n])
            return
        saved = {n: t.data for n, t in live.items()}
        try:
            for n, t in live.items():
                t.data = self.reference[n].to(t.device) if t.device.type != "cpu" else self.reference[n]
            yield
        finally:
            for n, t in live.items():
                t.data = saved[n]
