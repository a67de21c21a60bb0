"""metrics.jsonl attempts columns: ``<stage>_attempts`` (1 without retry, the successful attempt's
Prefect run count after retries, 0 when the stage found its output committed)."""

from __future__ import annotations

import os

from flows.metrics import build_step_metrics, format_console_line, read_metrics


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
