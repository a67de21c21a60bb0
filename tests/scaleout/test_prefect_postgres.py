"""Prefect scale-out: a Prefect server on PostgreSQL with a process work pool, the
``prefect.yaml`` deployments deployed and run by a worker (``.ci/scaleout/prefect_postgres.sh``).

``grpo-train`` (2 steps of the tiny config) and then ``eval-sweep`` over its storage are run with
``prefect deployment run --watch``; the test checks their results on storage, reads the flow
and task runs back from PostgreSQL itself (so the server really used it), that the
database password shows up in no log or run file, and that stopping leaves no process.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import re
import shutil
import tempfile

import psutil
import pytest

from tests.fixtures.processes import alive
from tests.scaleout.helpers import BIN, REPO, clean_env, read_env_file, run

SCRIPT = os.path.join(REPO, ".ci", "scaleout", "prefect_postgres.sh")
PREFECT = os.path.join(BIN, "prefect")
RUN_ID = "pg-train"


def _postgres_available() -> bool:
    if shutil.which("pg_config") or glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        return True
    return os.geteuid() == 0 and shutil.which("apt-get") is not None  # the script installs it


def _query(state: str, sql: str) -> list[tuple]:
    import asyncpg

    async def go():
        conn = await asyncpg.connect(
            host="127.0.0.1", port=int(open(os.path.join(state, "pg_port")).read()), user="nrl",
            password=open(os.path.join(state, "db_password")).read().strip(), database="prefect",
        )
        try:
            return [tuple(r) for r in await conn.fetch(sql)]
        finally:
            await conn.close()

    return asyncio.run(go())


def _trees(state: str) -> list[psutil.Process]:
    out = []
    for f in ("worker.pid", "server.pid", "pg/data/postmaster.pid"):
        path = os.path.join(state, f)
        try:
            p = psutil.Process(int(open(path).readline()))
            out += [p] + p.children(recursive=True)
        except (OSError, ValueError, psutil.NoSuchProcess):
            pass
    return out



@pytest.mark.slow
@pytest.mark.skipif(not _postgres_available(), reason="PostgreSQL is not installed (apt-get install -y postgresql)")
def test_deployments_run_on_a_postgres_backed_server(tmp_path, tiny_model_dir):
    state = tempfile.mkdtemp(prefix="nrl-pg-", dir="/tmp")  # short: PostgreSQL's socket path < 108 bytes
    env = clean_env(str(tmp_path), NRL_PREFECT_PG_DIR=state)
    root = str(tmp_path / "runs")
    procs: list[psutil.Process] = []
    try:
        out = run(["bash", SCRIPT, "start"], env, timeout=600)
        api = re.search(r"PREFECT_API_URL=(\S+)", out).group(1)
        assert api.startswith("http://127.0.0.1:")
        env.update(read_env_file(os.path.join(state, "env")))
        procs = _trees(state)
        for p in procs:  # every listening socket of the stack is on the loopback interface
            try:
                conns = p.net_connections(kind="tcp")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            for c in conns:
                if c.status == psutil.CONN_LISTEN:
                    assert c.laddr.ip == "127.0.0.1", (p.name(), c.laddr)

        deployments = {r[0] for r in _query(state, "SELECT name FROM deployment")}
        assert deployments == {"grpo-train", "post-train", "eval-sweep"}
        # the cron schedule of eval-sweep is there; pause it so no hourly sweep of ./runs starts here
        sched = run([PREFECT, "deployment", "schedule", "ls", "eval-sweep/eval-sweep"], env, 120)
        assert "cron: 0 * * * *" in sched
        sched_id = re.search(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", sched).group(0)
        run([PREFECT, "deployment", "schedule", "pause", "eval-sweep/eval-sweep", sched_id], env, 120)

        overrides = json.dumps([f"policy.model_name={tiny_model_dir}", "grpo.max_num_steps=2"])
        out = run(
            [PREFECT, "deployment", "run", "grpo/grpo-train", "-p", "config=configs/grpo_tiny.yaml",
             "-p", f"overrides={overrides}", "-p", f"storage={json.dumps(root)}", "-p", f"run_id={json.dumps(RUN_ID)}",
             "--watch", "--watch-timeout", "900"],
            env, 1000,
        )
        assert "finished successfully in 'Completed'" in out, out[-3000:]
        out = run(
            [PREFECT, "deployment", "run", "eval-sweep/eval-sweep", "-p", f"target={json.dumps(root)}",
             "-p", "num_samples=2", "--watch", "--watch-timeout", "900"],
            env, 1000,
        )
        assert "finished successfully in 'Completed'" in out, out[-3000:]

        run_dir = os.path.join(root, RUN_ID)
        with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            assert [json.loads(x)["step"] for x in fh] == [1, 2]
        assert os.path.isfile(os.path.join(run_dir, "checkpoints", "step_000002", "checkpoint.json"))
        assert glob.glob(os.path.join(run_dir, "evals", "step_000002", "*", "_manifest.json"))

        runs = _query(
            state,
            "SELECT f.name, r.state_type::text, d.name FROM flow_run r JOIN flow f ON f.id = r.flow_id "
            "JOIN deployment d ON d.id = r.deployment_id WHERE r.state_type::text <> 'SCHEDULED' AND NOT r.auto_scheduled",
        )
        # (auto_scheduled: the hourly sweep the scheduler may have created before the pause above;
        # it starts when the test crosses the top of an hour: not one of the runs this test made)
        assert sorted(runs) == [("eval-sweep", "COMPLETED", "eval-sweep"), ("grpo", "COMPLETED", "grpo-train")]
        tasks = dict(_query(state, "SELECT t.state_type::text, count(*) FROM task_run t JOIN flow_run r ON r.id = t.flow_run_id "
                            "WHERE NOT r.auto_scheduled GROUP BY 1"))
        assert tasks.get("COMPLETED", 0) >= 2 * 6 and set(tasks) <= {"COMPLETED"}, tasks

        password = open(os.path.join(state, "db_password")).read().strip()
        for d in (state, run_dir):
            for dirpath, _, files in os.walk(d):
                for f in files:
                    if f in ("db_password", "server.env") or dirpath.startswith(os.path.join(state, "pg")):
                        continue
                    with open(os.path.join(dirpath, f), "rb") as fh:
                        assert password.encode() not in fh.read(), os.path.join(dirpath, f)
    finally:
        procs = procs + _trees(state)  # and whatever the worker runs now
        try:
            run(["bash", SCRIPT, "stop"], env, timeout=300)
        finally:
            shutil.rmtree(state, ignore_errors=True)
    assert procs
    left = [p for p in procs if alive(p)]
    assert not left, f"processes left after stop: {[(p.pid, p.name()) for p in left]}"
