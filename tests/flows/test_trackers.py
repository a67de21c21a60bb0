"""The trackers, read back with each tracker's own reader (TensorBoard's event reader, an MLflow
client on a real ``mlflow server`` or SQLite store, ``wandb leet inspect`` on W&B's offline
files): every metrics-line figure a curve, evaluations as ``eval/*`` points logged once, the
resolved config, a resumed run appending to the same curves without a duplicate or missing step,
and a failing tracker (a server killed mid-run) never failing the run."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import uuid

import pytest

from flows.observe.trackers import TensorBoardTracker, TrackerSet, open_trackers, publish_tracker_links, scalar_fields
from tests.fixtures.mlflow_server import MLflowServer

ROWS = [{"step": s, "reward_mean": s / 10, "loss": 1.0 - s / 10, "rebuilt": False} for s in range(1, 6)]
CONFIG = {"grpo": {"max_num_steps": 5, "seed": 42}, "logger": {"log_dir": "logs"}, "tags": ["a", "b"]}
MLFLOW_HTTP_ENV = ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES")


@pytest.fixture(autouse=True)
def _hermetic_tracker_env(tmp_path, monkeypatch):
    """No W&B network or home-directory state; MLflow's HTTP env restored after each test (the
    tracker sets it when unset)."""
    for k in MLFLOW_HTTP_ENV + ("WANDB_MODE",):
        monkeypatch.setenv(k, "x")
        monkeypatch.delenv(k)
    for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(k, str(tmp_path / "wandb-home" / k.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` (its own venv, a SQLite store) for this module's tests."""
    server = MLflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()


def _scalars(path: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalar_fields_keep_finite_numbers_only():
    row = {"step": 3, "reward_mean": 0.5, "loss": None, "grad_norm": float("nan"), "logprob_skipped": True,
           "val_accuracy": 0.25, "reward_errors": "x", "rebuilt": True}
    assert scalar_fields(row) == {"train/reward_mean": 0.5, "train/logprob_skipped": 1.0, "validation/accuracy": 0.25}


def test_reopened_tracker_continues_without_duplicates(tmp_path):
    rows = [{"step": s, "reward_mean": s / 10} for s in range(1, 6)]
    t = TensorBoardTracker(str(tmp_path), "r", "a: 1")
    TrackerSet([t]).sync(rows[:3])
    t.close()
    again = TensorBoardTracker(str(tmp_path), "r", "a: 1")  # a resume: reads where the curves end
    assert again.last_step() == 3
    TrackerSet([again]).sync(rows)  # all lines again, as metrics.jsonl holds them
    again.close()
    got = _scalars(os.path.join(str(tmp_path), "r", "tensorboard"))["train/reward_mean"]
    assert [s for s, _ in got] == [1, 2, 3, 4, 5]
    assert [round(v, 6) for _, v in got] == [0.1, 0.2, 0.3, 0.4, 0.5]


def test_a_failing_tracker_is_warned_about_and_the_others_go_on(tmp_path, caplog):
    class Broken:
        def last_step(self) -> int:
            raise ConnectionError("tracking server down")

        def close(self) -> None: ...

    good = TensorBoardTracker(str(tmp_path), "r2")
    with caplog.at_level(logging.WARNING):
        TrackerSet([Broken(), good]).sync([{"step": 1, "reward_mean": 1.0}])
    assert "tracking server down" in caplog.text and good.last_step() == 1
    good.close()


@pytest.mark.slow  # a killed whole-flow run and its resume: in the slow suite (keeps make test under 10 minutes)
def test_grpo_run_and_its_resume_write_one_curve_point_per_step(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flows.algorithms.grpo import grpo
    from flows.observe.metrics import read_metrics
    from tests.fixtures.grpo_runs import kill_run_actors, tiny_run_config

    root, logs, run_id = str(tmp_path / "runs"), str(tmp_path / "logs"), "tb-run"
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{
        "grpo.max_num_steps": 2, "logger.tensorboard_enabled": True, "logger.log_dir": logs,
        "logger.mlflow_enabled": True, "logger.wandb_enabled": True})
    try:
        grpo(config=cfg, run_id=run_id)
        grpo(run_id=run_id, resume=True, storage=root, overrides=["grpo.max_num_steps=3"])
    finally:
        kill_run_actors(run_id)
    path = os.path.join(logs, run_id, "tensorboard")
    got = _scalars(path)
    rows = read_metrics(os.path.join(root, run_id, "metrics.jsonl"))
    for key in ("reward_mean", "loss", "train_s"):
        assert [s for s, _ in got[f"train/{key}"]] == [1, 2, 3], key
        assert [v for _, v in got[f"train/{key}"]] == pytest.approx([r[key] for r in rows], rel=1e-6), key
    acc = EventAccumulator(path)
    acc.Reload()
    assert "config" in " ".join(acc.Tags().get("tensors", [])), acc.Tags()
    # the same curves, once each, in the MLflow run (default SQLite store) and the W&B offline run
    uri = "sqlite:///" + os.path.join(os.path.abspath(logs), "mlflow", "mlflow.db")
    from mlflow.tracking import MlflowClient

    (run,) = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("nrl-flows").experiment_id])
    assert [s for s, _ in _mlflow_history(uri, run.info.run_id, "train/reward_mean")] == [1, 2, 3]
    assert run.data.params["grpo.max_num_steps"] == "2" and run.info.run_name == run_id
    records = _wandb_records(os.path.join(logs, run_id, "wandb"))
    assert [r["history"]["item"]["trainer/step"] for r in records if r.get("type") == "history"] == [1, 2, 3]


def test_tensorboard_eval_points_are_logged_once_and_survive_a_reopen(tmp_path):
    t = TensorBoardTracker(str(tmp_path), "r3")
    ts = TrackerSet([t])
    ts.sync(ROWS[:2])
    ts.log_eval(2, {"accuracy": 0.5, "split": "test"})
    ts.log_eval(2, {"accuracy": 0.5})
    t.close()
    again = TensorBoardTracker(str(tmp_path), "r3")
    again.log_eval(2, {"accuracy": 0.5})  # after a resume too
    again.log_eval(4, {"accuracy": 0.75})
    assert again.last_step() == 2 and again.link() == ("TensorBoard", os.path.join(str(tmp_path), "r3", "tensorboard"))
    again.close()
    assert _scalars(os.path.join(str(tmp_path), "r3", "tensorboard"))["eval/accuracy"] == [(2, 0.5), (4, 0.75)]


# --- MLflow -------------------------------------------------------------------------------------


def _mlflow_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, round(m.value, 6)) for m in MlflowClient(uri).get_metric_history(run_id, key))


# the real server (its own venv, ~80 s to build on a fresh clone) runs in the slow suite
@pytest.mark.parametrize("store", ["sqlite", pytest.param("server", marks=pytest.mark.slow)])
def test_mlflow_resume_continues_the_same_run(store, tmp_path, request):
    from mlflow.tracking import MlflowClient

    from flows.config import MLflowConfig
    from flows.observe.trackers_mlflow import MLflowTracker

    uri = request.getfixturevalue("mlflow_server").uri if store == "server" else None
    cfg = MLflowConfig(experiment_name=f"exp-{uuid.uuid4().hex[:8]}", tracking_uri=uri)
    logs = str(tmp_path / "logs")
    t = MLflowTracker(logs, "Run-A", cfg, CONFIG)
    TrackerSet([t]).sync(ROWS[:3])
    t.log_eval(2, {"accuracy": 0.5})
    t.close()

    again = MLflowTracker(logs, "Run-A", cfg, CONFIG)  # a resume: a new object finds the run by its tag
    assert (again.run_id, again.last_step()) == (t.run_id, 3)
    ts = TrackerSet([again])
    ts.sync(ROWS)  # all lines again, as metrics.jsonl holds them
    ts.log_eval(2, {"accuracy": 0.5})
    ts.log_eval(2, {"accuracy": 0.5})
    ts.log_eval(4, {"accuracy": 0.75})
    again.close()

    uri = again.tracking_uri
    assert uri == (cfg.tracking_uri or "sqlite:///" + os.path.abspath(os.path.join(logs, "mlflow", "mlflow.db")))
    client = MlflowClient(uri)
    runs = client.search_runs([again.experiment_id])
    assert [r.info.run_id for r in runs] == [t.run_id] and runs[0].info.run_name == "Run-A"
    assert _mlflow_history(uri, t.run_id, "train/reward_mean") == [(s, s / 10) for s in range(1, 6)]
    assert [s for s, _ in _mlflow_history(uri, t.run_id, "train/loss")] == [1, 2, 3, 4, 5]
    assert _mlflow_history(uri, t.run_id, "eval/accuracy") == [(2, 0.5), (4, 0.75)]
    params = runs[0].data.params
    assert params["grpo.max_num_steps"] == "5" and params["logger.log_dir"] == "logs" and params["tags"] == '["a", "b"]'
    assert "train/rebuilt" not in runs[0].data.metrics and "train/step" not in runs[0].data.metrics
    label, link = again.link()
    if store == "server":
        assert link == f"{uri}/#/experiments/{again.experiment_id}/runs/{t.run_id}"
        import urllib.request

        with urllib.request.urlopen(link.split("#")[0], timeout=10) as r:  # the UI answers at that base
            assert r.status == 200
    else:
        assert (label, link) == ("MLflow", uri) and os.path.exists(os.path.join(logs, "mlflow", "mlflow.db"))


def test_open_trackers_opens_the_enabled_and_skips_one_that_cannot_open(tmp_path, caplog):
    from flows.config import LoggerConfig

    class Cfg:  # what open_trackers reads of a MasterConfig
        logger = LoggerConfig(
            tensorboard_enabled=True, mlflow_enabled=True, wandb_enabled=True, log_dir=str(tmp_path),
            mlflow={"tracking_uri": "http://nrl:s3cret@127.0.0.1:9/", "experiment_name": "e"},
        )  # fmt: skip

        def model_dump(self, mode: str) -> dict:
            return {"logger": self.logger.model_dump(mode=mode), "storage": {"secret_key": "k"}}

    with caplog.at_level(logging.WARNING):
        ts = open_trackers(Cfg(), "r")  # nothing listens on port 9: MLflow does not open, fast (no retries)
    assert [type(t).__name__ for t in ts.trackers] == ["TensorBoardTracker", "WandbTracker"]
    assert "MLflow tracker not opened" in caplog.text and "s3cret" not in caplog.text
    run_dir = os.path.join(str(tmp_path), "r")
    assert ts.links() == {"TensorBoard": os.path.join(run_dir, "tensorboard"), "W&B": os.path.join(run_dir, "wandb")}
    ts.sync(ROWS[:1])
    ts.close()
    (run,) = [r["run"] for r in _wandb_records(os.path.join(run_dir, "wandb")) if r.get("type") == "run"]
    assert run["config"]["update"]["logger"]["mlflow"]["tracking_uri"] == "http://***@127.0.0.1:9/"  # the config, no secret
    assert run["config"]["update"]["storage"] == {"secret_key": "***"}
    with pytest.raises(Exception, match="extra"):
        LoggerConfig(mlflow={"experiment": "typo"})


def test_tracker_links_become_prefect_link_artifacts(prefect_harness):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.observe.artifacts import artifact_key

    url = "http://127.0.0.1:5000/#/experiments/1/runs/abc"
    publish_tracker_links({"MLflow": url})  # outside a flow run: nothing, no error

    @flow(name="links")
    def publish() -> None:
        publish_tracker_links({"MLflow": url, "TensorBoard": "/tmp/logs/Run_L/tensorboard"}, "Run_L")

    publish()

    async def read():
        async with get_client() as client:
            keys = [artifact_key("Run_L", k) for k in ("mlflow", "tensorboard")]
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))

    arts = asyncio.run(read())
    assert [a.key for a in arts] == ["nrl-run-l-mlflow"] and url in str(arts[0].data)  # http(s) links only


# --- W&B (offline) ------------------------------------------------------------------------------


def _wandb_records(wandb_dir: str) -> list[dict]:
    """The records of every ``.wandb`` log under ``wandb_dir``, read by W&B's own reader."""
    rows = []
    for d in sorted(os.listdir(wandb_dir)):
        if not d.startswith("offline-run-"):
            continue
        (path,) = [os.path.join(wandb_dir, d, f) for f in os.listdir(os.path.join(wandb_dir, d)) if f.endswith(".wandb")]
        out = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", path], capture_output=True, text=True, check=True
        ).stdout
        rows += [json.loads(line) for line in out.splitlines()]
    return rows


def test_wandb_offline_run_resumes_without_duplicates(tmp_path):
    from flows.config import WandbConfig
    from flows.observe.trackers_wandb import WandbTracker, wandb_run_id

    logs = str(tmp_path / "logs")
    t = WandbTracker(logs, "Run/W", WandbConfig(), CONFIG)
    ts = TrackerSet([t])
    ts.sync(ROWS[:3])
    ts.log_eval(2, {"accuracy": 0.5})
    t.close()

    again = WandbTracker(logs, "Run/W", WandbConfig())  # a resume, as a new process would see it
    assert again.last_step() == 3 and again.wandb_id == t.wandb_id == wandb_run_id("Run/W")
    ts = TrackerSet([again])
    ts.sync(ROWS)
    ts.log_eval(2, {"accuracy": 0.5})
    ts.log_eval(4, {"accuracy": 0.75})
    assert ts.links() == {"W&B": os.path.join(logs, "Run/W", "wandb")}
    again.close()

    records = _wandb_records(os.path.join(logs, "Run/W", "wandb"))
    rows = [r["history"]["item"] for r in records if r.get("type") == "history"]
    train = [(r["trainer/step"], r["train/reward_mean"]) for r in rows if "train/reward_mean" in r]
    assert train == [(s, pytest.approx(s / 10)) for s in range(1, 6)]
    assert [(r["eval/step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r] == [(2, 0.5), (4, 0.75)]
    (first, *_) = [r["run"] for r in records if r.get("type") == "run"]
    assert first["run_id"] == t.wandb_id and first["display_name"] == "Run/W" and first["project"] == "nrl-flows"
    assert first["config"]["update"]["grpo"] == {"max_num_steps": 5, "seed": 42}


# --- a tracking server killed mid-run (last: it restarts the module's server) -------------------


@pytest.mark.slow
def test_mlflow_server_down_mid_run_warns_and_catches_up_when_back(mlflow_server, tmp_path, caplog):
    from flows.config import MLflowConfig
    from flows.observe.trackers_mlflow import MLflowTracker

    t = MLflowTracker(str(tmp_path), "Run-D", MLflowConfig(experiment_name="down", tracking_uri=mlflow_server.uri), CONFIG)
    ts = TrackerSet([t])
    ts.sync(ROWS[:2])
    mlflow_server.stop()  # killed mid-run
    with caplog.at_level(logging.WARNING):
        ts.sync(ROWS[:3])  # returns (timeout 5 s, no retries), a warning instead of an error
        ts.log_eval(2, {"accuracy": 0.5})  # kept for later
        ts.sync(ROWS[:4])
    assert caplog.text.count("tracker MLflowTracker") == 3, caplog.text
    mlflow_server.start()  # back, same store and port
    ts.sync(ROWS)  # the backlog from the rows: no gap
    ts.close()
    assert _mlflow_history(mlflow_server.uri, t.run_id, "train/reward_mean") == [(s, s / 10) for s in range(1, 6)]
    assert _mlflow_history(mlflow_server.uri, t.run_id, "eval/accuracy") == [(2, 0.5)]
