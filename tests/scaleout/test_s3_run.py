"""Storage scale-out: the tiny run with ``--storage s3://…`` end to end through the ``nrl`` CLI,
against moto's S3 server (credentials and endpoint from the AWS environment only).

The first run is killed (SIGKILL, test hook ``NRL_FAULT_KILL_AT``) after the ``train`` of step 3
and before its checkpoint; ``nrl resume`` in a new process (a new local Ray: the actors are
gone) restores the step-2 checkpoint from S3 and replays step 3's ``train`` from its batches on
S3 (which must reproduce the recorded weights checksum), then finishes the run. Retention is on
(batches of the last step, newest checkpoint) and must never have deleted what that resume read.
Nothing is written to local disk under the run id.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from tests.scaleout.helpers import NRL, REPO, TINY_CONFIG, clean_env, run, run_tracked

RUN_ID = "s3-run"


@pytest.mark.slow
def test_tiny_run_on_s3_with_kill_and_resume(moto_s3, tiny_model_dir, tmp_path):
    import storage
    from nrl_tasks.run_layout import RunLayout
    from nrl_tasks.stages.checkpoint import list_checkpoints

    bucket = moto_s3.make_bucket()
    root = f"{bucket}/runs"
    env = clean_env(str(tmp_path), **moto_s3.env, RAY_AUTH_MODE="disabled")
    cwd = str(tmp_path / "cwd")
    os.makedirs(cwd)
    overrides = [
        f"policy.model_name={tiny_model_dir}",
        "grpo.max_num_steps=3",
        "checkpointing.save_period=2",
        "storage.keep_last_k_steps=1",
        "checkpointing.keep_last_k=1",
    ]
    rc, out = run_tracked(
        [NRL, "grpo", "--config", TINY_CONFIG, "--storage", root, "--run-id", RUN_ID, *overrides],
        {**env, "NRL_FAULT_KILL_AT": "checkpoint@3:before"}, 900, str(tmp_path / "killed.log"), cwd=cwd,
    )
    assert rc == -9, out[-4000:]

    opts = moto_s3.storage_options
    lay = RunLayout(root, RUN_ID)
    kw = {"storage_options": opts}
    assert [s for s, _ in list_checkpoints(lay.checkpoints_uri, opts)] == [2]
    assert storage.is_committed(lay.stage_uri(3, "train"), **kw)  # trained, not checkpointed
    assert not storage.is_committed(lay.stage_uri(1, "rollouts"), **kw)  # retention at step 2

    out = run([NRL, "resume", RUN_ID, "--storage", root], env, timeout=900, cwd=cwd)
    assert f"run {RUN_ID} finished 3 steps" in out, out[-4000:]
    assert f"restored checkpoint {lay.checkpoint_uri(2)}" in out
    assert "replayed train of step 3" in out

    rows = [json.loads(x) for x in storage.fs.read_text(lay.metrics_uri, storage_options=opts).splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    status = json.loads(storage.fs.read_text(lay.status_uri, storage_options=opts))
    assert status["status"] == "completed"
    # retention after step 3: newest checkpoint only, bulky batches of the last step only
    assert [s for s, _ in list_checkpoints(lay.checkpoints_uri, opts)] == [3]
    fs = moto_s3.filesystem()
    ck_files = fs.find(lay.checkpoint_uri(3).replace("s3://", ""))
    assert any(f.endswith(".safetensors") for f in ck_files) and any(f.endswith("checkpoint.json") for f in ck_files)
    for step in (1, 2, 3):
        assert storage.is_committed(lay.stage_uri(step, "train"), **kw)
        for stage in ("prompts", "rollouts", "rewards", "logprobs", "advantages"):
            assert storage.is_committed(lay.stage_uri(step, stage), **kw) is (step == 3), (step, stage)
    rollouts = storage.load_batch(lay.stage_uri(3, "rollouts"), **kw)
    assert rollouts.size == 16
    # the saved config holds no credentials; nothing landed on local disk
    saved = yaml.safe_load(storage.fs.read_text(lay.config_uri, storage_options=opts))
    assert saved["storage"]["storage_options"] == {} and saved["storage"]["root"] == root
    assert not os.path.exists(os.path.join(cwd, "runs")) and not os.path.exists(os.path.join(REPO, "runs", RUN_ID))

    listing = run([NRL, "runs", "--storage", root], env, timeout=300, cwd=cwd)
    assert RUN_ID in listing and "completed" in listing and "3/3" in listing
