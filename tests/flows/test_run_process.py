"""A ``running`` status checked against its flow process (real processes: a dead pid, this one, a
reused pid), ``nrl runs`` showing a crashed run, and the reaping of a dead flow's local-Ray
leftovers (real processes holding files under a session directory, one deaf to SIGTERM)."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from flows.run.process import current_process, describe_status, flow_process_alive, reap_local_ray, this_host

#: a child that opens the file $HOLD_PATH, ignores SIGTERM, says "ready" and sleeps (the path is
#: not on its command line: like a renamed ``ray::DashboardAgent``, only its open log file tells)
HOLDER = (
    "import os, signal, time; path = os.environ['HOLD_PATH']; os.makedirs(os.path.dirname(path), exist_ok=True); "
    "f = open(path, 'a'); signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(120)"
)


def _dead_process() -> dict:
    """``flow_process`` record of a real process that ran and exited (its pid is free now)."""
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    info = {"host": this_host(), "pid": p.pid, "started_unix": psutil.Process(p.pid).create_time()}
    p.stdin.close()
    p.wait(timeout=30)
    return info


def _holder(path: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True, env={**os.environ, "HOLD_PATH": path})
    assert p.stdout.readline().strip() == "ready"
    return p


def test_running_status_of_a_dead_flow_process_reads_crashed():
    info = _dead_process()
    status = {"status": "running", "flow_process": info}
    assert flow_process_alive(info) is False
    assert describe_status(status) == f"crashed (flow process {info['pid']} on {this_host()} is gone)"


def test_running_status_of_a_live_flow_process_stays_running():
    me = current_process()
    assert me["pid"] == os.getpid() and me["host"] == this_host()
    assert flow_process_alive(me) is True
    assert describe_status({"status": "running", "flow_process": me}) == "running"


def test_a_reused_pid_is_not_the_flow_process():
    me = current_process()
    reused = {**me, "started_unix": me["started_unix"] - 3600.0}  # same pid, a process started an hour earlier
    assert flow_process_alive(reused) is False
    assert describe_status({"status": "running", "flow_process": reused}).startswith("crashed (flow process")


@pytest.mark.parametrize(
    "status, shown",
    [
        ({"status": "running", "flow_process": {"host": "another-host.invalid", "pid": os.getpid()}}, "running?"),
        ({"status": "running"}, "running?"),  # written before flow processes were recorded
        ({"status": "completed", "flow_process": {"host": "x", "pid": 1}}, "completed"),
        ({"status": "failed"}, "failed"),
        ({}, "unknown"),
    ],
)
def test_status_without_a_local_process_to_check(status, shown):
    assert describe_status(status) == shown


def test_nrl_runs_shows_a_crashed_run(tmp_path, capsys):
    from flows.cli import main
    from flows.config import load_config
    from nrl_tasks.run_layout import RunLayout
    from flows.run.state import init_run, list_runs, write_status
    from tests.fixtures.grpo_runs import TINY_CONFIG

    root = str(tmp_path / "runs")
    cfg = load_config(TINY_CONFIG, [f"storage.root={root}"])
    for run_id, fields in {
        "crashed-run": {"status": "running", "flow_process": _dead_process()},
        "live-run": {"status": "running", "flow_process": current_process()},
        "remote-run": {"status": "running", "flow_process": {"host": "another-host.invalid", "pid": 4242}},
        "done-run": {"status": "completed"},
    }.items():
        layout = RunLayout(root, run_id)
        init_run(layout, cfg, resume=False)
        write_status(layout, None, max_steps=3, **fields)
    states = {r["run_id"]: (r["status"], r["state"]) for r in list_runs(root)}
    dead_pid = states["crashed-run"][1].split()[3]
    assert states == {
        "crashed-run": ("running", f"crashed (flow process {dead_pid} on {this_host()} is gone)"),
        "live-run": ("running", "running"),
        "remote-run": ("running", "running?"),
        "done-run": ("completed", "completed"),
    }
    assert main(["runs", "--storage", root]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[1:]}
    assert lines["crashed-run"].endswith(f"crashed (flow process {dead_pid} on {this_host()} is gone)")
    assert lines["live-run"].endswith(" running") and lines["remote-run"].endswith(" running?")
    assert " 0/3 " in lines["done-run"] and lines["done-run"].endswith(" completed")


def test_reap_kills_only_the_dead_flows_session(tmp_path):
    session = tmp_path / "ray" / "session_2026-01-01_00-00-00_000000_1"
    other = tmp_path / "ray" / "session_2026-01-01_00-00-00_000000_2"
    leftover = _holder(str(session / "logs" / "dashboard_agent.log"))  # deaf to SIGTERM, like the agents
    bystander = _holder(str(other / "logs" / "dashboard_agent.log"))
    try:
        local_ray = {"host": this_host(), "session_dir": str(session)}
        # the flow process still lives, or the Ray is on another host: nothing is touched
        assert reap_local_ray({"local_ray": local_ray, "flow_process": current_process()}) == []
        assert reap_local_ray({"local_ray": {**local_ray, "host": "another-host.invalid"}, "flow_process": _dead_process()}) == []
        assert reap_local_ray({"flow_process": _dead_process()}) == []  # a Ray the run only connected to
        assert leftover.poll() is None and bystander.poll() is None
        # the flow process is gone: its session's processes go, the other session's stay
        killed = reap_local_ray({"local_ray": local_ray, "flow_process": _dead_process()}, grace_s=1.0)
        assert len(killed) == 1 and killed[0].endswith(f"({leftover.pid})"), killed
        leftover.wait(timeout=10)  # SIGTERM ignored: SIGKILLed after the grace period (reaped by psutil)
        assert not psutil.pid_exists(leftover.pid)
        assert bystander.poll() is None
    finally:
        for p in (leftover, bystander):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


def test_session_processes_refuses_a_non_session_root():
    from flows.run.process import session_processes

    for bad in ("", "/", "/tmp"):
        with pytest.raises(ValueError, match="session"):
            session_processes(bad)


def test_a_failed_runs_last_line_names_the_root_cause_through_rays_wrappers(ray_session, tmp_path, capsys):
    """A worker's ValueError (a bad LoRA key in ``PolicyWorker.setup``), ENOSPC, a
    ``NonFiniteTrainingError`` and a constructor that raises, all seen through real Ray actors:
    the CLI's last line is ``nrl: run R failed: <Type>: <message>`` of the worker's exception
    (was: ``RayTaskError(ValueError): ray::PolicyWorker.setup() (pid=..., repr=<...>)`` and the
    remote traceback) (issue 27, item 6b)."""
    import errno

    import ray

    from flows.cli_run import EXIT_FAILED, run_flow
    from nrl_tasks.models.policy.errors import NonFiniteTrainingError
    from nrl_tasks.run_layout import RunLayout

    @ray.remote(num_cpus=0)
    class Worker:
        def setup(self):
            raise ValueError("policy.dtensor_cfg.lora_cfg.target_modules: no module matches 'no_such_proj'")

        def save(self):
            raise OSError(errno.ENOSPC, "No space left on device", "/runs/r/steps/step_000001")

        def train(self):
            raise NonFiniteTrainingError("non-finite loss nan at global batch 0", what="loss", value=float("nan"))

    @ray.remote(num_cpus=0)
    class Broken:
        def __init__(self):
            raise ValueError("lora dim 1000000000 is too large")

        def ping(self):
            return 1

    layout = RunLayout(str(tmp_path), "r1")
    worker = Worker.remote()
    cases = [
        (worker.setup.remote, "ValueError: policy.dtensor_cfg.lora_cfg.target_modules: no module matches 'no_such_proj'"),
        (worker.save.remote, "OSError: [Errno 28] No space left on device: '/runs/r/steps/step_000001'"),
        (worker.train.remote, "NonFiniteTrainingError: non-finite loss nan at global batch 0"),
        (lambda: Broken.remote().ping.remote(), "ValueError: lora dim 1000000000 is too large"),
    ]
    for call, want in cases:
        capsys.readouterr()
        assert run_flow(lambda: ray.get(call()), layout) == EXIT_FAILED
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("nrl: run r1 failed: ") and last.endswith(want), last
        assert "RayTaskError" not in last and "pid=" not in last, last


def test_a_failed_runs_status_records_the_root_cause_through_rays_wrappers(ray_session, tmp_path):
    """``status.json``'s ``error`` of a run whose worker raised is the worker's exception, as the
    CLI's last line says it (:func:`describe_error`), not Ray's wrapper with its remote traceback
    (issue 27, item 6b)."""
    import ray

    from flows.run.resolve import resolve_config
    from flows.algorithms.grpo import GRPO
    from flows.run.session import run_session
    from flows.run.state import read_status
    from nrl_tasks.run_layout import RunLayout
    from tests.fixtures.grpo_runs import TINY_CONFIG

    @ray.remote(num_cpus=0)
    class Worker:
        def setup(self):
            raise ValueError("policy.dtensor_cfg.lora_cfg.alpha makes the scale overflow")

    cfg = resolve_config(TINY_CONFIG, [], str(tmp_path), recipe=GRPO)
    with run_session(cfg, "r1", recipe=GRPO) as session:
        with pytest.raises(ValueError, match="scale overflow"):
            with session.running(max_steps=1):
                ray.get(Worker.remote().setup.remote())
    status = read_status(RunLayout(str(tmp_path), "r1"), None)
    assert status["status"] == "failed", status
    assert status["error"] == "ValueError: policy.dtensor_cfg.lora_cfg.alpha makes the scale overflow", status
