"""``nrl resume RUN --take-over`` of a run whose writer is alive and training, as two real ``nrl``
processes, each with its own local Ray (issue 27, item 8).

The new holder is stopped (SIGSTOP) as soon as its lease is the run's, before it starts any
work; from then on every file the run commits (stage manifests, checkpoints) and its
``status.json`` are the old writer's doing alone. The old writer must stop at its next fence
check and write nothing more: no commit, no ``failed`` over the new holder's ``running``, and its
last line says the run was taken over (no "resume with" hint). The new holder, continued,
completes the run with no error in ``status.json``.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import yaml

from tests.fixtures.grpo_runs import tiny_run_config
from tests.fixtures.processes import Nrl

pytestmark = pytest.mark.slow

RUN_ID = "taken"
#: long enough that the old writer is still training when the new holder (a fresh process: ~10 s
#: to start) takes the lease: steps are sub-second since the steps share a few subflows
STEPS = 40


def _committed(run_dir: str) -> dict[str, bytes]:
    """Every commit file of the run (stage manifests, checkpoint commits) and ``status.json``."""
    out = {}
    for base, _dirs, files in os.walk(run_dir):
        for name in files:
            if name in ("_manifest.json", "checkpoint.json", "status.json"):
                path = os.path.join(base, name)
                with open(path, "rb") as fh:
                    out[os.path.relpath(path, run_dir)] = fh.read()
    return out


def _holder_pid(run_dir: str) -> int | None:
    from nrl_tasks.run_layout import RunLayout
    from flows.run.lease import lease_uri
    from storage.lease import LeaseUnreadableError, read_lease

    root, run_id = os.path.split(run_dir)
    try:
        holder = read_lease(lease_uri(RunLayout(root, run_id)))
    except (LeaseUnreadableError, OSError, ValueError):
        return None  # being written
    return None if holder is None else holder.pid


def test_a_live_writer_taken_over_commits_nothing_more(tmp_path, tiny_model_dir, prefect_harness):
    root = str(tmp_path / "runs")
    run_dir = os.path.join(root, RUN_ID)
    cfg = tiny_run_config(tiny_model_dir, root, None, **{"grpo.max_num_steps": STEPS})
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    trained_2 = os.path.join(run_dir, "steps", "step_000002", "train", "_manifest.json")
    old = Nrl(["grpo", "--config", str(cfg_path), "--run-id", RUN_ID], prefect_harness,
              until=lambda r: os.path.exists(trained_2))
    new = None
    try:
        assert old.returncode is None, old.output[-3000:]  # still training
        new = Nrl(["resume", RUN_ID, "--storage", root, "--take-over"], prefect_harness,
                  until=lambda r: _holder_pid(run_dir) == r.proc.pid)
        assert new.returncode is None, new.output[-3000:]
        os.kill(new.proc.pid, signal.SIGSTOP)  # the new holder does nothing from here until SIGCONT
        try:
            at_take_over = _committed(run_dir)
            old.wait(timeout_s=180)
            after = _committed(run_dir)
        finally:
            os.kill(new.proc.pid, signal.SIGCONT)
        out = old.output
        assert old.returncode == 1, out[-3000:]
        last = out.strip().splitlines()[-1]
        assert "took the run over" in out and "nrl resume" not in last, out[-3000:]
        changed = sorted(k for k in after.keys() | at_take_over.keys() if after.get(k) != at_take_over.get(k))
        assert changed == [], f"the fenced writer wrote after the take-over: {changed}"
        status = json.loads(after["status.json"])
        assert status["status"] == "running" and not status.get("error"), status

        new.wait()
        assert new.returncode == 0, new.output[-3000:]
        with open(os.path.join(run_dir, "status.json"), encoding="utf-8") as fh:
            final = json.load(fh)
        assert final["status"] == "completed" and final.get("error") is None and final["last_step"] == STEPS, final
        assert all(os.path.exists(os.path.join(run_dir, "steps", f"step_{s:06d}", "train", "_manifest.json"))
                   for s in range(1, STEPS + 1))
    finally:
        for run in (old, new):
            if run is not None:
                run.close()
