"""Flow runs of a run are named after what they do and all tagged ``run:<id>`` (issue 29, item 4),
and ``status.json`` keeps the run's history (item 5): read back from a real Prefect server."""

from __future__ import annotations

import pytest

from flows.run.history import attempt_kind
from tests.fixtures.grpo_runs import tiny_run_config


def _flow_runs(run_id: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        # the one filter docs/ui.md documents: the run's own flow runs, refused ones too, not its step subflows
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"flow:{run_id}"])),
                                     sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=50)
    return runs


def test_attempt_kinds():
    assert attempt_kind({}, "f1", max_steps=4) == "start"
    assert attempt_kind({"status": "failed", "flow_run_id": "f1", "max_steps": 4}, "f1", max_steps=4) == "retry"
    assert attempt_kind({"status": "completed", "flow_run_id": "f1", "max_steps": 4}, "f2", max_steps=6) == "extend"
    assert attempt_kind({"status": "crashed", "flow_run_id": "f1", "max_steps": 4}, "f2", max_steps=4) == "resume"


def test_resume_hints_name_the_cli_or_the_deployment_parameters():
    from flows.run.hints import resume_command

    assert resume_command("r1", "--take-over", deployed=False) == "`nrl resume r1 --take-over`"
    assert resume_command("r1", "--fresh-optimizer", deployed=True) == (
        "a run of the deployment with the parameters resume=true, run_id='r1', fresh_optimizer=true")
    assert resume_command("r1") == "`nrl resume r1`"  # outside a deployment's flow run: the CLI


@pytest.mark.slow  # four nrl processes: in the slow suite (keeps make test under 10 minutes)
def test_start_refusal_extension_and_resume_have_their_own_names_and_the_run_tag(tmp_path, prefect_harness, ray_session,
                                                                                   tiny_model_dir):
    from flows.algorithms.grpo import grpo
    from flows.config import ConfigError
    from flows.run.state import read_status
    from nrl_tasks.run_layout import RunLayout

    root, run_id = str(tmp_path / "runs"), "names"
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{"grpo.max_num_steps": 1})
    grpo(config=cfg, run_id=run_id)
    with pytest.raises(ConfigError, match="already exists"):  # a second start of the same id
        grpo(config=cfg, run_id=run_id)
    grpo(run_id=run_id, resume=True, storage=root, overrides=["grpo.max_num_steps=2"])  # an extension
    grpo(run_id=run_id, resume=True, storage=root, overrides=["grpo.max_num_steps=2"])  # a resume: nothing left to train
    bad = dict(cfg, grpo=dict(cfg["grpo"], max_num_steps=-3))
    with pytest.raises(ConfigError, match="max_num_steps"):  # refused for its config, before any lease
        grpo(config=bad, run_id="names-bad")

    runs = _flow_runs(run_id)
    names = [r.name for r in runs]
    assert names[0] == run_id and names[2:] == [f"{run_id}-extend-2", f"{run_id}-resume-3"], names
    assert names[1] == f"{run_id}-refused-{str(runs[1].id).replace('-', '')[:6]}", names
    assert [r.state.type.value for r in runs] == ["COMPLETED", "FAILED", "COMPLETED", "COMPLETED"]
    assert [r.name for r in _flow_runs("names-bad")] != []  # tagged although its config never resolved

    history = (read_status(RunLayout(root, run_id)) or {})["history"]
    assert [(e["attempt"], e["kind"], e["outcome"], e["flow_run_id"]) for e in history] == [
        (1, "start", "completed", str(runs[0].id)), (2, "extend", "completed", str(runs[2].id)),
        (3, "resume", "completed", str(runs[3].id))]
    assert history[1]["trained"] == 1 and history[2]["trained"] == 2 and all(e["ended_unix"] >= e["started_unix"] for e in history)
