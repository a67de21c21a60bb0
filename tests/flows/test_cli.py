"""CLI: a bad config or a bad storage URI gives one clear error (exit 2) before Ray or a flow
run starts; ``nrl runs`` lists runs with their last step and status."""

from __future__ import annotations

import asyncio

import pytest

from tests.flows.conftest import E2E_RUN_ID, TINY_CONFIG


def _count_flow_runs() -> int:
    from prefect.client.orchestration import get_client

    async def count():
        async with get_client() as c:
            return len(await c.read_flow_runs(limit=200))

    return asyncio.run(count())


@pytest.mark.parametrize(
    "args, needle",
    [
        (["grpo", "--config", TINY_CONFIG, "grpo.num_prompts_per_stepp=2", "policy.train_global_batch_size=x"], "unknown key"),
        (["grpo", "--config", TINY_CONFIG, "policy.train_global_batch_size=24"], "not a multiple of"),
        (["grpo", "--config", "/nonexistent/cfg.yaml"], "does not exist"),
        (["grpo", "--config", TINY_CONFIG, "--storage", "ftp://host/runs"], "unsupported scheme 'ftp'"),
        (["grpo", "--config", TINY_CONFIG, "--storage", "/proc/nrl-runs"], "cannot be created"),
        (["grpo", "--config", TINY_CONFIG, "--run-id", "bad/id"], "run_id"),
        (["resume", "no-such-run", "--storage", "/tmp"], "no run 'no-such-run'"),
    ],
)
def test_bad_input_starts_nothing(args, needle, prefect_harness, monkeypatch, capsys):
    import ray

    import flows.runtime
    from flows.cli import main

    started = []
    monkeypatch.setattr(flows.runtime, "connect_ray", lambda *a, **k: started.append("connect_ray"))
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append("ray.init"))
    before = _count_flow_runs()
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert needle in err, err
    assert err.count("nrl: error:") == 1
    assert started == [] and _count_flow_runs() == before  # no Ray, no flow run


def test_runs_lists_status(e2e_run, capsys):
    from flows.cli import main

    assert main(["runs", "--storage", e2e_run["root"]]) == 0
    out = capsys.readouterr().out
    line = [ln for ln in out.splitlines() if ln.startswith(E2E_RUN_ID)]
    assert line and "completed" in line[0] and "3/3" in line[0]
