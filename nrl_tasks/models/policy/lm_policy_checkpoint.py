"""Checkpoint save/restore of :class:`~nrl_tasks.models.policy.lm_policy.Policy` (seed 003
signatures, plus ``s3://`` URIs and a keyword ``storage_options``). The workers write and read
the files (:mod:`~nrl_tasks.models.policy.workers.checkpoint_mixin`; formats in
:mod:`~nrl_tasks.models.policy.workers.checkpointing`; S3 staging on the workers' nodes in
:mod:`~nrl_tasks.models.policy.workers.remote_checkpoint`): this process moves no file."""

from __future__ import annotations

import os
from typing import Any, Optional

from nrl_tasks.models.policy.workers.remote_checkpoint import is_remote

__all__ = ["PolicyCheckpointMethods"]


class PolicyCheckpointMethods:
    """``save_checkpoint``, ``finalize_async_save``, ``load_checkpoint`` of ``Policy``.

    Mixed into :class:`~nrl_tasks.models.policy.lm_policy.Policy`; uses its ``worker_group``,
    ``_get`` (``ray.get`` failing fast) and ``_all`` (a call on every worker);
    ``load_checkpoint`` updates ``_weights_version``.
    """

    def save_checkpoint(
        self,
        weights_path: str,
        optimizer_path: Optional[str] = None,
        tokenizer_path: Optional[str] = None,
        checkpointing_cfg: Any = None,
        *,
        storage_options: Optional[dict[str, Any]] = None,
    ) -> None:
        """Write an HF-loadable safetensors folder (``weights_path``), optimizer + scheduler +
        per-rank RNG states as safetensors + JSON (``optimizer_path``) and the tokenizer
        (``tokenizer_path``, may equal ``weights_path``). Rank 0 writes them; with FSDP2 every
        rank first takes part in gathering the whole state onto rank 0's CPU, so the files are
        the same whatever the number of ranks and load on any number of ranks.

        Each path is a local directory *on rank 0's node* (written to a temp dir and renamed;
        across nodes use a shared filesystem) or an ``s3://bucket/prefix`` URI: then rank 0
        writes the dirs into a temp dir on its own node and uploads them itself
        (``storage.fs.upload_dir``), so nothing passes through this process and no filesystem
        is shared. An S3 prefix is not committed atomically: write a marker object after this
        returns if readers need one (the ``checkpoint`` stage writes ``checkpoint.json``).
        ``storage_options``: s3fs options, credentials included, sent to the workers as call
        arguments and never logged (``None``: the workers' AWS environment).
        ``checkpointing_cfg`` is accepted for NeMo-RL compatibility and ignored."""
        if not weights_path and not optimizer_path and not tokenizer_path:
            raise ValueError("save_checkpoint needs at least one of weights_path, optimizer_path, tokenizer_path")
        rng_states = self._all("get_rng_state") if optimizer_path else []
        args = (
            os.fspath(weights_path) if weights_path else None,
            os.fspath(optimizer_path) if optimizer_path else None,
            os.fspath(tokenizer_path) if tokenizer_path else None,
            rng_states,
        )
        if self.layout.wrapped:  # every rank takes part in gathering the whole state for rank 0
            self._get(self.worker_group.run_all_workers_single_data("save_checkpoint", *args, storage_options=storage_options))
        else:
            self._get(self.worker_group.run_single_worker(0, "save_checkpoint", *args, storage_options=storage_options))

    def finalize_async_save(self) -> None:
        """No-op: ``save_checkpoint`` is synchronous (its dirs are complete when it returns)."""
        return None

    def load_checkpoint(
        self,
        weights_path: Optional[str],
        optimizer_path: Optional[str] = None,
        *,
        storage_options: Optional[dict[str, Any]] = None,
    ) -> None:
        """Restore weights (and, with ``optimizer_path``, optimizer, scheduler, RNG states and
        weights version) into the live workers, bit-exactly. The reference weights are kept.

        Paths are local directories readable by every worker, or ``s3://`` URIs: then every
        worker downloads them into a temp dir on its own node, loads and deletes it.
        ``storage_options`` as for :meth:`save_checkpoint`."""
        if weights_path is None and optimizer_path is None:
            raise ValueError("load_checkpoint needs weights_path and/or optimizer_path")
        for label, path in (("weights_path", weights_path), ("optimizer_path", optimizer_path)):
            if path is not None and not is_remote(os.fspath(path)) and not os.path.isdir(os.fspath(path)):
                raise ValueError(f"{label} {os.fspath(path)!r} is not a directory")
        statuses = self._get(
            self.worker_group.run_all_workers_single_data(
                "load_checkpoint",
                os.fspath(weights_path) if weights_path else None,
                os.fspath(optimizer_path) if optimizer_path else None,
                storage_options=storage_options,
            )
        )
        self._weights_version = int(statuses[0]["weights_version"])
