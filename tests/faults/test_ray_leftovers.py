"""A flow that starts its own local Ray leaves no Ray process behind: not when it fails, and not
when it is SIGKILLed and then resumed.

``nrl grpo`` without a Ray address (1 step of the tiny config, real Prefect API):

- **Failed**: ``NRL_FAULT_KILL_ACTOR_AT=policy:train@1`` with no stage retries; the flow's
  ``finally`` stops the Ray it started (:func:`flows.run.runtime.shutdown_local_ray`). Checked while
  the process that ran the flow still lives (a long-lived caller, like a worker), so Ray's own
  exit hook is not what stopped it.
- **SIGKILLed, then resumed**: ``NRL_FAULT_KILL_AT=train@1:after``. The GCS and raylet die with
  the flow process, but Ray 2.60's dashboard and runtime-env agents hang for 60 s reporting it to
  the dead GCS, deaf to SIGTERM; ``nrl runs`` shows the run as crashed; ``nrl resume`` stops what
  is left of that session (:func:`flows.run.process.reap_local_ray`) and completes.

Every process the ``nrl`` commands started is tracked while they run (psutil, by PID), and every
process holding the recorded session directory open is looked up afterwards: none of them may be
alive. Other Ray instances on the machine are neither counted nor touched.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import psutil
import pytest
import yaml

from tests.fixtures.grpo_runs import tiny_run_config
from tests.fixtures.processes import Nrl, alive

def _session_procs(session_dir: str) -> list[psutil.Process]:
    """Processes whose command line names ``session_dir`` or that hold a file open under it."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if session_dir in " ".join(p.info["cmdline"] or []) or any(
                f.path.startswith(session_dir + os.sep) for f in p.open_files()
            ):
                out.append(p)
        except psutil.Error:
            continue
    return out


def _left(tracked: set[psutil.Process], session_dir: str, wait_s: float = 15.0, caller: int | None = None) -> list[str]:
    """``name(pid)`` of the tracked / session processes still alive after up to ``wait_s``
    (``caller``: the live process that ran the flow, a driver of the session, not counted)."""
    deadline = time.monotonic() + wait_s
    while True:
        session = {p for p in _session_procs(session_dir) if p.pid != caller}
        left = {p for p in tracked | session if alive(p)}
        if not left or time.monotonic() > deadline:
            out = []
            for p in left:
                try:
                    cmd = " ".join(p.cmdline()[1:3])[-80:] if p.name().startswith("python") else ""
                    out.append(f"{p.name()}({p.pid}, ppid {p.ppid()}{', ' + cmd if cmd else ''})")
                except psutil.Error:
                    pass
            return sorted(out)
        time.sleep(0.5)


def _status(root: str, run_id: str) -> dict[str, Any]:
    with open(os.path.join(root, run_id, "status.json"), encoding="utf-8") as fh:
        return json.load(fh)


@pytest.fixture
def own_ray_config(tmp_path, tiny_model_dir) -> tuple[str, str]:
    """``(config path, storage root)``: 1 step of the tiny config, no Ray address (a local Ray per flow)."""
    root = str(tmp_path / "runs")
    cfg = tiny_run_config(
        tiny_model_dir, root, None,
        **{"grpo.max_num_steps": 1, "grpo.stage_retries": 0, "checkpointing.enabled": False},
    )
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), root


@pytest.mark.slow
def test_failed_flow_stops_its_local_ray(own_ray_config, prefect_harness):
    cfg, root = own_ray_config
    run = Nrl(
        ["grpo", "--config", cfg, "--run-id", "fails"], prefect_harness, hold=True,
        NRL_FAULT_KILL_ACTOR_AT="policy:train@1",
    )
    try:
        assert run.returncode == 1 and run.proc.poll() is None, run.output[-3000:]
        status = _status(root, "fails")
        assert status["status"] == "failed" and "ActorDiedError" in status["error"], status
        session = status["local_ray"]["session_dir"]
        assert os.path.isdir(session) and run.tracked
        assert _left(run.tracked, session, caller=run.proc.pid) == []  # the flow's caller still runs
    finally:
        run.close()


def _orphaned_by_sigkill(first: Any, root: str, run_id: str) -> tuple[str, list[dict[str, Any]], str]:
    """After ``first`` (a flow without ``PREFECT_API_URL``) was SIGKILLed: its status still says
    running, ``nrl runs`` reads it crashed, its ephemeral Prefect server is orphaned and still up.
    Returns the crashed state text, the server records and the local Ray's session dir."""
    from flows.run.state import list_runs

    assert first.returncode == -9, first.output[-3000:]
    status = _status(root, run_id)
    pid = status["flow_process"]["pid"]
    crashed = f"crashed (flow process {pid} on {status['flow_process']['host']} is gone)"
    assert status["status"] == "running" and [r["state"] for r in list_runs(root)] == [crashed]
    server = status["prefect_server"]
    assert len(server) == 1 and psutil.pid_exists(server[0]["pid"]), status  # orphaned, still up
    return crashed, server, status["local_ray"]["session_dir"]


@pytest.mark.slow
def test_sigkilled_flow_leftovers_are_stopped_by_resume(own_ray_config, capsys):
    """Also the ephemeral Prefect API server (no ``PREFECT_API_URL``): orphaned by the SIGKILL,
    stopped by the resume (it is among the tracked processes that must all be gone). A DPO or SFT
    run has the same run session (:func:`flows.algorithms.training.recipe_flow`), so GRPO stands for
    every recipe here (the DPO variant of issue 27 was merged into this one for the CI budget)."""
    cfg, root = own_ray_config
    first = Nrl(["grpo", "--config", cfg, "--run-id", "killed"], None, NRL_FAULT_KILL_AT="train@1:after")
    second = None
    try:
        crashed, server, session1 = _orphaned_by_sigkill(first, root, "killed")
        before = _left(first.tracked, session1, wait_s=0)  # what Ray itself has not stopped (yet)
        second = Nrl(["resume", "killed", "--storage", root], None)
        out = second.output
        assert second.returncode == 0, out[-3000:]
        assert f"resuming run killed ({crashed})" in out
        assert f"ephemeral Prefect API server: prefect-server({server[0]['pid']})" in out, out[-3000:]
        status = _status(root, "killed")
        assert status["status"] == "completed" and status["last_step"] == 1, status
        session2 = status["local_ray"]["session_dir"]
        assert session2 != session1
        assert _left(first.tracked, session1) == []
        assert _left(second.tracked, session2) == []
        reaped = [ln.strip() for ln in out.splitlines() if "leftover process" in ln]
        with capsys.disabled():
            print(f"\nleft by the SIGKILLed flow when the resume started: {before}; resume: {reaped}")
    finally:
        for run in (first, second):
            if run is not None:
                run.close()


@pytest.mark.slow
def test_sigterm_stops_the_run_cleanly_with_the_resume_hint(own_ray_config, prefect_harness, tmp_path):
    """SIGTERM behaves like Ctrl-C: exit 143, the resume hint, status ``interrupted``, no Ray left;
    the resume then completes the run."""
    import signal

    cfg, root = own_ray_config
    marker = os.path.join(root, "sigterm", "steps", "step_000001", "rollouts", "_manifest.json")
    run = Nrl(
        ["grpo", "--config", cfg, "--run-id", "sigterm", "grpo.max_num_steps=2"], prefect_harness,
        until=lambda r: os.path.exists(marker),
    )
    resumed = None
    try:
        assert run.returncode is None, run.output[-3000:]  # still training
        run.proc.send_signal(signal.SIGTERM)
        run.wait()
        out = run.output
        assert run.returncode == 143, out[-3000:]
        assert "stopped by SIGTERM" in out and "nrl resume sigterm" in out, out[-3000:]
        status = _status(root, "sigterm")
        assert status["status"] == "interrupted", status
        assert _left(run.tracked, status["local_ray"]["session_dir"]) == []
        resumed = Nrl(["resume", "sigterm", "--storage", root], prefect_harness)
        assert resumed.returncode == 0, resumed.output[-3000:]
        assert _status(root, "sigterm")["status"] == "completed"
    finally:
        for r in (run, resumed):
            if r is not None:
                r.close()
