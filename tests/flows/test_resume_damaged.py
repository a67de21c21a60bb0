"""``nrl resume`` with a damaged newest checkpoint and a damaged ``metrics.jsonl``.

Each run is a copy of the uninterrupted reference run (``e2e_run``: 3 steps, checkpoints 2 and
3) resumed with fresh actors, so the resume restores its newest intact checkpoint and replays the
``train`` of every later step from its persisted batches, each checked against the checksum the
step recorded. The damaged checkpoint 3 is discarded and written again by step 3: its weights
and optimizer state end bit-identical to the reference's.
"""

from __future__ import annotations

import json
import os
import shutil

from tests.faults.helpers import train_checksum
from tests.fixtures.grpo_runs import E2E_RUN_ID, kill_run_actors

RUN_ID = "resume-damaged-ckpt"
FILES = ("weights/model.safetensors", "optimizer/optimizer.safetensors")


def _bytes(root: str, run_id: str, step: int) -> dict[str, bytes]:
    d = os.path.join(root, run_id, "checkpoints", f"step_{step:06d}")
    return {f: open(os.path.join(d, f), "rb").read() for f in FILES}


def _flip_value(path: str) -> None:
    with open(path, "r+b") as fh:
        fh.seek(-64, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-64, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0x01]))


def _resume(root: str, capsys) -> None:
    from flows.cli import main

    try:
        code = main(["resume", RUN_ID, "--storage", root])
    finally:
        kill_run_actors(RUN_ID)
    assert code == 0, capsys.readouterr().err[-4000:]


def _copy_reference(e2e_run, tmp_path) -> tuple[str, str, str]:
    base, root = e2e_run["root"], str(tmp_path / "runs")
    run = os.path.join(root, RUN_ID)
    shutil.copytree(os.path.join(base, E2E_RUN_ID), run)
    shutil.rmtree(os.path.join(run, "evals"), ignore_errors=True)
    return base, root, run


def _checkpoint(run: str, step: int) -> str:
    return os.path.join(run, "checkpoints", f"step_{step:06d}")


def _assert_like_the_reference(base: str, root: str) -> None:
    assert _bytes(root, RUN_ID, 3) == _bytes(base, E2E_RUN_ID, 3)
    for step in (1, 2, 3):
        assert train_checksum(root, RUN_ID, step) == train_checksum(base, E2E_RUN_ID, step)
    status = json.loads(open(os.path.join(root, RUN_ID, "status.json")).read())
    assert status["status"] == "completed"


def test_checkpoints_with_damaged_files_fall_back_to_the_initial_weights(e2e_run, prefect_harness, tmp_path, capsys):
    """optimizer/ of checkpoint 3 deleted, one value of checkpoint 2's weights changed (both found
    by the file check before loading), metrics.jsonl emptied: the initial weights are restored,
    steps 1-3 replayed and checked, checkpoints 2 and 3 written again; lines 1-2 rebuilt."""
    from flows.observe.metrics import read_metrics
    from nrl_tasks.stages.checkpoint import list_checkpoints, read_checkpoint_info

    base, root, run = _copy_reference(e2e_run, tmp_path)
    metrics = os.path.join(run, "metrics.jsonl")
    shutil.rmtree(os.path.join(_checkpoint(run, 3), "optimizer"))
    _flip_value(os.path.join(_checkpoint(run, 2), "weights", "model.safetensors"))
    open(metrics, "w").close()
    _resume(root, capsys)
    _assert_like_the_reference(base, root)
    assert "files" in read_checkpoint_info(_checkpoint(run, 3))  # written again by the step
    # 2 was discarded, then saved anew from its replayed train: the reference's checkpoints, byte for byte
    ref_checkpoints = [s for s, _ in list_checkpoints(os.path.join(base, E2E_RUN_ID, "checkpoints"))]
    assert [s for s, _ in list_checkpoints(os.path.join(run, "checkpoints"))] == ref_checkpoints == [2, 3]
    assert _bytes(root, RUN_ID, 2) == _bytes(base, E2E_RUN_ID, 2)
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["rebuilt"] and rows[1]["rebuilt"] and "rebuilt" not in rows[2]
    ref_rows = read_metrics(os.path.join(base, E2E_RUN_ID, "metrics.jsonl"))
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]


def test_a_checkpoint_without_manifest_is_checked_after_loading(e2e_run, prefect_harness, tmp_path, capsys):
    """One value of checkpoint 3's weights changed and its file manifest removed (a checkpoint
    from before manifests), one metrics.jsonl line torn: the weights checksum after loading
    differs from step 3's, so recovery plans again without it: checkpoint 2, replay of step 3,
    checkpoint 3 written again; the torn line rebuilt."""
    from flows.observe.metrics import read_metrics
    from nrl_tasks.stages.checkpoint import read_checkpoint_info

    base, root, run = _copy_reference(e2e_run, tmp_path)
    ck3, metrics = _checkpoint(run, 3), os.path.join(run, "metrics.jsonl")
    _flip_value(os.path.join(ck3, "weights", "model.safetensors"))
    info = read_checkpoint_info(ck3)
    for key in ("files", "checksum_algorithm", "optimizer"):
        info.pop(key, None)
    with open(os.path.join(ck3, "checkpoint.json"), "w") as fh:
        json.dump(info, fh)
    lines = open(metrics).read().splitlines()
    with open(metrics, "w") as fh:
        fh.write("\n".join([lines[0], lines[1][:30], lines[2]]) + "\n")
    _resume(root, capsys)
    _assert_like_the_reference(base, root)
    assert "files" in read_checkpoint_info(ck3)  # discarded after loading, written again
    assert _bytes(root, RUN_ID, 2) == _bytes(base, E2E_RUN_ID, 2)  # the fallback, untouched
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["rebuilt"] and "rebuilt" not in rows[0]
