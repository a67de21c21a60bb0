"""Prefect's own retry resumes a GRPO run: ``prefect flow-run retry <FLOW_RUN_ID>`` (the CLI twin
of the UI's Retry button) on a crashed, then failed, run of the ``grpo-train`` deployment.

A SQLite-backed ``prefect server start`` on 127.0.0.1, a process work pool, ``grpo-train``
deployed from ``prefect.yaml`` by ``prefect deploy``, started without a run id (so the run
directory is named after the flow-run id), 4 steps of the tiny config, checkpoint period 2,
``grpo.stage_retries=0``. The first worker's environment carries two real faults:

1. ``NRL_FAULT_KILL_AT=train@3:after``: the flow process is SIGKILLed once step 3's ``train`` is
   committed -> ``Crashed``. (The point never fires again: a committed stage returns before it.)
2. ``prefect flow-run retry``: the same flow run (id, parameters) restores checkpoint 2 in a
   fresh local Ray, replays step 3's ``train`` from its persisted batches (checksum verified),
   then ``NRL_FAULT_KILL_ACTOR_AT=policy:train@4`` ``ray.kill``\ s the policy actor inside step
   4's ``train``; no stage retries -> ``Failed``.
3. That worker is stopped (the fault was its environment), a clean one started, ``prefect
   flow-run retry`` again -> ``Completed``.

Checked: one flow run with three attempts and unchanged parameters; no committed file under
``steps/`` rewritten by any retry (mtime and bytes), only the missing outputs added; one
``metrics.jsonl`` line per step; ``status.json`` follows the flow run; the train checksums of every
step and the step-4 checkpoint bytes equal those of an uninterrupted run of the same parameters
through the same deployment; no process left behind.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time

import pytest

from tests.fixtures.prefect_stack import PrefectStack
from tests.scaleout.helpers import BIN, REPO, clean_env, run

PREFECT = os.path.join(BIN, "prefect")
STEPS = 4
FAULT_ENV = {"NRL_FAULT_KILL_AT": "train@3:after", "NRL_FAULT_KILL_ACTOR_AT": "policy:train@4"}
DATASETS = ("prompts", "rollouts", "rewards", "logprobs", "advantages", "train")


def _files(root: str) -> dict[str, tuple[int, str]]:
    """``relative path -> (mtime_ns, sha256)`` of every file under ``root``."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = (os.stat(p).st_mtime_ns, hashlib.sha256(fh.read()).hexdigest())
    return out


def _train_checksums(run_dir: str) -> list[str]:
    import storage

    return [
        storage.read_manifest(os.path.join(run_dir, "steps", f"step_{s:06d}", "train")).meta["weights_checksum"]
        for s in range(1, STEPS + 1)
    ]


def _weights(run_dir: str, step: int) -> dict[str, str]:
    d = os.path.join(run_dir, "checkpoints", f"step_{step:06d}", "weights")
    return {k: v[1] for k, v in _files(d).items() if k.endswith(".safetensors")}


def _metrics_steps(run_dir: str) -> list[int]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return [json.loads(x)["step"] for x in fh if x.strip()]


def _status(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "status.json"), encoding="utf-8") as fh:
        return json.load(fh)


def _start_run(stack: PrefectStack, parameters: dict) -> str:
    async def go():
        async with stack.client() as c:
            dep = await c.read_deployment_by_name("grpo/grpo-train")
            fr = await c.create_flow_run_from_deployment(dep.id, parameters=parameters)
            return str(fr.id)

    return asyncio.run(go())


def _grpo_runs(stack: PrefectStack) -> list:
    """The top-level flow runs (a run's steps are subflow runs under its flow run)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentTaskRunId

    async def go():
        async with stack.client() as c:
            top = FlowRunFilter(parent_task_run_id=FlowRunFilterParentTaskRunId(is_null_=True))
            return await c.read_flow_runs(flow_run_filter=top, limit=50)

    return asyncio.run(go())


def _state_types(stack: PrefectStack, flow_run_id: str) -> list[str]:
    async def go():
        async with stack.client() as c:
            return await c.read_flow_run_states(flow_run_id)

    return [s.type.name for s in sorted(asyncio.run(go()), key=lambda s: s.timestamp)]


def _artifact_keys(stack: PrefectStack, flow_run_id: str) -> list[str]:
    """The keys of the keyed artifacts linked to the flow run (every version)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async def go():
        async with stack.client() as c:
            return await c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])),
                                          limit=200)

    return [a.key for a in asyncio.run(go()) if a.key]


def _readme_extend_command(root: str, run_id: str) -> list[str]:
    """The README's "extend a finished run" command (its two lines), with this test's storage
    root and run id; one step more than the test's run."""
    import shlex

    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    start = text.index("prefect deployment run grpo/grpo-train -p storage=$PWD/runs -p run_id=second -p resume=true")
    lines = []
    for line in text[start:].splitlines():
        lines.append(line.rstrip("\\").strip())
        if not line.endswith("\\"):
            break
    cmd = " ".join(lines).replace("$PWD/runs", root).replace("run_id=second", f"run_id={run_id}")
    cmd = cmd.replace("grpo.max_num_steps=30", f"grpo.max_num_steps={STEPS + 1}")
    argv = shlex.split(cmd)
    assert argv[:3] == ["prefect", "deployment", "run"] and "--watch" in argv, argv
    return [PREFECT, *argv[1:]]


def _own_flow_runs(stack: PrefectStack, run_id: str) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    async def go():
        async with stack.client() as c:
            return await c.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"flow:{run_id}"])),
                                          sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=50)

    return asyncio.run(go())


def _latest_summary(stack: PrefectStack, run_id: str) -> str:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.observe.artifacts import artifact_key

    async def go():
        async with stack.client() as c:
            return await c.read_latest_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(run_id, "summary")])))

    arts = asyncio.run(go())
    assert len(arts) == 1, arts
    return arts[0].data


def _committed(run_dir: str, step: int) -> list[str]:
    d = os.path.join(run_dir, "steps", f"step_{step:06d}")
    return [x for x in DATASETS if os.path.exists(os.path.join(d, x, "_manifest.json"))]


def _new_commits(before: dict[str, tuple[int, str]], after: dict[str, tuple[int, str]]) -> list[str]:
    """``step_N/dataset`` of every manifest in ``after`` and not in ``before``."""
    return sorted(os.path.dirname(k) for k in set(after) - set(before) if k.endswith("_manifest.json"))


def _rewritten(before: dict[str, tuple[int, str]], after: dict[str, tuple[int, str]]) -> list[str]:
    return sorted(k for k, v in before.items() if after.get(k) != v)


@pytest.mark.slow
def test_prefect_flow_run_retry_resumes_a_crashed_then_failed_run(tmp_path, tiny_model_dir):
    root = str(tmp_path / "runs")
    env = clean_env(str(tmp_path), NRL_REPO_DIR=REPO, RAY_AUTH_MODE="disabled")
    fault_log = str(tmp_path / "faults.jsonl")
    overrides = [f"policy.model_name={tiny_model_dir}", f"grpo.max_num_steps={STEPS}", "grpo.stage_retries=0"]
    params = {"config": "configs/grpo_tiny.yaml", "overrides": overrides, "storage": root}
    fault_env = {**FAULT_ENV, "NRL_FAULT_LOG": fault_log}
    t0 = time.monotonic()
    marks = []
    with PrefectStack(str(tmp_path), env) as stack:
        try:
            stack.start_server()
            stack.create_process_pool("local")
            run([PREFECT, "--no-prompt", "deploy", "-n", "grpo-train"], stack.env, timeout=300)
            faulty = stack.start_worker("local", extra_env=fault_env, name="worker-faulty")
            marks.append(("stack up", time.monotonic()))

            # attempt 1: the flow process is SIGKILLed once step 3's train is committed -> Crashed
            fid = _start_run(stack, params)
            first = stack.wait_flow_run(fid, {"CRASHED"}, timeout_s=600)
            marks.append(("crashed", time.monotonic()))
            run_id = f"grpo-{fid.replace('-', '')[:12]}"  # no run id given: named after the flow run
            run_dir = os.path.join(root, run_id)
            assert os.listdir(root) == [run_id]
            assert _status(run_dir)["flow_run_id"] == fid
            assert [_committed(run_dir, s) for s in (1, 2, 3)] == [list(DATASETS)] * 3
            assert _metrics_steps(run_dir) == [1, 2]
            ck2 = _files(os.path.join(run_dir, "checkpoints", "step_000002"))
            snap1 = _files(os.path.join(run_dir, "steps"))
            # Prefect 3.9's process worker reports a crash twice: once when the flow process exits,
            # again when its run call returns (after the process's children let go of its
            # output). A retry issued in between gets the late second report as its own state.
            # (bounded wait: a Prefect that reports once never prints the line)
            stack.wait_log(faulty, "prefect.flow_runs.worker - Check whether the flow run exceeded its memory", 60)
            marks.append(("crash reported", time.monotonic()))

            # attempt 2 (Prefect's retry, same worker): restore + replay step 3, then the policy
            # actor is killed inside step 4's train with stage retries off -> Failed
            out = run([PREFECT, "flow-run", "retry", fid], stack.env, timeout=120)
            assert "scheduled for retry" in out, out
            second = stack.wait_flow_run(fid, {"FAILED"}, timeout_s=600, since_run_count=first.run_count)
            marks.append(("failed", time.monotonic()))
            with open(fault_log, encoding="utf-8") as fh:
                events = [json.loads(x) for x in fh]
            assert [(e["role"], e["stage"], e["step"], e["fired"]) for e in events] == [("policy", "train", 4, True)]
            status = _status(run_dir)
            assert status["status"] == "failed" and status["flow_run_id"] == fid, status
            assert "ActorDiedError" in status["error"], status
            assert _metrics_steps(run_dir) == [1, 2, 3]
            snap2 = _files(os.path.join(run_dir, "steps"))
            assert _rewritten(snap1, snap2) == []
            assert _new_commits(snap1, snap2) == [f"step_000004/{d}" for d in sorted(DATASETS[:-1])]

            # attempt 3: the fault was the worker's environment; a clean worker, retry again
            stack.stop(faulty, wait_tree=False)  # the worker is gone; its flow processes wind down
            marks.append(("faulty stopped", time.monotonic()))
            stack.start_worker("local", name="worker-clean")
            marks.append(("clean started", time.monotonic()))
            out = run([PREFECT, "flow-run", "retry", fid], stack.env, timeout=120)
            assert "scheduled for retry" in out, out
            # the uninterrupted reference: same parameters through the same deployment
            ref_id = _start_run(stack, {**params, "run_id": "reference"})
            done = stack.wait_flow_run(fid, {"COMPLETED"}, timeout_s=600, since_run_count=second.run_count)
            marks.append(("completed", time.monotonic()))
            stack.wait_flow_run(ref_id, {"COMPLETED"}, timeout_s=600)
            marks.append(("ref completed", time.monotonic()))

            # one flow run, three attempts, unchanged parameters; no other flow run was made for it
            assert str(done.id) == fid and done.run_count == 3
            assert done.parameters == first.parameters == second.parameters
            assert sorted(str(r.id) for r in _grpo_runs(stack)) == sorted([fid, ref_id])
            states = [s for s in _state_types(stack, fid) if s in ("SCHEDULED", "CRASHED", "FAILED", "COMPLETED")]
            states = [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]]  # a Late run is SCHEDULED too
            assert states == ["SCHEDULED", "CRASHED", "SCHEDULED", "FAILED", "SCHEDULED", "COMPLETED"], states
            logs = "\n".join(stack.flow_run_logs(fid))
            keys = _artifact_keys(stack, fid)
            # what the retries left, before the extension below adds step 5
            ck_uri = os.path.join(run_dir, "checkpoints", "step_000002")
            snap3, ck2_after, metrics_after = _files(os.path.join(run_dir, "steps")), _files(ck_uri), _metrics_steps(run_dir)
            status_after, checksums_after = _status(run_dir), _train_checksums(run_dir)
            weights_after = _weights(run_dir, STEPS)

            # the README's extend command, verbatim but for the storage root and run id, on this run
            # started with a non-default config and overrides (was: refused, the deployment sends its own config)
            out = run(_readme_extend_command(root, run_id), stack.env, timeout=900)
            assert _metrics_steps(run_dir) == list(range(1, STEPS + 2)), out[-3000:]
            assert _status(run_dir)["status"] == "completed" and _status(run_dir)["last_step"] == STEPS + 1
            # a second start of the same id: refused, and it reads as refused, not a red Failed
            refused = _start_run(stack, {"run_id": run_id, "storage": root})
            gone = stack.wait_flow_run(refused, {"CANCELLED", "FAILED", "COMPLETED", "CRASHED"}, timeout_s=600)
            assert gone.state.type.name == "CANCELLED" and "refused: run" in gone.state.message, gone.state
            own = _own_flow_runs(stack, run_id)  # the one filter docs/ui.md documents
            summary = _latest_summary(stack, run_id)
        except BaseException:
            print(stack.worker_logs(8000))
            raise
    left = stack.leftovers()
    assert not left, f"processes left after stop: {[(p.pid, p.name()) for p in left]}"
    marks.append(("stack closed", time.monotonic()))
    print("\n" + "; ".join(f"{k} {v - t0:.0f}s" for k, v in marks), "| stopped:", stack.stop_report)

    # the retries updated the artifacts the first attempt made: one card of each kind in the flow run's Artifacts tab
    assert sorted(keys) == sorted(f"nrl-{run_id}-{k}" for k in ("metrics", "progress", "rollouts", "summary")), keys
    # each retry restored checkpoint 2 in a fresh Ray and replayed step 3 from its batches
    assert logs.count(f"restored checkpoint {ck_uri}") == 2, logs[-4000:]
    assert logs.count("replayed train of step 3 from persisted batches") == 2, logs[-4000:]
    # nothing committed was rewritten; only step 4's train is new
    assert _rewritten(snap2, snap3) == []
    assert _new_commits(snap2, snap3) == ["step_000004/train"]
    assert ck2_after == ck2
    # one metrics line per step; the weights of every step equal the uninterrupted run's
    assert metrics_after == list(range(1, STEPS + 1))
    status = status_after
    assert status["status"] == "completed" and status["flow_run_id"] == fid and status["last_step"] == STEPS, status
    assert sorted(os.listdir(root)) == sorted([run_id, "reference"])
    ref_dir = os.path.join(root, "reference")
    assert checksums_after == _train_checksums(ref_dir)
    assert weights_after == _weights(ref_dir, STEPS) and weights_after

    # read back from Prefect's API after start -> SIGKILL -> retry -> failed -> retry -> extend -> refused start:
    # the run's own flow runs (tag flow:<run_id>): unique names saying what each did, none Failed
    names = [r.name for r in own]
    assert len(names) == len(set(names)) == 3, names
    assert names[:2] == [f"{run_id}-retry-3", f"{run_id}-extend-4"] and names[2].startswith(f"{run_id}-refused-"), names
    assert [r.state.type.name for r in own] == ["COMPLETED", "COMPLETED", "CANCELLED"], [(r.name, r.state) for r in own]
    # the final summary (the extension's): every flow of the run closed with its end time, the last completed
    history = summary.split("**History**", 1)[1]
    rows = [ln for ln in history.splitlines() if ln.startswith("| ") and ln.split("|")[1].strip().isdigit()]
    assert len(rows) == 4, history  # start, retry, retry, extend
    assert all(ln.split("|")[4].strip() not in ("", "-") for ln in rows), history  # every one ended
    assert [ln.split("|")[5].strip().split(":")[0] for ln in rows] == ["crashed", "failed", "completed", "completed"], history
