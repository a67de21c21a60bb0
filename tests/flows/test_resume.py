"""Kill-and-resume: the flow process is SIGKILLed (test hook ``NRL_FAULT_KILL_AT``) during
``generate``, between ``train`` and ``refit`` and during ``checkpoint``; each time ``nrl resume``
continues from the persisted batches. The final weights are bit-identical to an uninterrupted
run of the same config and seed (the end-to-end run of ``test_grpo_e2e``, or one made here).

The three resumes cover the three ways back: live actors re-attached (their version and
checksum match the run), actors gone with no checkpoint yet (fresh actors, replay of every
trained step from persisted batches), actors gone with a checkpoint (restore, replay after it).
The uninterrupted reference is the end-to-end run (same config but for validation, which does not
touch the policy).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

from tests.flows.conftest import E2E_RUN_ID, REPO, kill_run_actors, tiny_run_config

RUN_ID = "resume-tiny"


def _nrl(args: list[str], api_url: str, fault: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PREFECT_API_URL"] = api_url
    env["NRL_KEEP_ACTORS"] = "0"
    env.pop("NRL_FAULT_KILL_AT", None)
    if fault:
        env["NRL_FAULT_KILL_AT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def _checkpoint_bytes(root: str, run_id: str, step: int) -> dict[str, bytes]:
    d = os.path.join(root, run_id, "checkpoints", f"step_{step:06d}", "weights")
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d)) if f.endswith(".safetensors")}


@pytest.mark.slow  # a killed whole-flow run and its resume: in the slow suite (keeps make test under 10 minutes)
def test_kill_and_resume_is_bit_identical(e2e_run, prefect_harness, ray_session, tiny_model_dir, tmp_path):
    import storage

    from flows.observe.metrics import read_metrics

    baseline = e2e_run["root"]
    root = str(tmp_path / "runs")
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_run_config(tiny_model_dir, root, ray_session)))
    killed = -signal.SIGKILL
    try:
        # 1. killed during generate of step 2 (rollouts computed, not committed)
        p = _nrl(["grpo", "--config", str(cfg_path), "--run-id", RUN_ID], prefect_harness, fault="generate@2:during")
        assert p.returncode == killed, p.stderr[-3000:]
        assert storage.is_committed(os.path.join(root, RUN_ID, "steps", "step_000001", "train"))
        assert not storage.is_committed(os.path.join(root, RUN_ID, "steps", "step_000002", "rollouts"))
        # 2. resume: live actors re-attached; killed between train and refit of step 2
        p = _nrl(["resume", RUN_ID, "--storage", root], prefect_harness, fault="train@2:after")
        assert p.returncode == killed, p.stderr[-3000:]
        assert storage.is_committed(os.path.join(root, RUN_ID, "steps", "step_000002", "train"))
        assert not os.path.exists(os.path.join(root, RUN_ID, "checkpoints", "step_000002"))
        kill_run_actors(RUN_ID)  # as if the local Ray had died with the flow process
        # 3. resume: fresh actors, no checkpoint -> replay train 1 and 2; killed mid-checkpoint of step 3
        p = _nrl(["resume", RUN_ID, "--storage", root], prefect_harness, fault="checkpoint@3:during")
        assert p.returncode == killed, p.stderr[-3000:]
        ckdir = os.path.join(root, RUN_ID, "checkpoints")
        assert sorted(n for n in os.listdir(ckdir) if not n.startswith(".")) == ["step_000002"]
        assert any(n.startswith(".tmp-step_000003") for n in os.listdir(ckdir))  # half-written, uncommitted
        kill_run_actors(RUN_ID)
        # 4. resume: restore checkpoint 2, replay train 3, finish
        p = _nrl(["resume", RUN_ID, "--storage", root], prefect_harness)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert "finished 3 steps" in p.stdout
    finally:
        kill_run_actors(RUN_ID)

    assert _checkpoint_bytes(root, RUN_ID, 3) == _checkpoint_bytes(baseline, E2E_RUN_ID, 3)
    assert _checkpoint_bytes(root, RUN_ID, 2) == _checkpoint_bytes(baseline, E2E_RUN_ID, 2)
    for step in (1, 2, 3):
        ours = storage.read_manifest(os.path.join(root, RUN_ID, "steps", f"step_{step:06d}", "train")).meta
        ref = storage.read_manifest(os.path.join(baseline, E2E_RUN_ID, "steps", f"step_{step:06d}", "train")).meta
        assert ours["weights_checksum"] == ref["weights_checksum"]
    rows = read_metrics(os.path.join(root, RUN_ID, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3]  # exactly one line per step
    status = json.loads(open(os.path.join(root, RUN_ID, "status.json")).read())
    assert status["status"] == "completed"
    # crash bookkeeping: the task runs each killed flow left Running were marked Crashed by the next flow
    tasks = _task_runs_of(RUN_ID)
    assert not [t.name for t in tasks if t.state.type.value in ("RUNNING", "PENDING")]
    crashed = {t.name for t in tasks if t.state.is_crashed()}
    assert {f"generate-{RUN_ID}-step2", f"checkpoint-{RUN_ID}-step3"} <= crashed, crashed
    # and each killed flow run itself, by the next one, saying what that one did (was: Running forever)
    runs = _flow_runs_of(RUN_ID)
    assert not [r.name for r in runs if r.state.type.value in ("RUNNING", "PENDING")], [(r.name, r.state.type) for r in runs]
    top = sorted((r for r in runs if r.parent_task_run_id is None), key=lambda r: r.expected_start_time)
    assert [r.state.type.value for r in top] == ["CRASHED", "CRASHED", "CRASHED", "COMPLETED"], [(r.name, r.state) for r in top]
    note = top[2].state.message  # written by the last flow run, which restored checkpoint 2 and replayed train 3
    assert "steps 1-3 were committed" in note and "checkpoint 2 restored, step 3 replayed" in note, note


def _flow_runs_of(run_id: str) -> list:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    async def query():
        async with get_client() as client:
            return await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=run_id)))

    return asyncio.run(query())


def _task_runs_of(run_id: str) -> list:
    """Every task run of the flow runs of ``run_id`` (its flow runs and their step subflows)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    runs = _flow_runs_of(run_id)

    async def query():
        async with get_client() as client:
            return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in runs])),
                                               limit=200)

    return asyncio.run(query())


def test_resume_refuses_changed_config(e2e_run, prefect_harness):
    p = _nrl(["resume", E2E_RUN_ID, "--storage", e2e_run["root"], "policy.optimizer.kwargs.lr=0.5"], prefect_harness)
    assert p.returncode == 2
    assert "config hash mismatch" in p.stderr
