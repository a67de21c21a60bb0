"""The eval view (:mod:`flows.observe.eval_view`): pure tests of its markdown, then a real tiny GRPO run
swept twice against the session's Prefect test server: one artifact version after the first sweep
and still one after the second (nothing new), the sweep's flow run named after its target and
time and tagged with the run it evaluated."""

from __future__ import annotations

import asyncio
import re

import pytest

from flows.observe.eval_view import eval_view_markdown, flow_run_url, target_label, uri_link, view_digest

RUN_ID = "eval-view"


def _rows(accuracies, run_id="r1", dataset="val", root="/data/runs", k=4):
    return [
        {
            "run_id": run_id, "checkpoint": f"step_{s:06d}", "step": s, "dataset": dataset, "accuracy": a,
            "pass_at_k": min(1.0, a + 0.25), "k": k, "sample_reward_mean": a / 2, "num_prompts": 8,
            "checkpoint_uri": f"{root}/{run_id}/checkpoints/step_{s:06d}",
        }
        for s, a in accuracies
    ]


def _plot(md: str) -> bytes:
    import base64

    return base64.b64decode(md.split("(data:image/png;base64,", 1)[1].split(")", 1)[0])


def _table_lines(md: str) -> list[str]:
    return [ln for ln in md.splitlines() if re.match(r"^\| (★)? \| step_", ln)]


def test_best_is_marked_ties_to_the_earlier_step():
    md = eval_view_markdown("r1", _rows([(2, 0.25), (4, 0.625), (6, 0.625), (8, 0.5)]))
    assert "best: step_000004 (accuracy 0.625)" in md
    starred = [ln for ln in _table_lines(md) if ln.startswith("| ★ |")]
    assert len(starred) == 1 and "step_000004" in starred[0]


def test_checkpoints_in_step_order_with_curves():
    rows = _rows([(10, 0.5), (2, 0.0), (6, 1.0)])  # out of order, as storage may list them
    md = eval_view_markdown("r1", rows)
    assert [ln.split("|")[2].strip() for ln in _table_lines(md)] == ["step_000002", "step_000006", "step_000010"]
    assert "accuracy step_000002..step_000010: first 0.000, last 0.500 (pass@4 last 0.750)" in md
    png = _plot(md)  # the curves: a plot with axes, ticks and a legend (flows.observe.plot), not text blocks
    assert png.startswith(b"\x89PNG") and len(png) < 12_000
    assert "| 0.000 | 0.250 | 4 | 0.000 | 8 |" in md  # accuracy, pass@k, k, sample reward, prompts


def test_links_to_checkpoints_and_the_training_run():
    runs = {"r1": {"flow_run_id": "1234-abcd", "run_uri": "/data/runs/r1", "ui_url": "http://127.0.0.1:4200/"}}
    md = eval_view_markdown("runs", _rows([(2, 0.5)]), runs)
    assert "training run: [r1](http://127.0.0.1:4200/v2/runs/flow-run/1234-abcd)" in md  # the current UI, by name
    # a start, Prefect's retry of that same flow run, then an extension: the retried flow run is listed once
    extended = {"r1": dict(runs["r1"], flow_runs=[{"attempt": 1, "kind": "start", "flow_run_id": "0000-start"},
                                                  {"attempt": 2, "kind": "retry", "flow_run_id": "0000-start"},
                                                  {"attempt": 3, "kind": "extend", "flow_run_id": "1234-abcd"}])}
    md = eval_view_markdown("runs", _rows([(2, 0.5)]), extended)
    assert "training run: [r1-extend-3 (3 extend)](http://127.0.0.1:4200/v2/runs/flow-run/1234-abcd)" in md
    assert "earlier flow runs: [r1 (1 start, 2 retry)](http://127.0.0.1:4200/v2/runs/flow-run/0000-start) ·" in md
    assert "`/data/runs/r1/checkpoints/step_000002`" in md and "file://" not in md  # the UI drops file:// links
    no_ui = {"r1": {"flow_run_id": "1234-abcd", "run_uri": "s3://bkt/runs/r1"}}
    s3 = eval_view_markdown("runs", _rows([(2, 0.5)], root="s3://bkt/runs"), no_ui)
    assert "`s3://bkt/runs/r1/checkpoints/step_000002`" in s3 and "](s3://" not in s3
    assert "training run: r1 `1234-abcd` · storage `s3://bkt/runs/r1`" in s3  # no UI URL: name, id and storage
    assert flow_run_url(None, "x") is None and uri_link("https://h/x") == "[https://h/x](https://h/x)"
    assert uri_link("runs/relative") == "`runs/relative`"


def test_no_star_when_every_accuracy_is_0():
    md = eval_view_markdown("r1", _rows([(2, 0.0), (4, 0.0)]))
    assert "best: none (accuracy 0 at every checkpoint)" in md and "★" not in md


def test_bounded_table_and_curve():
    rows = _rows([(s, (s % 7) / 7) for s in range(1, 121)])
    md = eval_view_markdown("r1", rows)
    lines = _table_lines(md)
    assert len(lines) == 50 and "step_000071" in lines[0] and "step_000120" in lines[-1]
    assert "the newest 50 of 120 checkpoints" in md
    assert len(re.findall(r"!\[accuracy per checkpoint step", md)) == 1 and len(_plot(md)) < 12_000  # one plot a view
    many = [r for i in range(30) for r in _rows([(2, 0.5)], run_id=f"run{i:02d}")]
    md_many = eval_view_markdown("runs", many)
    assert "## Run `run29`" in md_many and "## Run `run09`" not in md_many and "(10 older not shown)" in md_many
    assert len(md) < 24_000 and len(md_many) < 24_000  # the table, the links and one ~4 KB plot (base64)
    assert len(re.findall(r"!\[accuracy per checkpoint step \(6 run/dataset", md_many)) == 1  # the newest 6 pairs


def test_runs_and_datasets_grouped_and_digest():
    rows = _rows([(2, 0.5)], run_id="a") + _rows([(2, 0.25)], run_id="b")
    rows += _rows([(2, 1.0)], run_id="a", dataset="heldout-1234")
    md = eval_view_markdown("runs", rows)
    assert md.index("## Run `a`") < md.index("### Dataset `val`") < md.index("### Dataset `heldout-1234`") < md.index("## Run `b`")
    assert view_digest(md) == view_digest(eval_view_markdown("runs", list(rows)))
    assert view_digest(md) != view_digest(eval_view_markdown("runs", rows + _rows([(4, 0.5)], run_id="b")))


def test_target_label():
    assert target_label("e2e-tiny") == "e2e-tiny"
    assert target_label("s3://bucket/team/runs/") == "runs" and target_label("s3://bucket") == "bucket"
    assert target_label("/tmp/x/my runs") == "my-runs"


# ---------------------------------------------------------------------------------------------
# real: a tiny GRPO run, two sweeps, the artifact and flow runs read back from the Prefect API


def _client_call(fn):
    from prefect.client.orchestration import get_client

    async def run():
        async with get_client() as client:
            return await fn(client)

    return asyncio.run(run())


def _artifacts(key: str):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    return _client_call(lambda c: c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), limit=50))


def _flow_run(state):
    return _client_call(lambda c: c.read_flow_run(state.state_details.flow_run_id))


@pytest.fixture(scope="module")
def trained_run(prefect_harness, ray_session, tiny_model_dir, tmp_path_factory):
    """A 2-step run of ``configs/grpo_tiny.yaml`` with a checkpoint after each step."""
    from flows.algorithms.grpo import grpo
    from tests.flows.conftest import kill_run_actors, tiny_run_config

    root = str(tmp_path_factory.mktemp("evalview-runs"))
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{"grpo.max_num_steps": 2, "checkpointing.save_period": 1,
                                                                 "logger.tensorboard_enabled": True, "logger.log_dir": f"{root}/logs"})
    try:
        grpo(config=cfg, run_id=RUN_ID)
    finally:
        kill_run_actors(RUN_ID)
    return root


def test_eval_sweep_publishes_the_view_once_and_names_its_runs(trained_run, prefect_harness):
    import json
    import os

    from flows.observe.artifacts import artifact_key
    from flows.algorithms.evaluate import eval_sweep, evaluate_checkpoint

    root = trained_run
    label = target_label(root)
    key = artifact_key(label, "evals")
    name_re = re.compile(rf"^eval-sweep-{re.escape(label)}-\d{{8}}-\d{{4}}$")

    first = eval_sweep(root, num_samples=2, max_prompts=4, return_state=True)
    res = first.result()
    assert sorted(res["evaluated"]) == [f"{RUN_ID}/step_000001", f"{RUN_ID}/step_000002"]
    arts = _artifacts(key)
    assert len(arts) == 1 and arts[0].type == "markdown"
    md = arts[0].data
    print(md)  # the example in the report
    training_id = json.load(open(os.path.join(root, RUN_ID, "status.json")))["flow_run_id"]
    assert f"/v2/runs/flow-run/{training_id})" in md
    assert (md.count("| ★ |") == 1 and "best: step_00000" in md) or ("★" not in md and "best: none" in md)
    assert "accuracy step_000001..step_000002: first " in md and "(pass@2 last " in md and len(_plot(md)) < 12_000
    assert f"`{root}/{RUN_ID}/checkpoints/step_000002`" in md
    # the evaluations are curves in the training run's own tracker run (TensorBoard here)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(root, "logs", RUN_ID, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [1, 2]
    assert [round(e.value, 6) for e in acc.Scalars("eval/accuracy")] == [round(r["accuracy"], 6) for r in
                                                                         sorted(res["rows"], key=lambda r: r["checkpoint"])]
    run = _flow_run(first)
    assert name_re.match(run.name), run.name
    assert f"run:{RUN_ID}" in run.tags

    second = eval_sweep(root, num_samples=2, max_prompts=4, return_state=True)
    assert second.result()["evaluated"] == [] and len(second.result()["rows"]) == 2
    assert len(_artifacts(key)) == 1  # nothing new: no new version
    again = _flow_run(second)
    assert name_re.match(again.name) and again.id != run.id
    assert not any(t.startswith("run:") for t in again.tags)  # a prefix sweep tags the runs it evaluated

    one = evaluate_checkpoint(RUN_ID, "step_000002", storage=root, num_samples=2, max_prompts=4, return_state=True)
    assert one.result()["skipped"] is True
    single = _flow_run(one)
    assert single.name == f"eval-{RUN_ID}-step_000002" and f"run:{RUN_ID}" in single.tags
