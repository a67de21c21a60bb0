"""One writer per run (``flows/run/lease.py`` over ``storage/lease.py``), as the CLI and the flow use it.

- a second writer is refused at once, naming the holder, by ``nrl resume`` (exit 2, nothing
  started) and by the flow itself (a deployment run skips the CLI), and nothing of the run is
  touched; ``nrl runs`` shows ``running`` while the lease is live, whatever ``status.json`` says;
- a SIGKILLed holder on this machine is dead at once: its lease is taken over without asking;
- a holder whose lease was taken over is fenced: the flow's between-steps check raises, its next
  commit is refused, it writes no status over the new holder's, and the new holder ends ``completed``
  without an error.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from tests.flows.conftest import E2E_RUN_ID, REPO


@pytest.fixture
def run_copy(e2e_run, tmp_path):
    from nrl_tasks.run_layout import RunLayout

    root = tmp_path / "runs"
    shutil.copytree(os.path.join(e2e_run["root"], E2E_RUN_ID), root / E2E_RUN_ID)
    return RunLayout(str(root), E2E_RUN_ID)


def _state(root: str) -> str:
    from flows.run.state import list_runs

    (row,) = list_runs(root)
    return row["state"]


def test_a_second_writer_is_refused_naming_the_holder(run_copy, prefect_harness, capsys):
    from flows.cli import main
    from flows.algorithms.grpo import grpo
    from flows.run.lease import hold_run_lease, lease_refusal

    layout = run_copy
    status_before = open(layout.status_uri, "rb").read()
    assert _state(layout.root) == "completed"
    lease = hold_run_lease(layout, None, "other-flow-run")
    try:
        assert _state(layout.root) == "running"
        rc = main(["resume", E2E_RUN_ID, "--storage", layout.root])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("nrl: error:") == 1, err
        assert f"pid {os.getpid()}" in err and "other-flow-run" in err and "--take-over" in err, err
        with pytest.raises(BaseException) as ei:  # the flow refuses on its own too
            grpo(config=None, run_id=E2E_RUN_ID, resume=True, storage=layout.root)
        assert lease_refusal(ei.value) is not None, repr(ei.value)
        assert open(layout.status_uri, "rb").read() == status_before  # the refused writer wrote nothing
    finally:
        lease.release()
    assert _state(layout.root) == "completed"


_HOLDER = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from flows.run.lease import hold_run_lease
from nrl_tasks.run_layout import RunLayout
hold_run_lease(RunLayout(sys.argv[2], sys.argv[3]), None, "killed-flow")
print("held", flush=True)
time.sleep(600)
"""


def test_a_sigkilled_holder_is_taken_over_without_asking(run_copy):
    from flows.run.lease import hold_run_lease, live_holder

    layout = run_copy
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, REPO, layout.root, layout.run_id], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        holder = live_holder(layout)
        assert holder is not None and holder.pid == proc.pid
        assert _state(layout.root) == "running"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert live_holder(layout) is None  # same machine, process gone: dead at once, no TTL wait
    lease = hold_run_lease(layout, None, "resume")
    try:
        assert lease.holder.pid == os.getpid() and lease.holder.generation == holder.generation + 1
    finally:
        lease.release()


def test_a_holder_whose_lease_was_taken_over_is_fenced(run_copy):
    from flows.run.lease import LeaseSettings, check_fence, hold_run_lease
    from storage.lease import LeaseHeldError, LeaseLostError

    layout = run_copy
    fast = LeaseSettings(ttl_s=30.0, heartbeat_s=0.2)
    first = hold_run_lease(layout, None, "first", settings=fast)
    try:
        check_fence(first)
        with pytest.raises(LeaseHeldError):
            hold_run_lease(layout, None, "second", settings=fast)
        second = hold_run_lease(layout, None, "second", take_over=True, settings=fast)
        try:
            with pytest.raises(LeaseLostError, match="taken over"):
                check_fence(first)
            check_fence(second)
        finally:
            second.release()
    finally:
        first.release()


def test_a_fenced_writer_commits_and_writes_nothing_after_a_take_over(run_copy, prefect_harness):
    """``--take-over`` of a live run (issue 27, item 8): the old writer's next stage commit raises
    ``LeaseLostError`` and commits nothing; its session ends without writing ``failed`` over the new
    holder's ``running``; the CLI's advice says the run was taken over (not "resume with"); the new
    holder's ``completed`` carries no error."""
    import contextlib
    import json

    import storage
    from flows.run.resolve import resolve_config
    from flows.run.lease import lease_refusal
    from flows.algorithms.grpo import GRPO
    from flows.run.session import RunIntent, run_session
    from nrl_tasks.stages.context import RunContext
    from nrl_tasks.stages.runner import run_stage
    from storage.lease import LeaseLostError

    layout = run_copy
    cfg = resolve_config(None, [], layout.root, run_id=E2E_RUN_ID)

    def status() -> dict:
        with open(layout.status_uri, encoding="utf-8") as fh:
            return json.load(fh)

    with contextlib.ExitStack() as old_stack:
        old = old_stack.enter_context(run_session(cfg, E2E_RUN_ID, recipe=GRPO, intent=RunIntent(resume=True)))
        old_running = old.running(max_steps=3)
        old_running.__enter__()
        old_run = RunContext(E2E_RUN_ID, layout, cfg, tokenizer=None, actors=None)
        old_run.fence = old.fence  # as the session's context() sets it
        with run_session(cfg, E2E_RUN_ID, recipe=GRPO, intent=RunIntent(resume=True, take_over=True)) as new:
            with new.running(max_steps=3):
                assert status()["status"] == "running"
                uri = layout.stage_uri(4, "rollouts")
                with pytest.raises(LeaseLostError, match="taken over") as lost:
                    run_stage(old_run.step(4), "generate", lambda inputs, timer: ({}, {}))
                assert not storage.is_committed(uri), "the fenced writer committed after the take-over"
                # the old flow unwinds with the error: it must not write its end over the new holder's status
                assert old_running.__exit__(LeaseLostError, lost.value, lost.value.__traceback__) is False
                assert status()["status"] == "running" and status().get("error") is None, status()
        advice = lease_refusal(lost.value)
        assert advice is not None and "took the run over" in advice and "resume with" not in advice, advice
    final = status()
    assert final["status"] == "completed" and final.get("error") is None, final


@pytest.mark.parametrize("damage", [b"", b"\x00\xff{not json"], ids=["empty", "garbage"])
def test_a_damaged_lease_file_is_named_and_taken_over(run_copy, prefect_harness, capsys, damage):
    """A lease file left empty or garbled (a heartbeat cut by a power loss): ``nrl runs`` lists
    every run and shows this one ``lease unreadable``; ``nrl resume`` refuses in one line naming
    the file and ``--take-over``; ``nrl resume --take-over`` takes the lease and resumes."""
    from flows.cli import main
    from flows.run.lease import lease_uri
    from flows.run.state import list_runs
    from storage.lease import read_lease

    layout = run_copy
    shutil.copytree(layout.run_uri, os.path.join(layout.root, "intact-run"))
    lease_dir = lease_uri(layout)
    damaged = os.path.join(lease_dir, sorted(os.listdir(lease_dir))[-1])  # the holder's own file, rewritten
    generation = read_lease(lease_dir).generation
    with open(damaged, "wb") as fh:
        fh.write(damage)

    states = {r["run_id"]: r["state"] for r in list_runs(layout.root)}
    assert states["intact-run"] == "completed" and "lease unreadable" in states[E2E_RUN_ID], states
    assert main(["runs", "--storage", layout.root]) == 0
    out = capsys.readouterr().out
    assert "intact-run" in out and "lease unreadable" in out, out

    assert main(["resume", E2E_RUN_ID, "--storage", layout.root]) == 2
    err = capsys.readouterr().err
    assert err.count("nrl: error:") == 1 and "Traceback" not in err, err
    assert damaged in err and f"nrl resume {E2E_RUN_ID} --take-over" in err, err

    rc = main(["resume", E2E_RUN_ID, "--storage", layout.root, "--take-over"])
    err = capsys.readouterr().err
    assert rc == 0, err
    holder = read_lease(lease_dir)
    assert holder.generation == generation + 1 and holder.released and holder.pid == os.getpid()
    assert {r["run_id"]: r["state"] for r in list_runs(layout.root)}[E2E_RUN_ID] == "completed"
