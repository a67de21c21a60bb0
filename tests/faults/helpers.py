"""Shared checks of the fault tests: weights, rollouts, fault log, Prefect task runs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

ROLLOUT_TENSORS = ("input_ids", "input_lengths", "token_mask", "generation_logprobs", "seeds")


def flip_byte(path: str, offset: int = 300) -> None:
    """Damage a file in place: one byte at ``offset`` changed (what a bit rot or a torn write leaves)."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x55]))


def checkpoint_bytes(root: str, run_id: str, step: int) -> dict[str, bytes]:
    """The safetensors files of ``checkpoints/step_N/weights`` (name -> bytes)."""
    d = os.path.join(root, run_id, "checkpoints", f"step_{step:06d}", "weights")
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with open(os.path.join(d, f), "rb") as fh:
                out[f] = fh.read()
    return out


def train_checksum(root: str, run_id: str, step: int) -> str:
    import storage

    return storage.read_manifest(os.path.join(root, run_id, "steps", f"step_{step:06d}", "train")).meta["weights_checksum"]


def assert_same_rollouts(root_a: str, run_a: str, root_b: str, run_b: str, step: int) -> None:
    """Bit-identical rollouts (tokens, masks, sampler logprobs, seeds, texts) of ``step``."""
    import storage

    a = storage.load_batch(os.path.join(root_a, run_a, "steps", f"step_{step:06d}", "rollouts"))
    b = storage.load_batch(os.path.join(root_b, run_b, "steps", f"step_{step:06d}", "rollouts"))
    for key in ROLLOUT_TENSORS:
        assert torch.equal(a[key], b[key]), (step, key)
    assert list(a["response"]) == list(b["response"]), step


@contextlib.contextmanager
def env_vars(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` in this process for the block (fault hooks read it), then restore it."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def read_fault_log(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def fired(log: list[dict[str, Any]], role: str, stage: str, step: int) -> dict[str, Any] | None:
    for e in log:
        if (e["role"], e["stage"], e["step"]) == (role, stage, step) and e.get("fired") in (True, "armed"):
            return e
    return None


def task_runs(name_prefix: str) -> list[Any]:
    """Prefect task runs whose name starts with ``name_prefix`` (read through Prefect's client)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    async def run():
        async with get_client() as client:
            return await client.read_task_runs(
                task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=name_prefix)), limit=200
            )

    return [t for t in asyncio.run(run()) if t.name.startswith(name_prefix)]


def retries_of(name: str) -> int:
    """How often the stage task run ``name`` failed and was run again (each attempt of a stage is
    its own task run: a failed one, the flow's recovery, then a new one in the step's next attempt)."""
    runs = [t for t in task_runs(name) if t.name == name]
    assert runs and runs[-1].state is not None, name
    failed = sum(bool(t.state and t.state.is_failed()) for t in runs)
    assert any(t.state and t.state.is_completed() for t in runs), (name, [t.state for t in runs])
    return failed


def run_nrl(
    args: list[str], api_url: str, *, kill_at: str | None = None, timeout: float = 300, env_extra: dict[str, str] | None = None
) -> Any:
    """``python -m flows.cli ARGS`` in a fresh process (Prefect server ``api_url``), optionally with
    ``NRL_FAULT_KILL_AT=kill_at`` and more variables (``env_extra``); returns the ``CompletedProcess``."""
    import subprocess
    import sys

    from tests.fixtures.grpo_runs import REPO

    env = dict(os.environ)
    env["PREFECT_API_URL"] = api_url
    env["NRL_KEEP_ACTORS"] = "0"
    for k in ("NRL_FAULT_KILL_AT", "NRL_FAULT_KILL_ACTOR_AT", "NRL_FAULT_REFIT_PARTIAL"):
        env.pop(k, None)
    if kill_at:
        env["NRL_FAULT_KILL_AT"] = kill_at
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
