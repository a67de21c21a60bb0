"""``checkpoint`` stage and checkpoint lookup/restore.

A checkpoint ``<run>/checkpoints/step_000008/`` holds the state after the ``train`` of step 8::

    weights/        HF-loadable model (``*.safetensors`` + config) and its tokenizer:
                    ``AutoModelForCausalLM.from_pretrained(".../weights")`` works
    optimizer/      optimizer, scheduler and RNG states (safetensors + JSON; no pickle)
    value/          PPO's runs: the value model's weights/ and optimizer/ (every trained model of
                    the run is in the one commit)
    checkpoint.json step, weights_version, config_hash, data cursor, the weights checksum the
                    step's train recorded, the save's seconds and the file manifest (every file
                    of weights/ and optimizer/ with size and checksum) - written LAST (the commit)

A restore first checks every listed file (size, checksum; :mod:`nrl_tasks.stages.checkpoint_files`)
and refuses a damaged checkpoint with :class:`~nrl_tasks.stages.checkpoint_files.CheckpointDamagedError`
naming the file; the resume executor then checks the weights checksum after loading and falls
back to an older checkpoint (:mod:`flows.run.recovery`).

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
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from prefect import task

from nrl_tasks.run_layout import join_uri, parse_step_dir
from nrl_tasks.stages.checkpoint_files import (
    COMMIT_FILE,
    CheckpointDamagedError,
    _fs,
    _is_s3,
    _local,
    check_checkpoint,
    file_manifest,
    read_checkpoint_json,
    remote_file_manifest,
)
from nrl_tasks.stages.context import RunContext, StepContext
from nrl_tasks.stages.refs import ActionResult, DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, stage_failures

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nrl_tasks.models.policy.interfaces import PolicyInterface

__all__ = [
    "COMMIT_FILE",
    "CheckpointDamagedError",
    "check_checkpoint",
    "checkpoint",
    "checkpoint_info",
    "discard_checkpoint",
    "has_optimizer_state",
    "is_checkpoint_committed",
    "latest_checkpoint",
    "list_checkpoints",
    "local_checkpoint_dir",
    "read_checkpoint_info",
    "restore_checkpoint",
    "trained_models",
    "save_checkpoint",
]

#: what :func:`discard_checkpoint` leaves in a damaged checkpoint's directory instead of the commit
DAMAGED_FILE = "damaged.json"



def is_checkpoint_committed(uri: str, storage_options: dict[str, Any] | None = None) -> bool:
    return bool(_fs().exists(join_uri(uri, COMMIT_FILE), storage_options=storage_options))


def read_checkpoint_info(uri: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """``checkpoint.json``; ``DamagedRunError`` naming the file when it is not valid JSON."""
    return read_checkpoint_json(uri, storage_options)


def has_optimizer_state(uri: str, info: dict[str, Any], storage_options: dict[str, Any] | None = None) -> bool:
    """Whether the committed checkpoint at ``uri`` (its ``checkpoint.json``: ``info``) holds an
    optimizer state: the one its file manifest recorded (``optimizer``; ``false`` when it was saved
    with ``checkpointing.save_optimizer: false``), else (written before manifests) an ``optimizer/``
    directory."""
    if isinstance(info.get("files"), dict):
        return bool(info.get("optimizer"))
    base = uri.rstrip("/")
    if _is_s3(uri):
        return bool(_fs().walk_files(f"{base}/optimizer", storage_options))
    return os.path.isdir(os.path.join(os.path.abspath(_local(uri)), "optimizer"))


def discard_checkpoint(uri: str, problem: str, storage_options: dict[str, Any] | None = None) -> None:
    """Uncommit a damaged checkpoint: write ``damaged.json`` (the problem and the old commit's
    text), then remove ``checkpoint.json``. Its files stay until a new checkpoint of that step
    replaces them; no reader sees it as a checkpoint any more."""
    fs = _fs()
    commit = join_uri(uri, COMMIT_FILE)
    try:
        old = fs.read_text(commit, storage_options=storage_options)
    except (OSError, ValueError):
        old = None
    body = json.dumps({"problem": problem, "discarded_unix": time.time(), "checkpoint_json": old}, indent=2)
    fs.write_text_atomic(join_uri(uri, DAMAGED_FILE), body, storage_options=storage_options)
    fs.remove(commit, storage_options=storage_options)


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


def trained_models(run: RunContext) -> dict[str, PolicyInterface]:
    """The run's trained models besides the policy, by their folder in a checkpoint (PPO's ``value``)."""
    value = getattr(run.actors, "value", None)
    return {"value": value} if value is not None else {}


def _save_to_s3(
    policy: PolicyInterface, uri: str, info: dict[str, Any], *, save_optimizer: bool, storage_options: dict[str, Any] | None,
    on_written: Callable[[], None] | None, t0: float, extra: Mapping[str, PolicyInterface],
) -> None:
    fs = _fs()
    commit = f"{uri.rstrip('/')}/{COMMIT_FILE}"
    if fs.exists(uri, storage_options=storage_options):  # an old or half-written checkpoint here
        fs.remove(commit, storage_options=storage_options)  # uncommit first, then clear
        fs.remove(uri, recursive=True, storage_options=storage_options)
    for prefix, model in {"": policy, **{f"{k}/": m for k, m in extra.items()}}.items():
        base = f"{uri.rstrip('/')}/{prefix}"
        model.save_checkpoint(
            weights_path=f"{base}weights",
            optimizer_path=f"{base}optimizer" if save_optimizer else None,
            tokenizer_path=f"{base}weights",  # weights/ is a complete HF folder
            storage_options=_worker_storage_options(storage_options),
        )
    if on_written is not None:
        on_written()
    body = _commit_body(info, remote_file_manifest(uri, storage_options), save_optimizer, t0)
    fs.write_text_atomic(commit, body, storage_options=storage_options)


def _commit_body(info: dict[str, Any], manifest: dict[str, Any], save_optimizer: bool, t0: float) -> str:
    """``checkpoint.json``: ``info``, the file manifest, whether ``optimizer/`` was written and the
    save's seconds up to the commit."""
    doc = {**info, **manifest, "optimizer": bool(save_optimizer), "seconds": time.perf_counter() - t0}
    return json.dumps({**doc, "created_unix": time.time()}, indent=2, sort_keys=True)


def save_checkpoint(
    policy: PolicyInterface,
    uri: str,
    info: dict[str, Any],
    *,
    save_optimizer: bool = True,
    storage_options: dict[str, Any] | None = None,
    on_written: Callable[[], None] | None = None,
    extra: Mapping[str, PolicyInterface] | None = None,
) -> dict[str, Any]:
    """Write a committed checkpoint of ``policy`` (and of the ``extra`` models, each in its folder:
    :func:`trained_models`) at ``uri`` (see module docstring); ``on_written()`` runs once the files
    are written, before the commit."""
    t0 = time.perf_counter()
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    extra = dict(extra or {})
    if _is_s3(uri):
        _save_to_s3(
            policy, uri, info, save_optimizer=save_optimizer, storage_options=storage_options,
            on_written=on_written, t0=t0, extra=extra,
        )
        return {"uri": uri, "seconds": time.perf_counter() - t0, **info}
    target = os.path.abspath(_local(uri))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = os.path.join(os.path.dirname(target), f".tmp-{name}-{uuid.uuid4().hex[:8]}")
    os.makedirs(staging)
    try:
        for folder, model in {"": policy, **extra}.items():
            base = os.path.join(staging, folder)
            model.save_checkpoint(
                weights_path=os.path.join(base, "weights"),
                optimizer_path=os.path.join(base, "optimizer") if save_optimizer else None,
                tokenizer_path=os.path.join(base, "weights"),  # weights/ is a complete HF folder
            )
        if on_written is not None:
            on_written()
        body = _commit_body(info, file_manifest(staging), save_optimizer, t0)
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


def restore_checkpoint(
    policy: PolicyInterface, uri: str, storage_options: dict[str, Any] | None = None, *, verify: bool = True,
    extra: Mapping[str, PolicyInterface] | None = None,
) -> dict[str, Any]:
    """Load weights, optimizer, scheduler and RNG of a committed checkpoint into the live policy
    (from S3: every worker downloads it on its own node; nothing is staged in this process).

    ``verify``: check the listed files first (:func:`check_checkpoint`; off when the caller just
    did). ``CheckpointDamagedError`` naming the file when one is missing or differs; nothing is
    loaded then. A checkpoint with a file manifest that recorded an optimizer state is loaded
    with it or not at all; one without a manifest (written before them) loads what it holds.
    ``extra``: the run's other trained models (:func:`trained_models`), each from its folder."""
    info = read_checkpoint_info(uri, storage_options)
    step = int(info.get("step") or parse_step_dir(uri) or 0)
    if verify:
        problem = check_checkpoint(uri, storage_options, info=info)
        if problem:
            raise CheckpointDamagedError(step, uri, problem)
    listed = info.get("files") if isinstance(info.get("files"), dict) else None
    if _is_s3(uri):
        base = uri.rstrip("/")
        if listed is not None:
            has_opt = bool(info.get("optimizer"))
        else:
            has_opt = bool(_fs().walk_files(f"{base}/optimizer", storage_options))
        for prefix, model in {"": policy, **{f"{k}/": m for k, m in (extra or {}).items()}}.items():
            model.load_checkpoint(
                f"{base}/{prefix}weights", f"{base}/{prefix}optimizer" if has_opt else None,
                storage_options=_worker_storage_options(storage_options),
            )
            model.set_weights_version(int(info["weights_version"]))
        return info
    path, temporary = local_checkpoint_dir(uri, storage_options)
    try:
        has_opt = bool(info.get("optimizer")) if listed is not None else os.path.isdir(os.path.join(path, "optimizer"))
        for folder, model in {"": policy, **(extra or {})}.items():
            base = os.path.join(path, folder)
            if folder and not os.path.isdir(os.path.join(base, "weights")):
                raise CheckpointDamagedError(step, uri, f"it holds no {folder}/weights (the run's {folder} model)")
            model.load_checkpoint(os.path.join(base, "weights"), os.path.join(base, "optimizer") if has_opt else None)
            model.set_weights_version(int(info["weights_version"]))
    finally:
        if temporary:
            shutil.rmtree(path, ignore_errors=True)
    return info


def checkpoint_info(
    run: RunContext, step: int, weights_version: int, config_hash: str, weights_checksum: str | None
) -> dict[str, Any]:
    """What ``checkpoint.json`` records of the checkpoint after step ``step``'s ``train`` (the policy
    holding ``weights_version``) besides its file manifest."""
    return {
        "run_id": run.run_id,
        "step": step,
        "weights_version": weights_version,
        "config_hash": config_hash,
        "data_cursor": step,
        "model_name": run.cfg.policy.model_name,
        "weights_checksum": weights_checksum,
    }


def _before_commit(ctx: StepContext) -> None:
    """The checkpoint's files are written: report it, then stop if the run's lease was taken over
    (a fenced writer commits nothing more)."""
    ctx.emit("checkpoint", "computed")
    ctx.run.check_fence()


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
        info = checkpoint_info(run, step, version, config_hash, trained.get("weights_checksum"))
        out = save_checkpoint(
            run.policy, uri, info, save_optimizer=ctx.cfg.checkpointing.save_optimizer,
            storage_options=run.storage_options, on_written=lambda: _before_commit(ctx), extra=trained_models(run),
        )
        ctx.emit("checkpoint", "committed")
    return ActionResult("checkpoint", step, version, seconds=out["seconds"], attempts=attempt, uri=uri, info=info)
