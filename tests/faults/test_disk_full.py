"""The run's storage fills up mid-step (a real full file system: a 256 MiB tmpfs, filled by the
fault plug-in's ``NRL_FAULT_FILL_DISK_AT`` at a stage point), the run fails naming the file it
could not write and commits nothing half-written; once space is freed, ``nrl resume`` ends with
the reference run's weights, bit for bit (slow; needs permission to mount a tmpfs, else skipped).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from tests.faults.helpers import checkpoint_bytes, run_nrl, train_checksum
from tests.faults.injection import FILL_ENV_VAR, FILLER_NAME
from tests.fixtures.grpo_runs import E2E_RUN_ID, kill_run_actors, tiny_run_config

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mount)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield str(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.parametrize("point", ["train@2:during", "checkpoint@2:before"])  # a stage batch (train's) and a checkpoint
def test_disk_full_mid_run_then_resume_is_bit_identical(point, small_disk, e2e_run, prefect_harness, ray_session, tiny_model_dir, tmp_path):
    root = os.path.join(small_disk, "runs")
    run_id = "full-" + point.split("@")[0]
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_run_config(tiny_model_dir, root, ray_session)))
    try:
        p = run_nrl(["grpo", "--config", str(cfg_path), "--run-id", run_id], prefect_harness, env_extra={FILL_ENV_VAR: point})
        out = p.stdout + p.stderr
        assert p.returncode == 1, out[-3000:]
        assert "No space left on device" in out and root in out, out[-3000:]
        from flows.run.state import list_runs

        with open(os.path.join(root, run_id, "status.json"), encoding="utf-8") as fh:
            status = json.load(fh)["status"]
        (row,) = list_runs(root)
        # the failure could be recorded only if status.json still fitted; else the run reads as crashed
        assert status == "failed" or (status == "running" and row["state"].startswith("crashed")), (status, row)
        assert "could not record" in out or status == "failed", out[-3000:]
        os.remove(os.path.join(root, FILLER_NAME))  # space freed
        p = run_nrl(["resume", run_id, "--storage", root], prefect_harness)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    finally:
        kill_run_actors(run_id)
    baseline = e2e_run["root"]
    for step in (2, 3):
        assert checkpoint_bytes(root, run_id, step) == checkpoint_bytes(baseline, E2E_RUN_ID, step), step
    for step in (1, 2, 3):
        assert train_checksum(root, run_id, step) == train_checksum(baseline, E2E_RUN_ID, step), step
