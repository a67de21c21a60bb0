"""Screenshots of watching a run, taken in a real headless browser (Debian's ``chromium``).

Not a benchmark: a reproducible tour of what a person sees. Everything is real and local:

1. a private Prefect server with its UI (``prefect server start`` on 127.0.0.1, SQLite);
2. a GRPO run of ``configs/grpo_tiny_demo.yaml`` (SFT warm start, then GRPO) through the ``nrl``
   CLI, with TensorBoard on (and MLflow, given ``--mlflow-uri``); mid-run the run summary
   artifact is captured (``summary-midrun.png``), after it the flow run's page and log
   (``flow-run.png``), the subflows list (``steps-list.png``: the ``grpo-steps`` flow's page, the
   run's steps grouped in subflow runs) and the first subflow's page (``step-graph.png``: its steps'
   stage tasks and data edges);
3. the ``eval-sweep`` flow served on a one-minute cron schedule (``Flow.serve``): after its first
   scheduled run the eval view artifact is captured (``eval-view.png``);
4. TensorBoard (``tensorboard --logdir``) on the reward curve (``tensorboard.png``; its WebGL line
   may not draw in a headless browser), and the MLflow run's reward curve when an MLflow server was
   given (``mlflow.png``, from the Prefect link artifact to the run);
5. a multi-turn run (the tiny model on the built-in guess-a-number game, 4 turns, chat template):
   its rollouts artifact with whole episodes, the best and the worst (``rollouts-multi-turn.png``);
6. a long run (``--long-steps``, default 200) of the ``grpo-train`` deployment on a process worker,
   SIGKILLed twice and retried as the UI's Retry does: the runs list at the UI's default settings,
   the run's page, its Artifacts tab and its summary with the history (:func:`long_run_tour`);
7. the post-training pipeline (``nrl pipeline --config configs/pipeline_tiny.yaml``): its flow
   run with one subflow per stage, the runs list and its summary (:func:`pipeline_tour`).

    python -m benchmarks.ui_tour --out /tmp/screens [--steps 20] [--mlflow-uri http://127.0.0.1:5000] [--parts run multi-turn long pipeline] [--long-steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from typing import Any

from nrl_tasks.utils.collective import find_free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} answered")
        try:
            urllib.request.urlopen(url, timeout=3).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer within {timeout_s:g} s") from None
            time.sleep(0.5)


def _api(api: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """One Prefect API call; a 503 (the SQLite server busy under load) is tried again, up to 10 times."""
    import urllib.error

    for attempt in range(10):
        req = urllib.request.Request(
            f"{api}{path}", data=json.dumps(body or {}).encode(), headers={"Content-Type": "application/json"},
            method="POST" if body is not None else "GET",
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or attempt == 9:
                raise
            time.sleep(1.0 + attempt)


def shoot(url: str, path: str, *, width: int = 1500, height: int = 1100, budget_ms: int = 25_000) -> None:
    """A PNG of ``url`` as headless Chromium renders it (JavaScript run for ``budget_ms`` of virtual time)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise RuntimeError("no chromium on PATH (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--enable-unsafe-swiftshader", "--use-angle=swiftshader", "--hide-scrollbars", f"--user-data-dir={profile}",
             "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-quic",
             f"--window-size={width},{height}", f"--virtual-time-budget={budget_ms}", f"--screenshot={path}", url],
            check=True, capture_output=True, timeout=180,
        )
    print(f"[tour] {os.path.basename(path)}: {url}", flush=True)


class Processes:
    """Processes this tour started, stopped by PID (process group) at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], env: dict[str, str], log: str) -> subprocess.Popen:
        fh = open(log, "w", encoding="utf-8")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)

    def close(self) -> None:
        for p in reversed(self.procs):
            try:
                self.stop(p)
            except ProcessLookupError:
                pass


def _artifact_id(api: str, key: str) -> str | None:
    rows = _api(api, "/artifacts/latest/filter", {"artifacts": {"key": {"any_": [key]}}, "limit": 1})
    return rows[0]["latest_id"] if rows else None  # the collection's newest version


def _flow_runs(api: str, flow_name: str, state: str = "COMPLETED") -> list[dict[str, Any]]:
    body = {"flows": {"name": {"any_": [flow_name]}}, "flow_runs": {"state": {"type": {"any_": [state]}}}, "limit": 20}
    return _api(api, "/flow_runs/filter", body)


def _metrics_steps(path: str) -> int:
    try:
        with open(path, encoding="utf-8") as fh:
            return sum(1 for line in fh if line.strip())
    except FileNotFoundError:
        return 0


def run_tour(args: argparse.Namespace, procs: Processes, env: dict[str, str], api: str, ui: str, out: str, tmp: str) -> None:
    """Parts 1-4: the GRPO run, its pages, the scheduled eval sweep, TensorBoard and MLflow."""
    from flows.observe.artifacts import artifact_key

    run_id, root, logs = "tour", os.path.join(tmp, "runs"), os.path.join(tmp, "logs")
    over = [f"warm_start.sft_steps={args.sft_steps}", f"grpo.max_num_steps={args.steps}", "checkpointing.save_period=5",
            "grpo.val_period=5", "logger.tensorboard_enabled=true", f"logger.log_dir={logs}", "logger.console=false"]
    if args.mlflow_uri:
        over += ["logger.mlflow_enabled=true", f"logger.mlflow.tracking_uri={args.mlflow_uri}"]
    train = procs.start([os.path.join(BIN, "nrl"), "grpo", "--config", "configs/grpo_tiny_demo.yaml", "--storage", root,
                         "--run-id", run_id, *over], env, os.path.join(tmp, "grpo.log"))
    metrics = os.path.join(root, run_id, "metrics.jsonl")
    key = artifact_key(run_id, "summary")
    while _metrics_steps(metrics) < args.steps // 2:
        if train.poll() is not None:
            raise RuntimeError(f"the grpo run ended early ({train.returncode}); see {tmp}/grpo.log")
        time.sleep(2)
    time.sleep(3)  # the summary is published off the training loop's critical path
    aid = _artifact_id(api, key)
    if aid:
        shoot(f"{ui}/artifacts/artifact/{aid}", os.path.join(out, "summary-midrun.png"))
    if train.wait(1800) != 0:
        raise RuntimeError(f"the grpo run failed ({train.returncode}); see {tmp}/grpo.log")
    grpo_run = next(r for r in _flow_runs(api, "grpo") if r["name"] == run_id)
    shoot(f"{ui}/runs/flow-run/{grpo_run['id']}", os.path.join(out, "flow-run.png"), height=1400)
    aid = _artifact_id(api, key)
    if aid:  # the summary at the end: plot, history
        shoot(f"{ui}/artifacts/artifact/{aid}", os.path.join(out, "summary-end.png"), height=1400)
    shoot(f"{ui}/runs", os.path.join(out, "runs-list.png"), height=1400)  # the runs list at the UI's default settings
    # the run's subflows (its steps, grouped) and one subflow's graph: its steps' stage tasks and edges
    steps_flow = _api(api, "/flows/filter", {"flows": {"name": {"any_": ["grpo-steps"]}}, "limit": 1})
    if steps_flow:  # the UI's page of the grpo-steps flow lists the subflow runs
        shoot(f"{ui}/flows/flow/{steps_flow[0]['id']}", os.path.join(out, "steps-list.png"), height=1400)
    sub = _api(api, "/flow_runs/filter", {"flows": {"name": {"any_": ["grpo-steps", "grpo-step"]}},
                                          "flow_runs": {"parent_flow_run_id": {"any_": [grpo_run["id"]]}},
                                          "sort": "EXPECTED_START_TIME_ASC", "limit": 1})
    if sub:
        shoot(f"{ui}/runs/flow-run/{sub[0]['id']}", os.path.join(out, "step-graph.png"), height=1000)

    # the eval sweep on a cron schedule: its first scheduled run
    serve_code = (
        "from flows.algorithms.evaluate import eval_sweep\n"
        f"eval_sweep.serve(name='eval-sweep', cron='* * * * *', parameters={{'target': {root!r}, 'num_samples': 4}})\n"
    )
    served = procs.start([sys.executable, "-c", serve_code], env, os.path.join(tmp, "serve.log"))
    deadline = time.monotonic() + 600
    done = None
    while done is None:
        if served.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no scheduled eval sweep completed; see {tmp}/serve.log")
        time.sleep(5)
        done = next((r for r in _flow_runs(api, "eval-sweep") if r["state_type"] == "COMPLETED"), None)
    procs.stop(served)
    print(f"[tour] scheduled eval sweep {done['name']} completed", flush=True)
    aid = _artifact_id(api, artifact_key(os.path.basename(root), "evals"))
    if aid:
        shoot(f"{ui}/artifacts/artifact/{aid}", os.path.join(out, "eval-view.png"), height=1300)

    tb_port = find_free_port()
    tb = procs.start([os.path.join(BIN, "tensorboard"), "--logdir", logs, "--host", "127.0.0.1", "--port", str(tb_port)],
                     env, os.path.join(tmp, "tensorboard.log"))
    _wait_http(f"http://127.0.0.1:{tb_port}/", 120, tb)
    tag = urllib.parse.quote("train/reward_mean")
    shoot(f"http://127.0.0.1:{tb_port}/?darkMode=false&tagFilter={tag}#timeseries", os.path.join(out, "tensorboard.png"))
    if args.mlflow_uri:
        aid = _artifact_id(api, artifact_key(run_id, "mlflow"))
        if aid is None:
            keys = [a["key"] for a in _api(api, "/artifacts/latest/filter", {"limit": 50})]
            raise RuntimeError(f"no MLflow link artifact; the artifact keys: {keys}")
        link = _api(api, f"/artifacts/{aid}")["data"]  # "[text](url)"
        url = link.split("](", 1)[1].rstrip(")") if "](" in link else link
        base, exp_run = url.split("/#/experiments/", 1)
        exp, mlflow_run = exp_run.split("/runs/", 1)
        q = lambda v: urllib.parse.quote(json.dumps(v))  # noqa: E731 - MLflow's metric page takes JSON values
        shoot(f"{base}/#/metric?runs={q([mlflow_run])}&metric={q('train/reward_mean')}&experiments={q([exp])}"
              f"&plot_metric_keys={q(['train/reward_mean'])}&x_axis=step", os.path.join(out, "mlflow.png"), height=1000)


def multi_turn_tour(procs: Processes, env: dict[str, str], api: str, ui: str, out: str, tmp: str, steps: int) -> None:
    """A short multi-turn GRPO run and its rollouts artifact: the episodes' conversations."""
    from flows.observe.artifacts import artifact_key

    run_id = "tour-mt"
    over = ["data.dataset=guess_number", "env.environment=guess_number", "data.arithmetic.max_operand=16",
            "grpo.max_rollout_turns=4", "data.chat_template=true", "generation.max_new_tokens=6",
            "policy.max_total_sequence_length=192", f"grpo.max_num_steps={steps}", "checkpointing.enabled=false",
            "logger.console=false"]
    train = procs.start([os.path.join(BIN, "nrl"), "grpo", "--config", "configs/grpo_tiny.yaml", "--storage",
                         os.path.join(tmp, "runs"), "--run-id", run_id, *over], env, os.path.join(tmp, "grpo-mt.log"))
    if train.wait(1800) != 0:
        raise RuntimeError(f"the multi-turn grpo run failed ({train.returncode}); see {tmp}/grpo-mt.log")
    aid = _artifact_id(api, artifact_key(run_id, "rollouts"))
    if aid is None:
        raise RuntimeError("the multi-turn run published no rollouts artifact")
    shoot(f"{ui}/artifacts/artifact/{aid}", os.path.join(out, "rollouts-multi-turn.png"), height=1600)


def pipeline_tour(procs: Processes, env: dict[str, str], api: str, ui: str, out: str, tmp: str) -> None:
    """The post-training pipeline (``configs/pipeline_tiny.yaml``: sft -> dpo -> grpo -> eval) run
    by ``nrl pipeline``: its flow run's page with one subflow per stage (``pipeline-run.png``),
    the runs list (``pipeline-runs.png``) and the pipeline's summary (``pipeline-summary.png``)."""
    from flows.observe.artifacts import artifact_key

    pid = "tour-pipe"
    proc = procs.start([os.path.join(BIN, "nrl"), "pipeline", "--config", "configs/pipeline_tiny.yaml", "--storage",
                        os.path.join(tmp, "runs"), "--run-id", pid], env, os.path.join(tmp, "pipeline.log"))
    if proc.wait(1800) != 0:
        raise RuntimeError(f"the pipeline failed ({proc.returncode}); see {tmp}/pipeline.log")
    top = _api(api, "/flow_runs/filter", {"flow_runs": {"name": {"any_": [pid]}}, "limit": 1})
    if not top:
        raise RuntimeError(f"no flow run {pid}")
    shoot(f"{ui}/runs/flow-run/{top[0]['id']}", os.path.join(out, "pipeline-run.png"), height=1200)
    shoot(f"{ui}/runs", os.path.join(out, "pipeline-runs.png"), height=1200)
    aid = _artifact_id(api, artifact_key(pid, "summary"))
    if aid:
        shoot(f"{ui}/artifacts/artifact/{aid}", os.path.join(out, "pipeline-summary.png"), height=1900)


def _count_in(path: str, text: str) -> int:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read().count(text)
    except FileNotFoundError:
        return 0


def _flow_run(api: str, flow_run_id: str) -> dict[str, Any]:
    return _api(api, f"/flow_runs/{flow_run_id}")


def _wait_state(api: str, flow_run_id: str, want: str, log: str, timeout_s: float = 1800) -> None:
    deadline = time.monotonic() + timeout_s
    while (state := _flow_run(api, flow_run_id)["state_type"]) != want:
        if state in {"FAILED", "CRASHED", "COMPLETED", "CANCELLED"} - {want} or time.monotonic() > deadline:
            raise RuntimeError(f"flow run {flow_run_id} ended {state}, not {want}; see {log}")
        time.sleep(2)


def long_run_tour(procs: Processes, env: dict[str, str], api: str, ui: str, out: str, tmp: str, steps: int) -> None:
    """Part 6: a long run of the ``grpo-train`` deployment (the tiny config, ``steps`` steps, the
    default step grouping) on a process worker whose flow process is SIGKILLed twice (the fault
    plug-in of the tests, ``NRL_FAULT_KILL_AT``: after ``train`` commits at 35% and 70% of the
    steps), each time retried as the UI's Retry does (``prefect flow-run retry``), then extended by
    two steps with the README's command and started again under its id (refused); then the runs
    list at the UI's default settings (``runs-list-long.png``), the same filtered by the run's
    ``flow:<run_id>`` tag (``runs-filtered-long.png``), the dashboard (``dashboard-long.png``), the
    run's page (``flow-run-long.png``), its Artifacts tab (``artifacts-long.png``) and its summary
    with the history (``summary-long.png``)."""
    from flows.observe.artifacts import artifact_key

    prefect = os.path.join(BIN, "prefect")
    root, run_id = os.path.join(tmp, "runs-long"), "long"
    kills = [max(2, steps * 35 // 100), max(3, steps * 70 // 100)]
    subprocess.run([prefect, "work-pool", "create", "local", "--type", "process"], env=env, cwd=REPO, check=True,
                   capture_output=True, timeout=120)
    subprocess.run([prefect, "--no-prompt", "deploy", "-n", "grpo-train"], env={**env, "NRL_REPO_DIR": REPO}, cwd=REPO,
                   check=True, capture_output=True, timeout=300)
    worker_log = os.path.join(tmp, "worker.log")
    fault_env = {**env, "NRL_REPO_DIR": REPO, "PYTHONPATH": REPO, "NRL_PLUGINS": "tests.faults.injection",
                 "NRL_FAULT_KILL_AT": ",".join(f"train@{k}:after" for k in kills)}
    procs.start([prefect, "worker", "start", "--pool", "local", "--name", "tour-worker"], fault_env, worker_log)
    dep = _api(api, "/deployments/name/grpo/grpo-train")
    params = {"config": "configs/grpo_tiny.yaml", "run_id": run_id, "storage": root,
              "overrides": [f"grpo.max_num_steps={steps}", "checkpointing.save_period=10", "logger.console=false"]}
    fid = _api(api, f"/deployments/{dep['id']}/create_flow_run", {"parameters": params})["id"]
    crash_line = "prefect.flow_runs.worker - Check whether the flow run exceeded its memory"  # the worker's own report
    for n, k in enumerate(kills, start=1):
        deadline = time.monotonic() + 1800
        while (fr := _flow_run(api, fid))["state_type"] != "CRASHED" or fr["run_count"] < n:  # attempt n crashed
            if time.monotonic() > deadline:
                raise RuntimeError(f"the long run did not crash at step {k}; see {worker_log}")
            time.sleep(3)
        deadline = time.monotonic() + 60  # Prefect 3.9 reports a crash twice (runner, worker); retry after the worker's
        while _count_in(worker_log, crash_line) < n and time.monotonic() < deadline:
            time.sleep(0.5)
        print(f"[tour] long run crashed at step {k} (SIGKILL); retrying it as the UI's Retry does", flush=True)
        subprocess.run([prefect, "flow-run", "retry", fid], env=env, cwd=REPO, check=True, capture_output=True, timeout=120)
    deadline = time.monotonic() + 3600
    while (state := _flow_run(api, fid)["state_type"]) != "COMPLETED":
        if state in ("FAILED", "CRASHED") or time.monotonic() > deadline:
            raise RuntimeError(f"the long run ended {state}; see {worker_log}")
        time.sleep(3)
    # the README's extend (the deployment's default config is sent along and not used), then a start
    # of the same id, refused: Cancelled with the reason, not a red Failed
    ext = _api(api, f"/deployments/{dep['id']}/create_flow_run", {"parameters": {
        "run_id": run_id, "storage": root, "resume": True, "overrides": [f"grpo.max_num_steps={steps + 2}"]}})["id"]
    _wait_state(api, ext, "COMPLETED", worker_log)
    refused = _api(api, f"/deployments/{dep['id']}/create_flow_run", {"parameters": {"run_id": run_id, "storage": root}})["id"]
    _wait_state(api, refused, "CANCELLED", worker_log)
    print(f"[tour] extended to {steps + 2} steps ({_flow_run(api, ext)['name']}); a second start refused: "
          f"{_flow_run(api, refused)['name']} {_flow_run(api, refused)['state_type']}", flush=True)
    runs = _api(api, "/flow_runs/filter", {"flow_runs": {"tags": {"all_": [f"run:{run_id}"]}}, "limit": 200})
    subs = _api(api, "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [fid]}}, "limit": 200})
    arts = _api(api, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [fid]}}, "limit": 200})
    print(f"[tour] long run: {steps} steps, flow run {_flow_run(api, fid)['name']} (3 attempts), "
          f"{len({r['id'] for r in runs + subs})} flow runs, {len([a for a in arts if a.get('key')])} keyed artifact versions", flush=True)
    shoot(f"{ui}/runs", os.path.join(out, "runs-list-long.png"), height=1400)
    shoot(f"{ui}/runs?tags={urllib.parse.quote('flow:' + run_id)}", os.path.join(out, "runs-filtered-long.png"), height=900)
    shoot(f"{ui}/dashboard", os.path.join(out, "dashboard-long.png"), height=1200)
    shoot(f"{ui}/runs/flow-run/{fid}", os.path.join(out, "flow-run-long.png"), height=1400)
    shoot(f"{ui}/runs/flow-run/{fid}?tab=Artifacts", os.path.join(out, "artifacts-long.png"), height=1400)
    aid = _artifact_id(api, artifact_key(run_id, "summary"))
    if aid:
        shoot(f"{ui}/artifacts/artifact/{aid}", os.path.join(out, "summary-long.png"), height=1600)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ui_tour", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="ui-screens")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sft-steps", type=int, default=40)
    ap.add_argument("--mlflow-uri", default=None, help="an MLflow server the run logs to (its UI is captured)")
    ap.add_argument("--parts", nargs="*", choices=["run", "multi-turn", "long", "pipeline"],
                    default=["run", "multi-turn", "long", "pipeline"],
                    help="run: the GRPO run, its eval sweep and trackers (1-4); multi-turn: 5; long: 6; pipeline: 7")
    ap.add_argument("--long-steps", type=int, default=200)
    ap.add_argument("--multi-turn-steps", type=int, default=3)
    args = ap.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="nrl-tour-")
    port = find_free_port()
    api = f"http://127.0.0.1:{port}/api"
    ui = f"http://127.0.0.1:{port}"
    env = {
        **os.environ, "PREFECT_HOME": os.path.join(tmp, "prefect"), "PREFECT_API_URL": api, "PREFECT_UI_URL": ui,
        "PREFECT_SERVER_UI_API_URL": api, "PREFECT_UI_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false", "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
    }
    procs = Processes()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped tour stops what it started (finally below)
    try:
        server = procs.start([os.path.join(BIN, "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                             env, os.path.join(tmp, "server.log"))
        _wait_http(f"{api}/health", 240, server)
        pages = f"{ui}/v2"  # Prefect 3.9's current UI (the same paths without /v2 open the old one)
        if "run" in args.parts:
            run_tour(args, procs, env, api, pages, out, tmp)
        if "multi-turn" in args.parts:
            multi_turn_tour(procs, env, api, pages, out, tmp, args.multi_turn_steps)
        if "long" in args.parts:
            long_run_tour(procs, env, api, pages, out, tmp, args.long_steps)
        if "pipeline" in args.parts:
            pipeline_tour(procs, env, api, pages, out, tmp)
        print(f"[tour] screenshots in {out}; run files in {tmp}", flush=True)
    finally:
        procs.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
