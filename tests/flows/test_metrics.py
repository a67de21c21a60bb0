"""metrics.jsonl attempts columns: ``<stage>_attempts`` (1 without retry, the successful attempt's
Prefect run count after retries, 0 when the stage found its output committed)."""

from __future__ import annotations

import os

from flows.observe.metrics import build_step_metrics, format_console_line, read_metrics


def test_attempt_columns_from_task_results_and_committed_manifests():
    ran = {"rollouts": {"seconds": 1.0, "attempts": 2}, "logprobs": {"seconds": 0.1, "attempts": 1},
           "train": {"seconds": 0.3, "attempts": 1}, "rewards": {"seconds": 0.0}}
    row = build_step_metrics(4, ran, refit={"seconds": 0.1, "attempts": 3}, checkpoint={"seconds": 0.2, "attempts": 1})
    assert (row["generate_attempts"], row["logprob_attempts"], row["train_attempts"]) == (2, 1, 1)
    assert row["refit_attempts"] == 3 and row["checkpoint_attempts"] == 1
    assert "val_attempts" not in row  # no validation at this step
    assert "attempts generate x2 refit x3" in format_console_line("r", row, 5)

    # a resumed step's line: manifests read back from storage carry no attempts -> 0; a skipped
    # checkpoint (committed before the crash) and a skipped refit report 0 too
    committed = {k: {kk: vv for kk, vv in v.items() if kk != "attempts"} for k, v in ran.items()}
    row = build_step_metrics(4, committed, refit={"seconds": 0.0, "skipped": True, "attempts": 0},
                             checkpoint={"skipped": True, "attempts": 0}, val={"val_accuracy": 0.5, "attempts": 1})
    assert (row["generate_attempts"], row["logprob_attempts"], row["train_attempts"]) == (0, 0, 0)
    assert (row["refit_attempts"], row["checkpoint_attempts"], row["val_attempts"]) == (0, 0, 1)
    assert "attempts" not in format_console_line("r", row, 5)


def test_orchestration_is_the_step_wall_time_outside_stage_work():
    ran = {"rollouts": {"seconds": 1.2, "generate_seconds": 1.0}, "rewards": {"seconds": 0.05},
           "logprobs": {"seconds": 0.4, "compute_seconds": 0.3}, "train": {"seconds": 1.5, "train_seconds": 1.25}}
    row = build_step_metrics(3, ran, refit={"seconds": 0.2}, checkpoint={"seconds": 0.5}, val={"val_accuracy": 0.5, "seconds": 0.7},
                             wall_seconds=5.0)
    # work: generate 1.0 + score 0.05 + logprob 0.3 + train 1.25 + refit 0.2 + checkpoint 0.5 + validation 0.7 = 4.0
    assert abs(row["compute_s"] - 2.8) < 1e-9 and abs(row["orchestration_s"] - 1.0) < 1e-9
    assert "| step 5.00s = work 4.00s + orchestration 1.00s" in format_console_line("r", row, 5)
    assert build_step_metrics(3, {}, wall_seconds=5.0)["orchestration_s"] is None  # no stage timed: unknown
    assert "orchestration_s" not in build_step_metrics(3, ran)  # no wall time (a rebuilt line)


def test_uninterrupted_run_reports_one_attempt_and_the_retried_refit(e2e_run):
    """The reference run (injected mid-stream failure of the step-2 refit): every stage needed
    one attempt except that refit, which succeeded at its second."""
    rows = read_metrics(os.path.join(e2e_run["root"], e2e_run["result"]["run_id"], "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert (r["generate_attempts"], r["logprob_attempts"], r["train_attempts"]) == (1, 1, 1), r
    assert [r["refit_attempts"] for r in rows] == [1, 2, 1]
    assert "checkpoint_attempts" not in rows[0]
    assert rows[1]["checkpoint_attempts"] == rows[2]["checkpoint_attempts"] == 1
    assert rows[1]["val_attempts"] == 1 and "val_attempts" not in rows[2]
    for r in rows:  # every line of a flow run splits its wall time
        assert 0.0 <= r["orchestration_s"] <= r["step_s"] and r["step_s"] - r["orchestration_s"] >= r["compute_s"] - 1e-6, r


# ---------------------------------------------------------------------------------------------
# repair: lost and damaged lines are rebuilt from the committed datasets

#: figures a rebuilt line must reproduce exactly (the rest only the flow run knew: refit_s,
#: step_s, attempts; compute_s / stages_s include the refit; checkpoint_s is timed a little later)
REBUILT_EXACT = (
    "weights_version", "reward_mean", "reward_std", "reward_max", "invalid_rewards", "loss", "grad_norm",
    "groups_with_signal", "new_tokens", "truncated_frac", "tokens_per_s", "train_tokens_per_s", "prompts_s",
    "generate_s", "score_s", "logprob_s", "advantages_s", "train_s", "val_accuracy", "val_s",
)


def _copy_reference(e2e_run, tmp_path):
    import shutil

    from nrl_tasks.run_layout import RunLayout

    run_id = e2e_run["result"]["run_id"]
    root = str(tmp_path / "runs")
    shutil.copytree(os.path.join(e2e_run["root"], run_id), os.path.join(root, run_id))
    ref = read_metrics(os.path.join(e2e_run["root"], run_id, "metrics.jsonl"))
    return RunLayout(root, run_id), ref


def test_a_garbage_line_is_skipped_with_file_and_line_number(tmp_path, caplog):
    uri = str(tmp_path / "metrics.jsonl")
    with open(uri, "w") as fh:
        fh.write('{"step": 1, "loss": 0.5}\n{"step": 2, "lo\x00ss\n[3]\n{"step": 4}\n')
    with caplog.at_level("WARNING", logger="flows.observe.metrics"):
        rows = read_metrics(uri)
    assert [r["step"] for r in rows] == [1, 4]
    assert f"{uri} line 2 is damaged" in caplog.text and f"{uri} line 3 is damaged" in caplog.text


def test_an_emptied_file_is_rebuilt_from_the_committed_datasets(e2e_run, tmp_path):
    from flows.observe.metrics import repair_metrics

    layout, ref = _copy_reference(e2e_run, tmp_path)
    open(layout.metrics_uri, "w").close()
    assert repair_metrics(layout, 3) == [1, 2, 3]
    rows = read_metrics(layout.metrics_uri)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for got, want in zip(rows, ref):
        assert got["rebuilt"] is True
        assert {k: got.get(k) for k in REBUILT_EXACT} == {k: want.get(k) for k in REBUILT_EXACT}, got["step"]
        assert got["train_attempts"] is None and "refit_s" not in got and "step_s" not in got
    assert "checkpoint_s" not in rows[0] and rows[1]["checkpoint_s"] > 0 and rows[2]["checkpoint_s"] > 0
    assert repair_metrics(layout, 3) == []  # nothing left to do


def test_a_garbage_line_is_rebuilt_and_the_others_kept(e2e_run, tmp_path, caplog):
    from flows.observe.metrics import repair_metrics

    layout, ref = _copy_reference(e2e_run, tmp_path)
    lines = open(layout.metrics_uri).read().splitlines()
    lines[1] = lines[1][:40]  # a torn line
    with open(layout.metrics_uri, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    with caplog.at_level("WARNING", logger="flows.observe.metrics"):
        assert repair_metrics(layout, 3) == [2]
    assert f"{layout.metrics_uri} line 2 is damaged" in caplog.text
    rows = read_metrics(layout.metrics_uri)
    assert rows[0] == ref[0] and rows[2] == ref[2]  # untouched
    assert rows[1]["rebuilt"] is True and rows[1]["loss"] == ref[1]["loss"] and rows[1]["val_accuracy"] == ref[1]["val_accuracy"]
    assert "\x00" not in open(layout.metrics_uri).read() and not [
        n for n in os.listdir(os.path.dirname(layout.metrics_uri)) if n.startswith(".") and "metrics" in n
    ]  # rewritten atomically, no temp file left
