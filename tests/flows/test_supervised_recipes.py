"""DPO and SFT are first-class algorithms (issue 40): the same run body as GRPO (one step driver,
grouped step subflows, trackers, the summary with its plot and history, validation, in-run
recovery from actor faults, bit-identical resume), and ``nrl sft`` trains on NeMo-RL's chat rows.

Checked on the tiny model, real Ray actors and Prefect runs:

- a DPO run with TensorBoard and MLflow (SQLite store) on: one point per step in both, its
  held-out pair accuracy at every ``dpo.val_period`` steps, the summary's plot and history, its
  steps in ``dpo-steps`` subflows;
- the same DPO run with policy actors killed inside ``dpo_train`` and ``reference_logprobs``
  recovers in its own flow run and ends on the reference run's weights at every step (slow);
- ``nrl sft`` on a JSONL file of chat rows: the loss only on the assistant turns, the held-out
  loss falls; killed mid-run and resumed it ends bit-identical (slow).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from tests.faults.helpers import env_vars, fired, read_fault_log, run_nrl, train_checksum
from tests.fixtures.grpo_runs import REPO, kill_run_actors, tiny_run_config

DPO_CONFIG = os.path.join(REPO, "configs", "dpo_tiny.yaml")
SFT_CONFIG = os.path.join(REPO, "configs", "sft_tiny.yaml")
DPO_STEPS = 6


def _dpo_config(model_dir: str, root: str, ray: str | None, **extra) -> dict:
    return tiny_run_config(model_dir, root, ray, config=DPO_CONFIG, **{
        "dpo.max_num_steps": DPO_STEPS, "dpo.val_period": 4, "dpo.val_at_end": True, "dpo.val_global_batch_size": 8, "checkpointing.save_period": 3,
        **extra,
    })


@pytest.fixture(scope="module")
def tracked_dpo(prefect_harness, ray_session, tiny_model_dir, tmp_path_factory):
    from flows.algorithms.dpo import dpo

    tmp = tmp_path_factory.mktemp("dpo-tracked")
    root, logs = str(tmp / "runs"), str(tmp / "logs")
    cfg = _dpo_config(tiny_model_dir, root, ray_session, **{
        "logger.tensorboard_enabled": True, "logger.mlflow_enabled": True, "logger.log_dir": logs})
    try:
        out = dpo(config=cfg, run_id="dpo-tr")
    finally:
        kill_run_actors("dpo-tr")
    return {"root": root, "logs": logs, "out": out, "cfg": cfg}


def _read_artifact(key: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), limit=5)

    arts = asyncio.run(read())
    assert arts, key
    return arts[0].data


def test_dpo_writes_one_tracker_point_per_step_and_validates(tracked_dpo):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flows.observe.metrics import read_metrics

    rows = read_metrics(os.path.join(tracked_dpo["root"], "dpo-tr", "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, DPO_STEPS + 1))
    assert [r["step"] for r in rows if r.get("val_accuracy") is not None] == [4, 6]  # val_period 4, val_at_end
    assert all(0.0 <= r["val_accuracy"] <= 1.0 and r["val_loss"] > 0 for r in rows if r.get("val_accuracy") is not None)
    assert all(r["pairs_s"] is not None and r["reference_s"] is not None and r["train_attempts"] == 1 for r in rows)
    acc = EventAccumulator(os.path.join(tracked_dpo["logs"], "dpo-tr", "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, DPO_STEPS + 1))
    assert [e.step for e in acc.Scalars("validation/accuracy")] == [4, 6]
    uri = "sqlite:///" + os.path.abspath(os.path.join(tracked_dpo["logs"], "mlflow", "mlflow.db"))
    client = MlflowClient(uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [r.info.run_name for r in runs] == ["dpo-tr"]
    history = client.get_metric_history(runs[0].info.run_id, "train/accuracy")
    assert sorted(m.step for m in history) == list(range(1, DPO_STEPS + 1))  # one point per step


def test_dpo_summary_shows_its_plot_and_history(tracked_dpo):
    from flows.observe.artifacts import artifact_key

    md = _read_artifact(artifact_key("dpo-tr", "summary"))
    assert f"step {DPO_STEPS} of {DPO_STEPS}" in md
    assert "pair accuracy (latest)" in md and "held-out pair accuracy (latest, best)" in md
    assert "![pair accuracy per step" in md and "data:image/png;base64," in md, md.replace("data:image", "")[:3000]
    assert "**History**" in md and "| start |" in md


def test_dpo_steps_run_in_grouped_subflows(tracked_dpo):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    async def names():
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["dpo-steps"])), limit=50)
            return sorted(r.name for r in runs if r.name.startswith("dpo-tr-"))

    assert asyncio.run(names()) == ["dpo-tr-steps-0001-0002", "dpo-tr-steps-0003-0004", "dpo-tr-steps-0005-0006"]


@pytest.mark.slow  # a second DPO run with actors killed and recovered
def test_dpo_actor_faults_are_recovered_in_the_same_flow_run(tracked_dpo, prefect_harness, ray_session, tiny_model_dir, tmp_path):
    """As GRPO's ``test_actor_faults``: the policy killed inside ``dpo_train`` of step 2 (no
    checkpoint yet: the initial weights and a replay of step 1) and with SIGKILL inside
    ``reference_logprobs`` of step 5 (checkpoint 3 and a replay of step 4); the run completes in
    one flow run, on the reference run's weights at every step."""
    from flows.algorithms.dpo import dpo
    from flows.observe.metrics import read_metrics
    from flows.run.state import read_status
    from nrl_tasks.run_layout import RunLayout
    from tests.faults import injection as faults

    root, log = str(tmp_path / "runs"), str(tmp_path / "faults.jsonl")
    cfg = _dpo_config(tiny_model_dir, root, ray_session)
    env = {faults.ACTOR_ENV_VAR: "policy:dpo_train@2, policy:reference_logprobs@5:sigkill", faults.LOG_ENV_VAR: log,
           "NRL_PROBE_TIMEOUT_S": "3"}
    try:
        with env_vars(env):
            dpo(config=cfg, run_id="dpo-faults")
    finally:
        kill_run_actors("dpo-faults")
    entries = read_fault_log(log)
    assert fired(entries, "policy", "dpo_train", 2) and fired(entries, "policy", "reference_logprobs", 5), entries
    status = read_status(RunLayout(root, "dpo-faults"))
    assert status["status"] == "completed" and len(status["history"]) == 1  # recovered inside its one flow run
    ref = tracked_dpo["root"]
    assert [train_checksum(root, "dpo-faults", s) for s in range(1, DPO_STEPS + 1)] == [
        train_checksum(ref, "dpo-tr", s) for s in range(1, DPO_STEPS + 1)]
    rows = {r["step"]: r for r in read_metrics(os.path.join(root, "dpo-faults", "metrics.jsonl"))}
    assert rows[2]["train_attempts"] == 2 and rows[5]["reference_attempts"] == 2


# --------------------------------------------------------------------------- SFT on chat rows


def _chat_rows(n: int, offset: int = 0) -> list[dict]:
    rows = []
    for i in range(offset, offset + n):
        a, b = i % 7, (i * 3) % 5
        rows.append({"messages": [{"role": "user", "content": f"What is {a}+{b}?"},
                                  {"role": "assistant", "content": str(a + b)}]})
    return rows


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_chat_row_puts_the_loss_on_the_assistant_turns_only(tiny_model_dir):
    from transformers import AutoTokenizer

    from flows.config import load_config
    from nrl_tasks.stages.sft import build_sft_batch, load_sft_records

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = load_config(SFT_CONFIG)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
                {"role": "assistant", "content": "6"}]
    b = build_sft_batch([{"prompt": "2+2?", "answer": "6", "messages": json.dumps(messages)}], tok, cfg.data, 64)
    n = int(b["input_lengths"][0])
    ids, mask = b["input_ids"][0, :n].tolist(), b["token_mask"][0, :n].tolist()
    learned = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
    assert learned.replace(" ", "") == "46"  # both assistant turns, nothing else
    assert ids[-1] == tok.eos_token_id and mask[-1] == 1.0
    with pytest.raises(ValueError, match="must end with an assistant turn"):
        from nrl_tasks.stages.sft import _chat_record

        _chat_record(messages[:-1], "f.jsonl", "line 1, row 0")
    assert load_sft_records is not None


@pytest.fixture(scope="module")
def chat_sft(prefect_harness, tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft-chat")
    train = _write_jsonl(tmp / "chat.jsonl", _chat_rows(64))
    val = _write_jsonl(tmp / "chat_val.jsonl", _chat_rows(16, offset=100))
    root = str(tmp / "runs")
    argv = ["sft", "--config", SFT_CONFIG, "--storage", root, "--run-id", "chat", f"policy.model_name={tiny_model_dir}",
            f"data.train_path={train}", f"data.val_path={val}", "data.dataset=file", "sft.max_num_steps=16",
            "sft.val_period=10", "sft.val_at_end=true", "checkpointing.save_period=8"]
    proc = run_nrl(argv, prefect_harness, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {"root": root, "argv": argv, "tmp": tmp}


@pytest.mark.slow  # an nrl sft run in a process of its own (keeps make test under 10 minutes)
def test_nrl_sft_on_chat_rows_lowers_the_held_out_loss(chat_sft):
    from flows.observe.metrics import read_metrics

    rows = read_metrics(os.path.join(chat_sft["root"], "chat", "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, 17))
    val = {r["step"]: r["val_loss"] for r in rows if r.get("val_loss") is not None}
    assert sorted(val) == [10, 16]  # sft.val_period 10, sft.val_at_end
    import storage

    # sft.val_at_start: the initial weights' held-out loss
    first = storage.read_manifest(os.path.join(chat_sft["root"], "chat", "steps", "step_000000", "val")).meta["val_loss"]
    assert val[16] < val[10] < first, (first, val)
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.slow  # a killed whole-flow run and its resume
def test_a_killed_sft_run_resumes_bit_identically(chat_sft, prefect_harness, tmp_path):
    root = str(tmp_path / "runs")
    argv = list(chat_sft["argv"])
    argv[argv.index("--storage") + 1] = root
    proc = run_nrl(argv, prefect_harness, kill_at="sft_train@11:during", timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-3000:]
    proc = run_nrl(["resume", "chat", "--storage", root], prefect_harness, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "restore checkpoint 8" in proc.stdout and "replay train of step(s) 9, 10" in proc.stdout, proc.stdout
    assert [train_checksum(root, "chat", s) for s in range(1, 17)] == [
        train_checksum(chat_sft["root"], "chat", s) for s in range(1, 17)]
