"""No pickle anywhere in a run's persisted data or checkpoints, and credentials nowhere.

- The scanner (``tests.security.scan``) is shown to catch ``torch.save``, plain pickles, numpy
  files, zips and Python YAML tags, so a clean scan means something.
- The session's end-to-end run (``e2e_run``: 3 steps, checkpoints with optimizer and RNG
  states, validation) is scanned file by file.
- A 2-step GRPO run through the flow with ``s3://`` storage on moto, with the AWS credentials set
  to unique canary strings in the environment (the only place credentials may come from): every
  object under the run prefix is downloaded and scanned for pickle and the canaries; the
  canaries must also be absent from the captured stdout/stderr and log records, from the
  Prefect flow/task runs, logs and artifacts read back through the client, from the Prefect
  database file, from Ray's session logs, and Prefect must have persisted no (pickled) task
  results.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import uuid
from typing import Any

import pytest
import torch
import yaml

from tests.security.scan import check_file, check_files, files_under, grep_files


def test_the_scanner_catches_pickles(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "model.safetensors")  # a zip with data.pkl, misnamed
    (tmp_path / "state.json").write_bytes(pickle.dumps({"a": 1}, protocol=4))
    (tmp_path / "legacy.arrow").write_bytes(pickle.dumps(torch.ones(2), protocol=2))
    (tmp_path / "cfg.yaml").write_text("a: !!python/object/apply:os.system ['true']\n")
    (tmp_path / "arr.npy").write_bytes(b"\x93NUMPY")
    (tmp_path / "ok.json").write_text(json.dumps({"a": 1}))
    problems: dict[str, str] = {}
    for line in check_files(str(tmp_path))[1]:
        name = os.path.basename(line.split(":")[0])
        problems[name] = problems.get(name, "") + line + "\n"
    assert set(problems) == {"model.safetensors", "state.json", "legacy.arrow", "cfg.yaml", "arr.npy"}, problems
    assert "torch.save" in problems["model.safetensors"] and "pickle protocol header" in problems["state.json"]
    assert "_rebuild_tensor" in problems["legacy.arrow"] and "not safe YAML" in problems["cfg.yaml"]
    assert check_file(str(tmp_path / "ok.json")) == []


def _assert_clean_run_dir(root: str) -> list[str]:
    files, problems = check_files(root)
    assert not problems, "\n".join(problems)
    kinds = {os.path.splitext(f)[1] for f in files}
    assert {".arrow", ".safetensors", ".json", ".yaml"} <= kinds, kinds  # the scan saw every kind
    assert any("/checkpoints/" in f and "optimizer" in f and f.endswith(".safetensors") for f in files)
    return files


def test_e2e_run_holds_no_pickle(e2e_run):
    from tests.fixtures.grpo_runs import E2E_RUN_ID

    files = _assert_clean_run_dir(os.path.join(e2e_run["root"], E2E_RUN_ID))
    assert len(files) > 40


# --------------------------------------------------------------------------- canary run on S3
def _prefect_records(flow_name_like: str) -> list[str]:
    """JSON of every flow run, task run, log and artifact of the matching flow runs."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, LogFilter, LogFilterFlowRunId

    async def every_page(read: Any, **filters: Any) -> list[Any]:
        """All records of a paged ``client.read_*`` call (pages of 200)."""
        records: list[Any] = []
        while True:
            page = await read(**filters, limit=200, offset=len(records))
            records += page
            if len(page) < 200:
                return records

    async def query() -> list[str]:
        out: list[str] = []
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=flow_name_like)))
            assert runs, f"no flow run named like {flow_name_like!r}"
            ids = [r.id for r in runs]
            out += [r.model_dump_json() for r in runs]
            frf = FlowRunFilter(id={"any_": ids})
            out += [t.model_dump_json() for t in await every_page(client.read_task_runs, flow_run_filter=frf)]
            logs = await every_page(client.read_logs, log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)))
            out += [entry.model_dump_json() for entry in logs]
            out += [a.model_dump_json() for a in await every_page(client.read_artifacts) if a.flow_run_id in ids]
        return out

    return asyncio.run(query())


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(f"{record.name} {record.getMessage()} {record.exc_text or ''} {record.args!r}")
        except Exception:  # noqa: BLE001
            self.lines.append(repr(record.__dict__))


@pytest.mark.slow
def test_s3_run_holds_no_pickle_and_no_credentials(
    prefect_harness, ray_session, tiny_model_dir, moto_s3, tmp_path, monkeypatch, capfd
):
    import ray
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, PREFECT_SERVER_DATABASE_CONNECTION_URL

    import storage
    from flows.algorithms.grpo import grpo
    from nrl_tasks.run_layout import RunLayout
    from tests.fixtures.grpo_runs import kill_run_actors, tiny_run_config

    tag = uuid.uuid4().hex
    key_canary, secret_canary = f"AKIANRLCANARY{tag[:12].upper()}", f"nrl-canary-secret-{tag}"
    bucket = moto_s3.make_bucket()
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_canary)  # moto accepts any credentials
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret_canary)
    run_id = f"canary-{tag[:8]}"
    root = f"{bucket}/runs"
    cfg = tiny_run_config(
        tiny_model_dir, root, ray_session,
        **{"grpo.max_num_steps": 2, "checkpointing.save_period": 1, "grpo.val_period": 2},
    )
    results_dir = str(PREFECT_LOCAL_STORAGE_PATH.value())
    results_before = set(files_under(results_dir)) if os.path.isdir(results_dir) else set()
    collect = _Collect()
    loggers = [logging.getLogger(), logging.getLogger("prefect")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:  # INFO, the production level (the test session runs at WARNING)
        lg.addHandler(collect)
        lg.setLevel(logging.INFO)
    try:
        result = grpo(config=cfg, run_id=run_id)
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(collect)
            lg.setLevel(level)
        kill_run_actors(run_id)
    assert result["last_step"] == 2
    out, err = capfd.readouterr()
    needles = [key_canary.encode(), secret_canary.encode()]

    # every object of the run, downloaded: safe formats only, no canary
    local = str(tmp_path / "run")
    rels = storage.download_dir(RunLayout(root, run_id).run_uri, local)
    assert any(r.startswith("checkpoints/step_000002/") for r in rels)
    files = _assert_clean_run_dir(local)
    assert not grep_files(files, needles)
    saved = yaml.safe_load(open(os.path.join(local, "config.yaml"), encoding="utf-8"))
    assert saved["storage"]["storage_options"] == {}

    # console output, log records, Prefect's records and database, Ray's logs
    for text in (out, err, "\n".join(collect.lines), "\n".join(_prefect_records(run_id))):
        assert key_canary not in text and secret_canary not in text
    assert collect.lines and _prefect_records(run_id)  # they were looked at, not empty
    db = str(PREFECT_SERVER_DATABASE_CONNECTION_URL.value()).split(":///", 1)[-1]
    db_files = [p for p in (db, db + "-wal", db + "-journal") if os.path.exists(p)]
    assert db_files and not grep_files(db_files, needles)
    session_dir = ray._private.worker._global_node.get_session_dir_path()
    assert not grep_files(files_under(os.path.join(session_dir, "logs")), needles)

    # Prefect persisted no task results (they would be pickles)
    results_after = set(files_under(results_dir)) if os.path.isdir(results_dir) else set()
    assert results_after == results_before, sorted(results_after - results_before)[:5]
