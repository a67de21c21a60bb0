"""Checkpoint methods of a policy worker (mixed into ``PolicyWorker``); file formats in
:mod:`nrl_tasks.models.policy.workers.checkpointing`; ``s3://`` paths are staged on the
worker's node (:mod:`nrl_tasks.models.policy.workers.remote_checkpoint`)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from nrl_tasks.models.policy.workers import checkpointing as ckpt
from nrl_tasks.models.policy.workers.lora import save_merged
from nrl_tasks.models.policy.workers.remote_checkpoint import local_copies, staged_uploads
from nrl_tasks.models.policy.workers.rng import capture_rng_state, restore_rng_state

__all__ = ["CheckpointMixin"]

logger = logging.getLogger(__name__)


class CheckpointMixin:
    """Expects ``self.model``, ``self.optimizer``, ``self.scheduler``, ``self.param_names``,
    ``self.tokenizer``, ``self.rank``, ``self.world_size``, ``self.weights_version``, ``self.cfg``
    and ``self._load_weights(path)``. With LoRA ``self.model.save_pretrained`` is peft's: the
    weights dir holds the adapter (``adapter_config.json`` + ``adapter_model.safetensors``)."""

    def get_rng_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return capture_rng_state()

    def _gather_full_state(
        self, weights: bool, optimizer: bool
    ) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        """With a wrapped (FSDP2) model: the whole model state dict and the whole optimizer state
        dict (keyed by parameter name), gathered onto rank 0's CPU one tensor at a time with
        ``torch.distributed.checkpoint.state_dict`` (a collective: every rank calls it; the other
        ranks get empty dicts). ``(None, None)`` for a plain model (written from the live one)."""
        if not self.layout.wrapped:
            return None, None
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(self.model, options=options) if weights else None
        optim_sd = None
        if optimizer and self.optimizer is not None:
            never_stepped = not self.optimizer.state
            optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=options)
            if never_stepped:
                # torch initialised the state with a zero-gradient step (step count 1): undo it,
                # a fresh optimizer has none (else the next step's bias correction is off by one)
                self.optimizer.state.clear()
                optim_sd["state"] = {}
        return model_sd, optim_sd

    def save_checkpoint(
        self,
        weights_path: str | None,
        optimizer_path: str | None,
        tokenizer_path: str | None,
        rng_states: list[tuple[dict[str, torch.Tensor], dict[str, Any]]],
        storage_options: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Rank 0 writes weights (HF safetensors; with LoRA the peft adapter, plus the merged HF
        folder ``<weights_path>_merged`` when ``lora_cfg.save_merged``), optimizer+scheduler+RNG
        and tokenizer dirs; ``s3://`` paths are written to a temp dir on this node and uploaded
        from here."""
        self._require_valid_weights("save_checkpoint")  # never persist weights a failed step broke
        full_state = self._gather_full_state(bool(weights_path), bool(optimizer_path))
        lora = self.cfg.lora
        merged_sd = None
        if weights_path and lora is not None and lora.save_merged and self.layout.wrapped:
            from nrl_tasks.models.policy.workers.lora import merged_state

            merged_sd = merged_state(self.model)  # every rank takes part in the gathers
        if self.rank != 0:
            return {}
        if weights_path and lora is not None and lora.save_merged:
            from nrl_tasks.models.policy.workers.lora import merged_weights_path

            merged = merged_weights_path(weights_path)
            with staged_uploads((merged,), storage_options) as (m,):
                self._write_merged_dir(m, merged_sd)
        paths = (weights_path, optimizer_path, tokenizer_path)
        with staged_uploads(paths, storage_options) as (w, o, t):
            self._write_checkpoint_dirs(w, o, t, rng_states, full_state)
        return {k: v for k, v in zip(("weights_path", "optimizer_path", "tokenizer_path"), paths) if v}

    def _write_merged_dir(self, path: str, state: dict[str, torch.Tensor] | None = None) -> None:
        """The merged LoRA weights (``state`` when gathered already) as a plain HF folder
        (atomically), with the tokenizer if any."""

        def write(tmp: str) -> None:
            save_merged(self.model, tmp, state)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)

        ckpt.write_dir_atomically(path, write)

    def _write_checkpoint_dirs(
        self,
        weights_path: str | None,
        optimizer_path: str | None,
        tokenizer_path: str | None,
        rng_states: list[tuple[dict[str, torch.Tensor], dict[str, Any]]],
        full_state: tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None] = (None, None),
    ) -> None:
        """Write the local checkpoint dirs (each atomically: temp dir + rename); ``full_state``:
        the gathered model and optimizer state dicts of a wrapped model (see
        :meth:`_gather_full_state`)."""
        model_sd, optim_sd = full_state
        if weights_path:
            def write_weights(tmp: str) -> None:
                if model_sd is None:
                    self.model.save_pretrained(tmp)
                else:
                    self.model.save_pretrained(tmp, state_dict=model_sd)
                if self.cfg.lora is not None:
                    from nrl_tasks.models.policy.workers.lora import sort_adapter_config

                    sort_adapter_config(self.model, tmp)
                if tokenizer_path and os.path.abspath(tokenizer_path) == os.path.abspath(weights_path):
                    self.tokenizer.save_pretrained(tmp)

            ckpt.write_dir_atomically(weights_path, write_weights)
        if optimizer_path:
            if self.optimizer is None:
                raise ValueError("optimizer_path given but this policy has no optimizer (init_optimizer=False)")

            def write_optimizer(tmp: str) -> None:
                meta = {"weights_version": self.weights_version, "data_parallel_size": self.world_size,
                        "parallel": self.layout.mode}
                ckpt.optimizer_state_to_files(
                    self.optimizer, self.param_names, self.scheduler, tmp, meta,
                    state_dict=ckpt.by_index(optim_sd, self.param_names),
                )
                for rank, (tensors, json_state) in enumerate(rng_states):
                    ckpt.write_rng_files(tmp, rank, tensors, json_state)

            ckpt.write_dir_atomically(optimizer_path, write_optimizer)
        if tokenizer_path and not (weights_path and os.path.abspath(tokenizer_path) == os.path.abspath(weights_path)):
            if self.tokenizer is None:
                raise ValueError("tokenizer_path given but the policy workers hold no tokenizer")
            ckpt.write_dir_atomically(tokenizer_path, self.tokenizer.save_pretrained)

    def load_checkpoint(
        self, weights_path: str | None, optimizer_path: str | None = None, storage_options: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Restore weights and, with ``optimizer_path``, optimizer, scheduler, RNG and version;
        ``s3://`` paths are downloaded to a temp dir on this node first (deleted after)."""
        self._require_ready()
        named = [("weights_path", weights_path), ("optimizer_path", optimizer_path)]
        with local_copies(named, storage_options) as (w, o):
            if w:
                self._load_weights(w)
            if o:
                self._load_optimizer_and_rng(o)
        if w and (o or self.optimizer is None):
            self._invalid_weights = None  # weights (and optimizer state) restored: valid again
        return self.status()

    def _load_optimizer_and_rng(self, path: str) -> None:
        if self.optimizer is None:
            raise ValueError("optimizer_path given but this policy has no optimizer (init_optimizer=False)")
        document = ckpt.read_optimizer_json(path)
        saved_dp = int(document.get("data_parallel_size", self.world_size))
        source_rank = self.rank
        if saved_dp != self.world_size:
            # optimizer state is identical on every rank; RNG streams are per rank, so training
            # continues correctly but not bit-identically to a run at the old size
            source_rank = min(self.rank, saved_dp - 1)
            logger.warning(
                "checkpoint %s was written by %d data-parallel ranks, this policy has %d: rank %d "
                "takes the RNG state of rank %d", path, saved_dp, self.world_size, self.rank, source_rank,
            )
        rng = ckpt.load_rng_files(path, source_rank)  # fail before touching the optimizer
        ckpt.load_optimizer_state(self.optimizer, self.param_names, self.scheduler, path, apply=self._optimizer_loader())
        restore_rng_state(*rng)
        self.weights_version = int(document.get("weights_version", self.weights_version))

    def _optimizer_loader(self) -> Any:
        """How a whole (index-keyed) optimizer state dict goes into the live optimizer: as it is
        for a plain model; for a wrapped one each rank keeps its shards of every tensor
        (``set_optimizer_state_dict`` with a full state dict), so any number of ranks loads it."""
        if not self.layout.wrapped:
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        def apply(state_dict: dict[str, Any]) -> None:
            by_name = ckpt.by_name(state_dict, self.param_names)
            set_optimizer_state_dict(
                self.model, self.optimizer, by_name, options=StateDictOptions(full_state_dict=True)
            )
            # torch initialises every parameter's state (a zero-gradient step) before loading:
            # a parameter the checkpoint has no state for (never stepped) must have none
            for name, param in zip(self.param_names, self.params):
                if name not in by_name["state"]:
                    self.optimizer.state.pop(param, None)

        return apply

    def set_weights_version(self, version: int) -> int:
        self.weights_version = int(version)
        return self.weights_version

    def get_weights_version(self) -> int:
        return self.weights_version

