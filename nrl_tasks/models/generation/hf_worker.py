"""Generation worker (a Ray actor body): HF model + KV-cache sampling + refit consumer.

:class:`GenerationWorkerBase` holds what every backend's worker shares: the weights version
and the *stale* flag, the refit info check, the broadcast group. A worker is stale from the
start of ``update_weights_from_collective`` until the last byte has been copied into the model;
on any failure it stays stale (and its broadcast group is closed), so it never serves a
half-loaded model. ``generate(..., weights_version=v)`` refuses to run unless the worker is not
stale and holds ``v`` (``v=None``: only "not stale").

:class:`HfGenerationWorker` is the ``hf`` backend: an ``AutoModelForCausalLM`` in the
generation precision on CUDA when the actor was given a GPU, else on CPU; ``generate`` runs
:func:`~nrl_tasks.models.generation.hf_sampling.generate_batch`. Refit tensors are
:func:`hf_refit_named_tensors` (the state dict, tied weights once) in the generation dtype, or,
once a LoRA policy's first adapters-only refit arrived (``RefitInfo.adapter``), only the adapter
tensors: the worker then holds the base weights once, with the same peft LoRA layers as the
policy, applied unmerged (:mod:`nrl_tasks.models.lora_adapters`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from nrl_tasks.models.generation.hf_sampling import merge_stop_strings, resolve_pad_and_stop_ids, sample_rows
from nrl_tasks.models.generation.interfaces import GenerationConfig, StaleWeightsError
from nrl_tasks.models.lora_adapters import inject_adapters
from nrl_tasks.settings import WorkerEnv
from nrl_tasks.utils.collective import create_broadcast_group
from nrl_tasks.utils.packed_tensor import packed_broadcast_consumer
from nrl_tasks.utils.refit import RefitInfo, refit_metadata, weights_checksum

__all__ = ["GenerationWorkerBase", "HfGenerationWorker", "hf_refit_named_tensors", "merge_stop_strings"]


def hf_refit_named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a refit carries for an HF model: ``model.state_dict()`` in order, each tensor once.

    A tied ``lm_head.weight`` (same tensor as the embedding) is skipped; persistent buffers are
    included. This is the Policy's producer order (``refit_named_tensors`` in its refit mixin);
    any disagreement surfaces as ``RefitMismatchError`` in ``prepare_refit_info``.
    """
    seen: set[int] = set()
    out = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out.append((name, tensor.detach()))
    return out


class GenerationWorkerBase:
    """Version/stale state, refit-info check and broadcast group shared by the backends."""

    def __init__(self, config: dict[str, Any] | GenerationConfig) -> None:
        self.cfg = config if isinstance(config, GenerationConfig) else GenerationConfig.model_validate(config)
        self.rank = WorkerEnv().rank
        self._weights_version: int = 0
        self._stale = False
        self._refit_info: Any = None
        self._group: Any = None
        self._group_open = False
        self._last_refit: dict[str, Any] = {}

    # ---------------------------------------------------------------- version / state
    def check_version(self, weights_version: int | None) -> None:
        """Raise :class:`StaleWeightsError` unless this worker may serve ``weights_version``."""
        if self._stale:
            raise StaleWeightsError(
                f"generation worker {self.rank} is stale (refit in progress or failed; last complete "
                f"version {self._weights_version}); asked for version {weights_version}"
            )
        if weights_version is not None and int(weights_version) != self._weights_version:
            raise StaleWeightsError(
                f"generation worker {self.rank} holds weights version {self._weights_version}, "
                f"asked for version {weights_version}"
            )

    def get_weights_state(self) -> dict[str, Any]:
        """``{"weights_version": int, "stale": bool, "rank": int}``."""
        return {"weights_version": self._weights_version, "stale": self._stale, "rank": self.rank}

    def set_weights_version(self, weights_version: int) -> None:
        """Declare the version of the weights held now (e.g. after loading a checkpoint)."""
        self._weights_version = int(weights_version)

    def mark_stale(self) -> None:
        """Refuse ``generate`` until the next complete refit."""
        self._stale = True

    def get_config(self) -> dict[str, Any]:
        return self.cfg.model_dump()

    # ---------------------------------------------------------------- refit
    def expected_refit_metadata(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """``[(name, shape, dtype)]`` this worker expects, in the producer's order."""
        raise NotImplementedError

    def _consume_weights(self, info: Any) -> dict[str, Any]:
        """Receive one packed broadcast described by ``info`` (src rank 0) and load it; returns stats."""
        raise NotImplementedError

    def prepare_refit_info(self, info_dict: dict[str, Any]) -> None:
        """Check the producer's refit info against this worker's model; keep it for the refit.

        Raises ``RefitMismatchError`` naming the first differing parameter (name, shape or
        dtype; dtype must be the generation precision) or a differing buffer size.
        """

        info = RefitInfo.from_dict(info_dict)
        self._adopt_adapter_layout(info.adapter)
        info.check(self.expected_refit_metadata(), adapter=self._adapter_layout())
        self._refit_info = info

    def _adapter_layout(self) -> dict[str, Any] | None:
        """The LoRA layout this worker applies refitted adapters with (``None``: full weights)."""
        return None

    def _adopt_adapter_layout(self, adapter: dict[str, Any] | None) -> None:
        """Get ready for an adapters-only refit of ``adapter`` (:mod:`nrl_tasks.utils.refit`);
        this backend takes full weights only."""
        if adapter is not None:
            from nrl_tasks.utils.refit import RefitMismatchError

            raise RefitMismatchError(f"{type(self).__name__} takes full-weight refits only; the producer sends LoRA adapters")

    def init_collective(
        self, ip: str, port: int, world_size: int, rank: int, timeout_s: float | None = None
    ) -> None:
        """Join the stateless broadcast group as ``rank`` (blocks until every rank joined)."""
        self.teardown_collective()
        self._open_group(str(ip), int(port), int(world_size), int(rank), float(timeout_s or self.cfg.refit_timeout_s))
        self._group_open = True

    def teardown_collective(self) -> None:
        """Close the broadcast group (idempotent); call before re-creating it on a retry."""
        if self._group_open:
            try:
                self._close_group()
            finally:
                self._group_open = False

    # backend hooks: where the group lives and how weights are loaded
    def _open_group(self, ip: str, port: int, world_size: int, rank: int, timeout_s: float) -> None:
        self._group = create_broadcast_group(
            ip, port, rank, world_size, timeout_s=timeout_s, backend=self._collective_backend()
        )

    def _close_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.close()

    def _collective_backend(self) -> str:
        return "gloo"

    def update_weights_from_collective(self, weights_version: int) -> dict[str, Any]:
        """Consume the packed broadcast from rank 0 into the model, then adopt ``weights_version``.

        Stale from the first line; the version is set only after the last byte arrived. On
        failure the worker stays stale, the group is closed, and the error propagates.
        """
        if self._refit_info is None:
            raise RuntimeError("update_weights_from_collective: call prepare_refit_info first")
        if not self._group_open:
            raise RuntimeError("update_weights_from_collective: call init_collective first")
        self._stale = True
        start = time.perf_counter()
        try:
            stats = self._consume_weights(self._refit_info)
        except BaseException:
            self.teardown_collective()
            raise
        self._weights_version = int(weights_version)
        self._stale = False
        self._last_refit = {
            "weights_version": self._weights_version,
            "seconds": time.perf_counter() - start,
            "bytes": self._refit_info.total_bytes,
            **stats,
        }
        return dict(self._last_refit)

    def shutdown(self) -> bool:
        self.teardown_collective()
        return True


class HfGenerationWorker(GenerationWorkerBase):
    """``hf`` backend worker: batched HF generation with a KV cache (CPU or one GPU).

    Args:
        config: :class:`GenerationConfig` (or its dict).
        model_path: local HF folder (model + tokenizer), or a PEFT adapter folder (its base model
            with the adapter merged in); default ``config.model_name``.
    """

    def __init__(self, config: dict[str, Any] | GenerationConfig, model_path: str | None = None) -> None:
        super().__init__(config)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = model_path or self.cfg.model_name
        if not path:
            raise ValueError("HfGenerationWorker: no model path (pass model_path or set config.model_name)")
        if not os.path.isdir(path):
            raise ValueError(f"HfGenerationWorker: model path {path!r} is not a local folder")
        torch.set_num_threads(self.cfg.torch_num_threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = getattr(torch, self.cfg.precision)
        self.model_path = path
        self._adapter: dict[str, Any] | None = None  # set by the first adapters-only refit
        self._merged_checkpoint = os.path.isfile(os.path.join(path, "adapter_config.json"))
        if self._merged_checkpoint:  # a LoRA checkpoint: base + adapter, merged
            from nrl_tasks.models.lora_adapters import load_adapter_model

            model = load_adapter_model(path, self.dtype)
            tok_path = path if os.path.isfile(os.path.join(path, "tokenizer_config.json")) else model.name_or_path
        else:
            model, tok_path = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype), path
        self.model = model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(tok_path)
        self._generator = torch.Generator(device=self.device).manual_seed(int(self.cfg.seed) + 7919 * self.rank)

    def ready(self) -> dict[str, Any]:
        """Worker facts: rank, pid, device, model path, resolved pad and stop ids."""
        pad_id, stop_ids = resolve_pad_and_stop_ids(
            self.model, self.tokenizer, self.cfg.stop_token_ids,
            ignore_eos=self.cfg.ignore_eos, pad_token_id=self.cfg.pad_token_id,
        )
        return {
            "rank": self.rank, "pid": os.getpid(), "device": str(self.device), "model_path": self.model_path,
            "pad_token_id": pad_id, "stop_token_ids": stop_ids,
        }

    def _collective_backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    # ---------------------------------------------------------------- generate
    def generate(
        self, data: dict[str, Any], greedy: bool = False, weights_version: int | None = None
    ) -> dict[str, torch.Tensor]:
        """:class:`GenerationDatumSpec` -> :class:`GenerationOutputSpec` (CPU tensors).

        Raises :class:`StaleWeightsError` (see :meth:`check_version`).
        """
        self.check_version(weights_version)
        return sample_rows(self.model, self.tokenizer, data, self.cfg, greedy=greedy, generator=self._generator)

    # ---------------------------------------------------------------- refit
    def _adapter_layout(self) -> dict[str, Any] | None:
        return self._adapter

    def _adopt_adapter_layout(self, adapter: dict[str, Any] | None) -> None:
        """On the first adapters-only refit, put the layout's LoRA layers (B = 0: outputs
        unchanged) into the base model this worker loaded; later refits only copy adapters."""
        if adapter is None or self._adapter is not None:
            return
        if self._merged_checkpoint:
            from nrl_tasks.utils.refit import RefitMismatchError

            raise RefitMismatchError(
                f"generation worker {self.rank} loaded {self.model_path!r}, an adapter checkpoint merged into its base: "
                "an adapters-only refit needs the base model folder"
            )

        inject_adapters(self.model, adapter, self.dtype)
        self._adapter = adapter

    def _refit_named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        if self._adapter is not None:
            from nrl_tasks.models.lora_adapters import adapter_named_tensors

            return list(adapter_named_tensors(self.model))
        return hf_refit_named_tensors(self.model)

    def expected_refit_metadata(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return refit_metadata(self._refit_named_tensors())

    @torch.no_grad()
    def _consume_weights(self, info: Any) -> dict[str, Any]:
        params = dict(self._refit_named_tensors())
        received = 0

        def load(batch: list[tuple[str, torch.Tensor]]) -> None:
            nonlocal received
            for name, tensor in batch:
                params[name].copy_(tensor)
                received += 1

        packed_broadcast_consumer(  # load() copies every tensor out at once: reuse the buffers
            info.consumer_iter(), self._group, 0, load, buffer_size_bytes=info.buffer_size_bytes, reuse_buffers=True
        )
        if received != len(info.metadata):
            raise RuntimeError(f"refit received {received} tensors, expected {len(info.metadata)}")
        return {"tensors": received}

    def weights_checksum(self) -> str:
        """``nrl_tasks.utils.refit.weights_checksum`` of the refit tensors, in refit order."""

        return weights_checksum(self._refit_named_tensors())

