"""The S3 endpoint goes down for a while during a save, a load and a stage: a real outage (moto's
server process is killed, connections are refused) and a restart on the same port with the
same objects (``restartable_moto_s3``).

What must hold: calls retry with exponential backoff (``storage.retry``) and either succeed after
the restart or fail with a clear ``StorageUnavailableError`` naming the path once the retries
are spent; nothing half-written is ever committed or read (no manifest before every shard is
stored; the save commits exactly once). One server serves the module (a fresh bucket per test);
the function-scoped ``restartable_moto_s3`` fixture gives a test its own.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import torch

import storage
from storage import commit as commit_mod
from storage.retry import StorageUnavailableError, retry_policy
from tests.fixtures.s3 import RestartableS3Server, free_port
from tests.storage.helpers import same_batch

NUM_SHARDS = 3
PATIENT = dict(attempts=60, initial_delay_s=0.1, max_delay_s=0.5, jitter=0.0)  # waits ~30 s


def make_batch(rows: int = 12) -> dict[str, Any]:
    return {
        "input_ids": torch.arange(rows * 5).reshape(rows, 5),
        "logprobs": torch.linspace(-3, 0, rows * 5).reshape(rows, 5),
        "prompt": [f"what is {i}+1?" for i in range(rows)],
    }


class Background:
    """Run ``fn`` in a thread (the caller keeps control of the server); re-raise its error on join."""

    def __init__(self, fn: Any) -> None:
        self.result: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 120) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the storage call did not return after the restart"
        if self.error is not None:
            raise self.error
        return self.result


def _puts(server: Any, dataset_key: str) -> list[str]:
    """Names of the objects of one dataset the server received PUTs for, in order."""
    out = []
    for r in server.requests_log():
        if r["method"] == "PUT" and f"/{dataset_key}/" in r["url"]:
            out.append(r["url"].split("?")[0].rsplit("/", 1)[-1])
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One restartable moto server for this module (each test leaves it running)."""
    workdir = str(tmp_path_factory.mktemp("moto-outage"))
    port = free_port()
    srv = RestartableS3Server("moto-restartable", f"http://127.0.0.1:{port}", "testing", "testing", port=port, workdir=workdir)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _running(server):
    server.start()
    yield
    server.start()


def test_load_during_outage_raises_a_clear_error_after_the_retries(server, caplog):
    uri = server.make_bucket() + "/ds"
    storage.save_batch(make_batch(), uri, NUM_SHARDS, storage_options=server.storage_options)
    # not-found is not an outage: it raises at once, without retries
    with caplog.at_level(logging.WARNING), pytest.raises(storage.NotCommittedError):
        storage.load_batch(uri + "-missing", storage_options=server.storage_options)
    assert not [r for r in caplog.records if r.name == "storage.retry"]
    server.stop()
    t0 = time.monotonic()
    with retry_policy(attempts=4, initial_delay_s=0.05, max_delay_s=0.2, jitter=0.0), caplog.at_level(logging.WARNING):
        with pytest.raises(StorageUnavailableError, match=r"_manifest\.json.*after 4 attempts") as info:
            storage.load_batch(uri, storage_options=server.storage_options)
    assert time.monotonic() - t0 >= 0.05 + 0.1 + 0.2  # it backed off between the attempts
    assert isinstance(info.value, OSError) and "EndpointConnectionError" in str(info.value)
    retries = [r for r in caplog.records if r.name == "storage.retry"]
    assert [r.getMessage().split("; retry ")[1].split(" in ")[0] for r in retries] == ["1/3", "2/3", "3/3"]


def test_save_interrupted_by_an_outage_commits_once_then_a_load_waits_out_another(server, monkeypatch):
    """The endpoint dies after two of three shards are stored: the save waits, stores the last
    shard after the restart and only then the manifest, exactly once. Then the endpoint dies
    again before a load: the load waits and reads the same data."""
    bucket = server.make_bucket()
    key = "run/steps/step_000001/rollouts"
    uri = f"{bucket}/{key}"
    batch = make_batch()
    killed = threading.Event()
    real_serialize = commit_mod.serialize
    calls = []

    def serialize_then_kill(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == NUM_SHARDS:  # shards 0 and 1 are on the server: the endpoint dies now
            server.stop()
            killed.set()
        return real_serialize(*args, **kwargs)

    monkeypatch.setattr(commit_mod, "_S3_PUT_GROUP_BYTES", 1)  # one PUT per shard, in order
    monkeypatch.setattr(commit_mod, "serialize", serialize_then_kill)
    with retry_policy(**PATIENT):
        saver = Background(lambda: storage.save_batch(batch, uri, NUM_SHARDS, storage_options=server.storage_options))
        assert killed.wait(60)
        time.sleep(1.5)
        assert saver.thread.is_alive(), "the save gave up while the endpoint was down"
        # what the server had received when it died: two shards, no manifest
        assert _puts(server, key) == ["part-00000.arrow", "part-00001.arrow"]
        server.start()
        manifest = saver.join()
    puts = _puts(server, key)
    assert puts == ["part-00000.arrow", "part-00001.arrow", "part-00002.arrow", "_manifest.json"], puts
    stored = storage.read_manifest(uri, storage_options=server.storage_options)
    assert stored.created_at == manifest.created_at and stored.checksum == manifest.checksum

    server.stop()
    with retry_policy(**PATIENT):
        loader = Background(lambda: storage.load_batch(uri, storage_options=server.storage_options))
        time.sleep(1.5)
        assert loader.thread.is_alive(), "the load gave up while the endpoint was down"
        server.start()
        same_batch(batch, loader.join())


def test_score_stage_rides_out_an_outage(server):
    """A stage (``score``) on S3 storage with the endpoint down when it starts: it waits, then
    commits its output once; the rewards are those of the rollouts."""
    import types

    from flows.config import load_config
    from flows.run.runtime import build_run_context
    from nrl_tasks.run_layout import RunLayout
    from nrl_tasks.stages.runner import committed_ref
    from nrl_tasks.stages.score import score
    from tests.flows.conftest import TINY_CONFIG

    root = server.make_bucket() + "/runs"
    cfg = load_config(TINY_CONFIG, [f"storage.root={root}"])
    cfg = cfg.model_copy(
        update={"storage": cfg.storage.model_copy(update={"storage_options": server.storage_options})}
    )
    run_id = "outage-score"
    layout = RunLayout(root, run_id)
    rollouts = {
        "prompt": ["What is 1+1? Answer:"] * 4,
        "response": [" 2", " 3", " 2", "two"],
        "answer": ["2"] * 4,
        "group_id": torch.zeros(4, dtype=torch.int64),
    }
    uri = layout.stage_uri(1, "rollouts")
    storage.save_batch(rollouts, uri, storage_options=server.storage_options, run_id=run_id, step=1, stage="rollouts")
    no_actors = types.SimpleNamespace(namespace="-", policy=None, generation=None, reward_model=None)
    ctx = build_run_context(cfg, run_id, no_actors, tokenizer=None).step(1)
    ref = committed_ref(uri, server.storage_options)
    server.stop()
    with retry_policy(**PATIENT):
        stage = Background(lambda: score.fn(ctx, ref).summary())
        time.sleep(1.5)
        assert stage.thread.is_alive()
        server.start()
        out = stage.join()
    assert out["rows"] == 4 and out["invalid_rewards"] == 0
    rewards = storage.load_batch(layout.stage_uri(1, "rewards"), storage_options=server.storage_options)
    assert rewards["rewards"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert _puts(server, f"runs/{run_id}/steps/step_000001/rewards").count("_manifest.json") == 1
