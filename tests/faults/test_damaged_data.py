"""A damaged persisted batch found at resume, and its repair with ``nrl resume --recompute``.

The run is a copy of the uninterrupted reference run (``e2e_run``) in the state a kill during
checkpoint 3 leaves (steps 1-3 trained, checkpoint 2 the newest): a resume restores checkpoint 2
and replays ``train`` of step 3 from its persisted batches. One byte of step 3's rollouts shard
is flipped:

- ``nrl resume`` stops before starting anything (exit 2) with an error naming the shard file and
  the repair command;
- ``nrl resume --recompute generate@3`` regenerates just those rollouts (generation refitted to
  the weights of step 2, same seeds: bit-identical to the reference's), replays ``train`` of
  step 3 against its recorded checksum and finishes: the final weights equal the reference's.
"""

from __future__ import annotations

import os
import shutil

from tests.faults.helpers import assert_same_rollouts, checkpoint_bytes, flip_byte
from tests.fixtures.grpo_runs import E2E_RUN_ID, kill_run_actors

RUN_ID = "faults-damaged"


def test_damaged_shard_clear_error_then_recompute(e2e_run, prefect_harness, tmp_path, capsys):
    import storage

    from flows.cli import main
    from flows.observe.metrics import read_metrics

    base = e2e_run["root"]
    root = str(tmp_path / "runs")
    shutil.copytree(os.path.join(base, E2E_RUN_ID), os.path.join(root, RUN_ID))
    shutil.rmtree(os.path.join(root, RUN_ID, "checkpoints", "step_000003"))  # killed while checkpointing step 3
    shutil.rmtree(os.path.join(root, RUN_ID, "evals"), ignore_errors=True)
    rollouts = os.path.join(root, RUN_ID, "steps", "step_000003", "rollouts")
    shard = os.path.join(rollouts, next(f for f in sorted(os.listdir(rollouts)) if f.endswith(".arrow")))
    flip_byte(shard)

    assert main(["resume", RUN_ID, "--storage", root]) == 2
    err = capsys.readouterr().err
    assert shard in err and "CorruptDatasetError" in err, err
    assert "--recompute generate@3" in err, err
    assert not os.path.exists(os.path.join(root, RUN_ID, "checkpoints", "step_000003"))  # nothing ran

    try:
        assert main(["resume", RUN_ID, "--storage", root, "--recompute", "generate@3"]) == 0, capsys.readouterr().err
    finally:
        kill_run_actors(RUN_ID)
    assert_same_rollouts(root, RUN_ID, base, E2E_RUN_ID, 3)
    assert storage.read_manifest(rollouts).meta["recovered"] is True  # regenerated after a full refit to v2
    assert checkpoint_bytes(root, RUN_ID, 3) == checkpoint_bytes(base, E2E_RUN_ID, 3)
    assert [r["step"] for r in read_metrics(os.path.join(root, RUN_ID, "metrics.jsonl"))] == [1, 2, 3]


def test_a_damaged_older_checkpoint_is_saved_anew_when_its_step_is_replayed(e2e_run, prefect_harness, tmp_path, capsys):
    """Checkpoint 2's ``checkpoint.json`` is damaged and checkpoint 3 was never written (a kill
    while checkpointing step 3): the resume discards checkpoint 2, replays steps 1-3 from the initial
    weights and writes checkpoint 2 anew on the way, with the reference's weights (issue 27, item 10;
    before, only the last step's checkpoint was ever written again)."""
    import json

    from flows.cli import main
    from nrl_tasks.stages.checkpoint import list_checkpoints

    base = e2e_run["root"]
    root = str(tmp_path / "runs")
    run_id = "faults-damaged-ckpt"
    shutil.copytree(os.path.join(base, E2E_RUN_ID), os.path.join(root, run_id))
    shutil.rmtree(os.path.join(root, run_id, "checkpoints", "step_000003"))
    shutil.rmtree(os.path.join(root, run_id, "evals"), ignore_errors=True)
    commit = os.path.join(root, run_id, "checkpoints", "step_000002", "checkpoint.json")
    with open(commit, "w", encoding="utf-8") as fh:
        fh.write("{not json")
    try:
        assert main(["resume", run_id, "--storage", root]) == 0, capsys.readouterr().err
    finally:
        kill_run_actors(run_id)
    assert [s for s, _ in list_checkpoints(os.path.join(root, run_id, "checkpoints"))] == [2, 3]
    with open(commit, encoding="utf-8") as fh:
        info = json.load(fh)
    assert info["step"] == 2 and info["weights_version"] == 2, info
    assert checkpoint_bytes(root, run_id, 2) == checkpoint_bytes(base, E2E_RUN_ID, 2)
    assert checkpoint_bytes(root, run_id, 3) == checkpoint_bytes(base, E2E_RUN_ID, 3)
