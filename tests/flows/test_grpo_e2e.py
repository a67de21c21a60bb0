"""End to end on the tiny model: a 3-step GRPO run through the Prefect flow (real Ray, real
Prefect test server, real Arrow files), with an injected mid-stream refit failure that the flow
recovers from (the step runs again); then the eval sweep over its two checkpoints, run twice."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from tests.flows.conftest import E2E_RUN_ID as RUN_ID

STAGES = ("prompts", "rollouts", "rewards", "logprobs", "advantages", "train")


def _client_call(fn):
    from prefect.client.orchestration import get_client

    async def run():
        async with get_client() as client:
            return await fn(client)

    return asyncio.run(run())


def test_persisted_datasets_and_metrics(e2e_run):
    import storage

    from flows.observe.metrics import read_metrics
    from nrl_tasks.run_layout import RunLayout

    layout = RunLayout(e2e_run["root"], RUN_ID)
    for step in (1, 2, 3):
        for stage in STAGES:
            uri = layout.stage_uri(step, stage)
            assert storage.is_committed(uri), uri
        rollouts = storage.load_batch(layout.stage_uri(step, "rollouts"))
        assert rollouts.size == 16
        assert rollouts["token_mask"].shape == rollouts["input_ids"].shape == rollouts["generation_logprobs"].shape
        assert len(rollouts["response"]) == 16 and rollouts["seeds"].unique().numel() == 16
        lp = storage.load_batch(layout.stage_uri(step, "logprobs"))
        assert lp["prev_logprobs"].shape == rollouts["input_ids"].shape
        assert float(lp["prev_logprobs"][:, 0].abs().sum()) == 0.0  # NeMo-RL convention
        manifest = storage.read_manifest(layout.stage_uri(step, "train"))
        assert manifest is not None
    assert storage.is_committed(layout.stage_uri(2, "val"))
    rows = read_metrics(layout.metrics_uri)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("reward_mean", "loss", "grad_norm", "generate_s", "train_s", "refit_s", "tokens_per_s"):
            assert key in r and r[key] is not None, (key, r)
    assert rows[1]["val_accuracy"] is not None
    with open(layout.metrics_uri.replace("file://", "")) as fh:
        assert len(fh.read().splitlines()) == 3
    status = json.loads(open(layout.status_uri).read())
    assert status["status"] == "completed" and status["last_step"] == 3


def test_checkpoints_are_hf_loadable(e2e_run):
    from transformers import AutoModelForCausalLM

    from nrl_tasks.stages.checkpoint import list_checkpoints
    from nrl_tasks.run_layout import RunLayout

    cks = list_checkpoints(RunLayout(e2e_run["root"], RUN_ID).checkpoints_uri)
    assert [s for s, _ in cks] == [2, 3]
    weights = os.path.join(cks[-1][1], "weights")
    assert any(f.endswith(".safetensors") for f in os.listdir(weights))
    model = AutoModelForCausalLM.from_pretrained(weights)
    assert model.num_parameters() > 0
    info = json.loads(open(os.path.join(cks[-1][1], "checkpoint.json")).read())
    assert info["step"] == 3 and info["weights_version"] == 3


def test_prefect_state_and_artifacts(e2e_run):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterName

    from flows.observe.artifacts import artifact_key

    async def query(client):
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=RUN_ID)))
        tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [r.id for r in runs]}), limit=200)
        arts = {}
        for kind in ("metrics", "progress", "rollouts", "summary"):
            arts[kind] = await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(RUN_ID, kind)])), limit=50
            )
        return runs, tasks, arts

    runs, tasks, arts = _client_call(query)
    parents = [r for r in runs if r.parent_task_run_id is None]
    assert len(parents) == 1 and parents[0].state.is_completed() and parents[0].name == RUN_ID
    steps = sorted(r.name for r in runs if r.parent_task_run_id is not None)  # one subflow per step attempt
    assert steps == [f"{RUN_ID}-step-0001", f"{RUN_ID}-step-0002", f"{RUN_ID}-step-0002-retry1", f"{RUN_ID}-step-0003"]
    names = {t.name for t in tasks}
    for stage in ("prompts", "generate", "score", "logprob", "advantages", "train"):
        assert f"{stage}-{RUN_ID}-step3" in names
    refit2 = [t for t in tasks if t.name == f"refit-{RUN_ID}-v2"]
    failed = [t for t in refit2 if t.state.is_failed()]
    assert len(failed) == 1 and any(t.state.is_completed() for t in refit2)  # injected failure, recovered, refitted
    failed_steps = [t for t in tasks if t.name.startswith("grpo-step") and t.state.is_failed()]  # subflow task runs
    assert len(failed_steps) == 1, failed_steps
    assert all(t.state.is_completed() for t in tasks if t not in failed + failed_steps), [
        (t.name, t.state.type) for t in tasks if not t.state.is_completed()]
    step2 = {r.name: r for r in runs}
    assert step2[f"{RUN_ID}-step-0002"].state.is_failed() and step2[f"{RUN_ID}-step-0002-retry1"].state.is_completed()
    # one artifact of each kind for the flow run, updated in place (issue 29: a short Artifacts tab):
    # the metrics table (newest lines first) and the rollouts at checkpoint steps 2 and 3, the summary every step
    assert len(arts["metrics"]) == 1 and len(arts["rollouts"]) == 1 and len(arts["summary"]) == 1
    tables = [json.loads(a.data) if isinstance(a.data, str) else a.data for a in arts["metrics"]]
    assert [[r["step"] for r in t] for t in tables] == [[3, 2, 1]]
    assert arts["progress"] and "Best" in arts["rollouts"][0].data
    assert any("step 3 of 3" in a.data and "reward per step, its moving average" in a.data
               and "**History** (1 flow run(s) of this run, UTC)" in a.data for a in arts["summary"])
    # the last version is published once status.json says completed: the flow's row closed, with its end time
    import re

    assert re.search(r"\| 1 \| start \| [^|]+ \| \d[^|]* \| completed \|", arts["summary"][0].data), arts["summary"][0].data[-1500:]


def test_refit_failure_leaves_workers_stale_then_retry_succeeds(e2e_run, monkeypatch):
    """Mid-stream failure (the driver sends the first chunk, then drops the group): the
    workers refuse to generate; the next attempt makes them bit-identical to the policy."""
    import time

    import torch

    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
    from nrl_tasks.models.generation.interfaces import StaleWeightsError
    from nrl_tasks.stages.refit import RefitFailedError, refit_weights
    from tests.faults.injection import inject_partial_stream

    rt = e2e_run["rt"]
    v = rt.policy.weights_version
    rt.generation.mark_stale()  # what a refit attempt does first
    with pytest.raises(RefitFailedError, match="mid-stream"):
        inject_partial_stream(rt.generation, rt.policy.prepare_refit_info(), v, time.monotonic() + 30)
    assert rt.generation.weights_version is None  # stale
    data = BatchedDataDict({"input_ids": torch.tensor([[5, 6, 7]]), "input_lengths": torch.tensor([3])})
    with pytest.raises(StaleWeightsError):
        rt.generation.generate(data, weights_version=v)
    out = refit_weights(rt.policy, rt.generation, v, timeout_s=30, verify_checksum=True)
    assert out["weights_version"] == v and rt.generation.weights_version == v
    assert rt.generation.weights_checksum() == rt.policy.weights_checksum()
    assert rt.generation.generate(data, weights_version=v)["output_ids"].shape[0] == 1


def test_eval_sweep_twice(e2e_run, prefect_harness):
    import storage

    from flows.algorithms.evaluate import eval_sweep
    from nrl_tasks.run_layout import RunLayout

    root = e2e_run["root"]
    first = eval_sweep(RUN_ID, storage=root, num_samples=2, max_prompts=4)
    assert sorted(first["evaluated"]) == [f"{RUN_ID}/step_000002", f"{RUN_ID}/step_000003"]
    assert first["skipped"] == []
    layout = RunLayout(root, RUN_ID)
    samples = storage.load_batch(os.path.join(layout.eval_uri("step_000003"), "val"))
    assert samples.size == 4 + 4 * 2 and set(samples["mode"]) == {"greedy", "sample"}
    rows = {r["checkpoint"]: r for r in first["rows"]}
    assert set(rows) == {"step_000002", "step_000003"}
    assert all(0.0 <= r["pass_at_k"] <= 1.0 and r["k"] == 2 for r in rows.values())
    second = eval_sweep(root, num_samples=2, max_prompts=4)  # by storage prefix this time
    assert second["evaluated"] == []
    assert sorted(second["skipped"]) == sorted(first["evaluated"])


def test_evaluate_checkpoint_on_a_user_dataset(e2e_run, prefect_harness, tmp_path):
    import storage

    from flows.algorithms.evaluate import evaluate_checkpoint

    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i}+2? Answer:", "answer": str(i + 2)}) + "\n" for i in range(3)))
    res = evaluate_checkpoint(RUN_ID, "step_000002", dataset=str(data), storage=e2e_run["root"], num_samples=0)
    assert res["skipped"] is False and res["rows"] == 3 and res["dataset"] == str(data)
    samples = storage.load_batch(res["uri"])
    assert samples["mode"] == ["greedy"] * 3 and samples["answer"] == ["2", "3", "4"]
    again = evaluate_checkpoint(RUN_ID, "step_000002", dataset=str(data), storage=e2e_run["root"], num_samples=0)
    assert again["skipped"] is True and again["uri"] == res["uri"]
