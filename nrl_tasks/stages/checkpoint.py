"""``checkpoint`` stage and checkpoint lookup/restore.

A checkpoint ``<run>/checkpoints/step_000008/`` holds the state after the ``train`` of step 8::

    weights/        HF-loadable model (``*.safetensors`` + config) and its tokenizer:
                    ``AutoModelForCausalLM.from_pretrained(".../weights")`` works
    optimizer/      optimizer, scheduler and RNG states (safetensors + JSON; no pickle)
    checkpoint.json step, weights_version, config_hash, data cursor - written LAST (the commit)

Locally the files are written into a ``.tmp-*`` sibling that is renamed into place after
``checkpoint.json``. On S3 the policy workers move the bytes themselves (no filesystem shared
with this process): rank 0 writes ``weights/`` and ``optimizer/`` into a temp dir on its node
and uploads them, a restore has every worker download them to a temp dir on its own node; this
process then uploads ``checkpoint.json`` last. A checkpoint without ``checkpoint.json`` does not
exist for readers. The S3 credentials travel to the workers as call arguments (the options
resolved here from ``storage.storage_options`` and the AWS environment), never logged.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from typing import Any

from collections.abc import Callable

from prefect import task

from nrl_tasks.run_layout import join_uri, parse_step_dir
from nrl_tasks.stages.context import StepContext
from nrl_tasks.stages.refs import ActionResult, DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, stage_failures

__all__ = [
    "COMMIT_FILE",
    "checkpoint",
    "is_checkpoint_committed",
    "latest_checkpoint",
    "list_checkpoints",
    "local_checkpoint_dir",
    "restore_checkpoint",
    "save_checkpoint",
]

COMMIT_FILE = "checkpoint.json"


def _fs():
    from storage import fs

    return fs


def _is_s3(uri: str) -> bool:
    return uri.startswith("s3://") or uri.startswith("s3a://")


def _local(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri


def is_checkpoint_committed(uri: str, storage_options: dict[str, Any] | None = None) -> bool:
    return bool(_fs().exists(join_uri(uri, COMMIT_FILE), storage_options=storage_options))


def read_checkpoint_info(uri: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    return json.loads(_fs().read_text(join_uri(uri, COMMIT_FILE), storage_options=storage_options))


def list_checkpoints(checkpoints_uri: str, storage_options: dict[str, Any] | None = None) -> list[tuple[int, str]]:
    """``[(step, uri)]`` of the committed checkpoints under ``checkpoints_uri``, by step."""
    fs = _fs()
    if not fs.exists(checkpoints_uri, storage_options=storage_options):
        return []
    out = []
    for entry in fs.list_dir(checkpoints_uri, storage_options=storage_options):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        step = parse_step_dir(name)
        if step is None:
            continue
        uri = join_uri(checkpoints_uri, name)
        if is_checkpoint_committed(uri, storage_options):
            out.append((step, uri))
    return sorted(out)


def latest_checkpoint(checkpoints_uri: str, max_step: int | None = None, storage_options: dict[str, Any] | None = None) -> tuple[int, str] | None:
    """The newest committed checkpoint at or before ``max_step``."""
    cands = [c for c in list_checkpoints(checkpoints_uri, storage_options) if max_step is None or c[0] <= max_step]
    return cands[-1] if cands else None


def _worker_storage_options(storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """The s3fs options the policy workers use: the run's options plus endpoint and credentials
    from this process's AWS environment (:func:`storage.fs.s3_options`). Never log them."""
    return _fs().s3_options(storage_options)


def _save_to_s3(
    policy: Any, uri: str, body: str, *, save_optimizer: bool, storage_options: dict[str, Any] | None,
    on_written: Callable[[], None] | None,
) -> None:
    fs = _fs()
    commit = f"{uri.rstrip('/')}/{COMMIT_FILE}"
    if fs.exists(uri, storage_options=storage_options):  # an old or half-written checkpoint here
        fs.remove(commit, storage_options=storage_options)  # uncommit first, then clear
        fs.remove(uri, recursive=True, storage_options=storage_options)
    policy.save_checkpoint(
        weights_path=f"{uri.rstrip('/')}/weights",
        optimizer_path=f"{uri.rstrip('/')}/optimizer" if save_optimizer else None,
        tokenizer_path=f"{uri.rstrip('/')}/weights",  # weights/ is a complete HF folder
        storage_options=_worker_storage_options(storage_options),
    )
    if on_written is not None:
        on_written()
    fs.write_text_atomic(commit, body, storage_options=storage_options)


def save_checkpoint(
    policy: Any,
    uri: str,
    info: dict[str, Any],
    *,
    save_optimizer: bool = True,
    storage_options: dict[str, Any] | None = None,
    on_written: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Write a committed checkpoint of ``policy`` at ``uri`` (see module docstring); ``on_written()``
    runs once the files are written, before the commit."""
    t0 = time.perf_counter()
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    if _is_s3(uri):
        body = json.dumps({**info, "created_unix": time.time()}, indent=2, sort_keys=True)
        _save_to_s3(
            policy, uri, body, save_optimizer=save_optimizer, storage_options=storage_options,
            on_written=on_written,
        )
        return {"uri": uri, "seconds": time.perf_counter() - t0, **info}
    target = os.path.abspath(_local(uri))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = os.path.join(os.path.dirname(target), f".tmp-{name}-{uuid.uuid4().hex[:8]}")
    os.makedirs(staging)
    try:
        policy.save_checkpoint(
            weights_path=os.path.join(staging, "weights"),
            optimizer_path=os.path.join(staging, "optimizer") if save_optimizer else None,
            tokenizer_path=os.path.join(staging, "weights"),  # weights/ is a complete HF folder
        )
        if on_written is not None:
            on_written()
        body = json.dumps({**info, "created_unix": time.time()}, indent=2, sort_keys=True)
        with open(os.path.join(staging, COMMIT_FILE), "w", encoding="utf-8") as fh:
            fh.write(body)
            fh.flush()
            os.fsync(fh.fileno())
        if os.path.exists(target):  # an uncommitted leftover (no checkpoint.json)
            shutil.rmtree(target)
        os.rename(staging, target)
        staging = ""
    finally:
        if staging and os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)
    return {"uri": uri, "seconds": time.perf_counter() - t0, **info}


def local_checkpoint_dir(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[str, bool]:
    """A local directory with the checkpoint's files: ``(path, is_temporary_copy)`` (an S3
    checkpoint is downloaded into this process's temp dir; used by ``evaluate``)."""
    if _is_s3(uri):
        tmp = tempfile.mkdtemp(prefix="nrl-ckpt-dl-")
        _fs().download_dir(uri, tmp, storage_options=storage_options)
        return tmp, True
    return os.path.abspath(_local(uri)), False


def restore_checkpoint(policy: Any, uri: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load weights, optimizer, scheduler and RNG of a committed checkpoint into the live policy
    (from S3: every worker downloads it on its own node; nothing is staged in this process)."""
    info = read_checkpoint_info(uri, storage_options)
    if _is_s3(uri):
        base = uri.rstrip("/")
        has_opt = bool(_fs().walk_files(f"{base}/optimizer", storage_options))
        policy.load_checkpoint(
            f"{base}/weights", f"{base}/optimizer" if has_opt else None,
            storage_options=_worker_storage_options(storage_options),
        )
        policy.set_weights_version(int(info["weights_version"]))
        return info
    path, temporary = local_checkpoint_dir(uri, storage_options)
    try:
        opt = os.path.join(path, "optimizer")
        policy.load_checkpoint(os.path.join(path, "weights"), opt if os.path.isdir(opt) else None)
        policy.set_weights_version(int(info["weights_version"]))
    finally:
        if temporary:
            shutil.rmtree(path, ignore_errors=True)
    return info


@task(name="checkpoint", task_run_name="checkpoint-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def checkpoint(ctx: StepContext, trained: DatasetRef, config_hash: str) -> ActionResult:
    """Checkpoint the policy after ``trained`` (the step's ``train``; idempotent: a commit is kept)."""
    run, step = ctx.run, ctx.step
    uri = run.layout.checkpoint_uri(step)
    if is_checkpoint_committed(uri, run.storage_options):
        info = read_checkpoint_info(uri, run.storage_options)
        done = run.attempts.get((step, "checkpoint"), 0)
        return ActionResult("checkpoint", step, info.get("weights_version"), skipped=True, attempts=done, uri=uri, info=info)
    with stage_failures(ctx, "checkpoint") as attempt:
        ctx.emit("checkpoint", "start")
        version = run.policy.weights_version
        if version != trained.weights_version:
            from nrl_tasks.stages.errors import StalePolicyError

            raise StalePolicyError(f"checkpoint of step {step}: the policy holds weights version {version}")
        ctx.actor_call("checkpoint", "policy", run.policy.worker_group.workers)
        info = {
            "run_id": run.run_id,
            "step": step,
            "weights_version": version,
            "config_hash": config_hash,
            "data_cursor": step,
            "model_name": ctx.cfg.policy.model_name,
        }
        out = save_checkpoint(
            run.policy, uri, info, save_optimizer=ctx.cfg.checkpointing.save_optimizer,
            storage_options=run.storage_options, on_written=lambda: ctx.emit("checkpoint", "computed"),
        )
        ctx.emit("checkpoint", "committed")
    return ActionResult("checkpoint", step, version, seconds=out["seconds"], attempts=attempt, uri=uri, info=info)
