"""CLI: a bad config or a bad storage URI gives one clear error (exit 2) before Ray or a flow
run starts; ``nrl runs`` lists runs with their last step and status; the command line itself
(help from the docstrings, ``key=value`` overrides among the options, usage errors)."""

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
        (["grpo", "--config", TINY_CONFIG, "--storage", "s3://"], "names no bucket"),
        (["grpo", "--config", TINY_CONFIG, "--run-id", ""], "--run-id is empty"),
        (["grpo", "--config", TINY_CONFIG, "--storage", ""], "--storage is empty"),
        (["runs", "--storage", " "], "--storage is empty"),
        (["grpo", "--config", TINY_CONFIG, "env.reward_fn=tests.faults.no_such_module:f"], "env.reward_fn"),
        (["grpo", "--config", TINY_CONFIG, "env.reward_fn=tests.faults.reward_plugins:no_such_fn"], "no attribute"),
        (["grpo", "--config", TINY_CONFIG, "data.dataset=file", "data.train_path=/nonexistent/p.jsonl"], "data.train_path"),
        (["grpo", "--config", TINY_CONFIG, "data.max_input_seq_length=2"], "prompt(s) longer than 2 tokens"),
        (["grpo", "--config", TINY_CONFIG, "env.environment=calculator", "data.dataset=calculator",
          "grpo.max_rollout_turns=2", "data.max_input_seq_length=8"], "prompt(s) longer than 8 tokens"),
        (["grpo", "--config", TINY_CONFIG, "env.environment=tests.no_such_module:Env"], "env.environment"),
        (["grpo", "--config", TINY_CONFIG, "env.environment=json:JSONDecoder"], "is not an environment class"),
        (["grpo", "--config", TINY_CONFIG, "env.environment=guess_number", "env.environment_kwargs={decay: 3}"],
         "env.environment_kwargs"),
        (["grpo", "--config", TINY_CONFIG, "grpo.max_rollout_turns=3"], "needs env.environment"),
        (["grpo", "--config", TINY_CONFIG, "cluster.ray.address=null", "generation.num_workers=900"], "a local Ray on this machine"),
        (["grpo", "--config", TINY_CONFIG, "generation.colocated.enabled=true", "grpo.async_grpo.enabled=true",
          "loss_fn.use_importance_sampling_correction=true"],
         "generation.colocated.enabled does not go with grpo.async_grpo.enabled"),
        (["grpo", "--config", TINY_CONFIG, "generation.colocated.enabled=true", "generation.num_workers=2"],
         "generation.num_workers (2) is not used with generation.colocated.enabled=true"),
        (["grpo", "--config", TINY_CONFIG, "generation.colocated.enabled=true", "generation.backend=vllm",
          "cluster.gpus_per_node=1"], "colocated.enabled=true with backend='vllm' is not built"),
    ],
)
def test_bad_input_starts_nothing(args, needle, prefect_harness, monkeypatch, capsys):
    import ray

    import flows.run.runtime
    from flows.cli import main

    started = []
    monkeypatch.setattr(flows.run.runtime, "connect_ray", lambda *a, **k: started.append("connect_ray"))
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append("ray.init"))
    before = _count_flow_runs()
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert needle in err, err
    assert err.count("nrl: error:") == 1
    assert started == [] and _count_flow_runs() == before  # no Ray, no flow run


@pytest.mark.parametrize(
    "var, value, needle",
    [
        ("NRL_NODE_IP", "not an ip", "is not an IP address"),
        ("NRL_MODEL_CACHE", __file__, "is not a folder"),
        ("NRL_STORAGE_CHECKSUM", "md5", "'xxh3-128', 'crc32' or 'blake2b-128'"),
    ],
)
def test_a_bad_setting_is_a_usage_error_naming_it(var, value, needle, tmp_path, monkeypatch, capsys):
    """A bad ``NRL_*`` value: one line naming the variable, exit 2, no run directory (was: a
    traceback, or a run that hangs after Ray started)."""
    from flows.cli import main

    monkeypatch.setenv(var, value)
    root = tmp_path / "runs"
    rc = main(["grpo", "--config", TINY_CONFIG, "--storage", str(root), "--run-id", "r1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("nrl: error:") == 1, err
    assert var in err and needle in err, err
    assert not (root / "r1").exists()


def test_runs_lists_status(e2e_run, capsys):
    from flows.cli import main

    assert main(["runs", "--storage", e2e_run["root"]]) == 0
    out = capsys.readouterr().out
    line = [ln for ln in out.splitlines() if ln.startswith(E2E_RUN_ID)]
    assert line and "completed" in line[0] and "3/3" in line[0]


def test_a_failed_preflight_leaves_no_run_behind(tmp_path, capsys):
    """A bad plug-in is found before the run directory exists: the same --run-id then starts."""
    from flows.cli import main

    root = tmp_path / "runs"
    rc = main(["grpo", "--config", TINY_CONFIG, "--storage", str(root), "--run-id", "r1", "env.reward_fn=nope.nope:f"])
    assert rc == 2 and "env.reward_fn" in capsys.readouterr().err
    assert not (root / "r1").exists()


@pytest.mark.parametrize("command", ["runs", "eval-prefix", "eval-run", "resume"])
def test_read_only_commands_create_nothing(command, tmp_path, monkeypatch, capsys):
    from flows.cli import main

    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "typo" / "a" / "b"
    argv = {
        "runs": ["runs", "--storage", str(missing)],
        "eval-prefix": ["eval", "../x-outside"],
        "eval-run": ["eval", "some-run", "--storage", str(missing)],
        "resume": ["resume", "some-run", "--storage", str(missing)],
    }[command]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("nrl: error:") == 1, err
    assert "does not exist" in err, err
    assert not (tmp_path / "typo").exists() and not (tmp_path.parent / "x-outside").exists()


def test_eval_of_a_prefix_without_runs_is_an_error(tmp_path, capsys):
    from flows.cli import main

    (tmp_path / "empty").mkdir()
    assert main(["eval", str(tmp_path / "empty") + "/"]) == 2
    assert "no runs under" in capsys.readouterr().err


def test_runs_works_on_a_root_it_cannot_write(e2e_run, capsys, monkeypatch):
    """``nrl runs`` only reads: a full disk or a read-only root must not stop it (no write probe)."""
    from storage import fs

    from flows.cli import main

    def refuse(path, *a, **k):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(fs, "check_writable", refuse)
    assert main(["runs", "--storage", e2e_run["root"]]) == 0
    assert E2E_RUN_ID in capsys.readouterr().out


def test_help_lists_the_commands_and_their_options(capsys):
    from flows.cli import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("grpo", "dpo", "resume", "eval", "runs"):
        assert f" {command} " in out, out
    assert main(["grpo", "--help"]) == 0
    out = capsys.readouterr().out
    for needle in ("--config", "--storage", "--run-id", "KEY=VALUE", "YAML config", "Config sections", "loss_fn"):
        assert needle in out, out
    assert main(["resume", "-h"]) == 0
    out = capsys.readouterr().out
    for needle in ("RUN_ID", "--recompute", "--take-over", "--storage"):
        assert needle in out, out
    assert "--no-take-over" not in out and "--empty-recompute" not in out, out


@pytest.mark.parametrize("argv, expected", [
    (["grpo", "a=1", "--config", "c.yaml", "b=2", "--storage", "s", "c=3", "--run-id", "r", "d=4"],
     ("grpo", ["a=1", "b=2", "c=3", "d=4"], {"config": "c.yaml", "storage": "s", "run_id": "r"})),
    (["dpo", "--config=c.yaml", "x.y=-1e-5"], ("dpo", ["x.y=-1e-5"], {"config": "c.yaml", "storage": None, "run_id": None})),
])
def test_overrides_go_anywhere_among_the_options(argv, expected, monkeypatch):
    import flows.cli

    seen = []
    monkeypatch.setattr(flows.cli, "_start", lambda recipe, config, overrides, storage, run_id: seen.append(
        (recipe.kind, overrides, {"config": config, "storage": storage, "run_id": run_id})) or 0)
    assert flows.cli.main(argv) == 0
    assert seen == [expected]


def test_resume_takes_overrides_and_repeated_recompute_among_its_options(tmp_path, capsys):
    """Parsed as before (``--recompute`` takes one value each time): the run is then not found."""
    from flows.cli import main

    argv = ["resume", "r", "a=1", "--storage", str(tmp_path), "--recompute", "generate@3", "b=2", "--take-over",
            "--recompute", "train@4", "c=3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no run 'r'" in err and err.count("nrl: error:") == 1, err


@pytest.mark.parametrize("argv, needle", [
    (["grpo", "--config", "c.yaml", "--bogus"], "Unknown option: --bogus"),
    (["resume", "r", "--no-take-over"], "--no-take-over"),
    (["runs", "key=value"], "unrecognized arguments: key=value"),
    (["eval", "r", "--num-samples", "x"], "--num-samples"),
    (["grpo", "a=1"], "--config"),
    (["bogus"], "bogus"),
    ([], "a command is required"),
])
def test_usage_errors_are_one_line_and_exit_2(argv, needle, capsys):
    from flows.cli import main

    assert main(argv) == 2
    captured = capsys.readouterr()
    assert needle in captured.err and captured.err.count("nrl: error:") == 1, captured.err
    assert captured.out == ""


@pytest.mark.parametrize("raised, code", [(SystemExit(0), 1), (SystemExit(3), 1), (KeyboardInterrupt(), 130), (RuntimeError("x"), 1)])
def test_a_run_ended_by_anything_but_its_return_exits_non_zero(raised, code, tmp_path, capsys):
    """``SystemExit(0)`` from user code (a reward plug-in calling ``sys.exit``) is a failed run, not success."""
    from flows.cli_run import run_flow
    from nrl_tasks.run_layout import RunLayout

    def call():
        raise raised

    assert run_flow(call, RunLayout(str(tmp_path), "r")) == code
    err = capsys.readouterr().err
    assert "nrl resume r" in err, err
    assert (type(raised).__name__ in err) if code == 1 else ("interrupted" in err), err


@pytest.mark.parametrize("plugin, needle", [
    ("exits_zero", "SystemExit"),  # sys.exit(0) inside env.reward_fn: was exit 0, no error printed
    ("huge_rewards", "NonFiniteTrainingError"),  # 1e30 rewards: inf grad norm, was committed as 'grad_norm'=inf
])
def test_a_run_that_cannot_go_on_fails_with_exit_1_and_commits_no_train(
    plugin, needle, tmp_path, prefect_harness, ray_session, tiny_model_dir, capsys
):
    """The reported cases, through the real flow (1 step of the tiny config)."""
    import json

    import yaml

    from flows.cli import main
    from tests.flows.conftest import tiny_run_config

    root = str(tmp_path / "runs")
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{
        "grpo.max_num_steps": 1, "checkpointing.enabled": False, "env.reward_fn": f"tests.faults.reward_plugins:{plugin}",
    })
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc = main(["grpo", "--config", str(path), "--run-id", "r"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert needle in err and "nrl resume r" in err, err
    with open(tmp_path / "runs" / "r" / "status.json", encoding="utf-8") as fh:
        assert json.load(fh)["status"] == "failed"
    assert not (tmp_path / "runs" / "r" / "steps" / "step_000001" / "train" / "_manifest.json").exists()


def test_sigterm_that_surfaces_as_another_error_still_exits_143(prefect_harness, tmp_path, capsys):
    """Issue 27 (6e): during a flow run Prefect's SIGTERM handler replaces nrl's; a signal landing in
    C code (inside ``ray.get``) leaves the flow as a ``SystemError`` caused by Prefect's
    ``TerminationSignal``, which Prefect does not pass on to nrl's handler: the run exited 1 as
    failed. It is a SIGTERM: 143, "stopped by SIGTERM"."""
    import os
    import signal
    import time

    from prefect import flow
    from prefect.exceptions import TerminationSignal

    from flows.cli_run import EXIT_SIGTERM, run_flow
    from nrl_tasks.run_layout import RunLayout

    @flow(name="sigterm-in-c-call", persist_result=False)
    def stage() -> dict:
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # Prefect's handler raises TerminationSignal here
            time.sleep(30)
        except TerminationSignal as exc:  # what CPython makes of it when it is raised inside a C call
            raise SystemError("<built-in method __new__ of type object at 0x1> returned a result with an exception set") from exc
        return {}

    assert run_flow(stage, RunLayout(str(tmp_path), "r")) == EXIT_SIGTERM
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "nrl: run r stopped by SIGTERM", err
