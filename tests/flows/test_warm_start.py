"""The warm start the GRPO flow runs itself (``warm_start.sft_steps``): an SFT run ``<run>-sft``,
then GRPO from its weights; a resume sent the base-model config (as a deployment sends its
default) reuses the warm start instead of training again; the first flow run is named after the
run, the extension after what it does."""

from __future__ import annotations

import os

import pytest
import yaml

from tests.fixtures.grpo_runs import kill_run_actors, tiny_run_config


def _flow_run_name(flow_run_id: str) -> str:
    import uuid

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(uuid.UUID(flow_run_id)).name


@pytest.mark.slow  # ~90 s (a killed start, its resume, an extension): keeps `make test` under 10 minutes
def test_grpo_runs_its_warm_start_once_and_resumes_on_its_weights(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    """Also: a start SIGKILLed inside its warm start's SFT run is listed by ``nrl runs`` and
    resumed by ``nrl resume`` (was: "no run", only ``<id>-sft`` existed)."""
    import signal

    from flows.config import config_hash, load_config
    from flows.algorithms.grpo import grpo
    from flows.run.state import read_status
    from flows.algorithms.warm_start import warm_start_weights
    from nrl_tasks.run_layout import RunLayout
    from tests.faults.helpers import run_nrl

    root = str(tmp_path / "runs")
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{"grpo.max_num_steps": 1, "warm_start.sft_steps": 3,
                                                                 "warm_start.batch_size": 8, "warm_start.lr": 3e-3})
    path = tmp_path / "grpo.yaml"  # the deployment's `config` parameter: the base model
    path.write_text(yaml.safe_dump(cfg))
    run_id = "warm"
    try:
        p = run_nrl(["grpo", "--config", str(path), "--run-id", run_id], prefect_harness, kill_at="sft_train@2:during")
        assert p.returncode == -signal.SIGKILL, p.stdout[-2000:] + p.stderr[-3000:]
        p = run_nrl(["runs", "--storage", root], prefect_harness)
        assert p.returncode == 0 and any(line.split()[:1] == [run_id] for line in p.stdout.splitlines()), p.stdout
        p = run_nrl(["resume", run_id, "--storage", root], prefect_harness)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        sft_manifest = os.path.join(root, "warm-sft", "checkpoints", "step_000003", "checkpoint.json")
        assert os.path.exists(sft_manifest), os.listdir(os.path.join(root, "warm-sft"))
        stamp = os.stat(sft_manifest).st_mtime_ns
        saved = yaml.safe_load(open(os.path.join(root, run_id, "config.yaml"), encoding="utf-8"))
        weights = warm_start_weights(load_config(str(path)), run_id)
        assert saved["policy"]["model_name"] == weights and saved["warm_start"]["sft_steps"] == 3
        assert os.path.isdir(weights.replace("file://", ""))
        # the hash counts the warm start: the same run without one hashes differently
        no_ws = load_config(str(path), ["warm_start.sft_steps=0", f"policy.model_name={weights}"])
        assert config_hash(no_ws) != saved["config_hash"]
        status = read_status(RunLayout(root, run_id)) or {}
        assert _flow_run_name(status["flow_run_id"]) == f"{run_id}-resume-2"  # renamed from its start-up name
        # extend it as the deployment does: its default config names the base model
        out = grpo(config=str(path), run_id=run_id, resume=True, storage=root, overrides=["grpo.max_num_steps=2"])
    finally:
        kill_run_actors(run_id)
        kill_run_actors(f"{run_id}-sft")
    assert out["last_step"] == 2
    assert os.stat(sft_manifest).st_mtime_ns == stamp  # the warm start was reused, not trained again
    status = read_status(RunLayout(root, run_id)) or {}
    assert _flow_run_name(status["flow_run_id"]) == f"{run_id}-extend-3"  # the run's third flow, an extension


def test_the_warm_start_config_is_an_sft_run_with_its_own_batch_and_learning_rate(tmp_path):
    """The SFT run a warm start trains: its steps, batch size and learning rate from
    ``warm_start``, checkpointed at its last step, the GRPO policy's other settings kept."""
    from flows.algorithms.warm_start import warm_start_config
    from flows.config import load_config
    from nrl_tasks.config.master import MasterConfig

    overrides = ["warm_start.sft_steps=3", "warm_start.batch_size=8", "warm_start.lr=0.003", "policy.optimizer.kwargs.weight_decay=0.0"]
    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "grpo_tiny.yaml"), overrides)
    data = warm_start_config(cfg)
    sft = MasterConfig.model_validate(data)
    assert sft.kind == "sft" and sft.sft.max_num_steps == 3 and sft.checkpointing.save_period == 3
    assert sft.policy.train_global_batch_size == 8 and sft.policy.optimizer.kwargs.lr == 0.003
    assert sft.policy.optimizer.kwargs.weight_decay == 0.0 and sft.warm_start.sft_steps == 0
    # a GRPO run that saves no checkpoints still gets its warm start's weights (they are a checkpoint)
    off = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "grpo_tiny.yaml"),
                      [*overrides, "checkpointing.enabled=false"])
    assert MasterConfig.model_validate(warm_start_config(off)).checkpointing.enabled
