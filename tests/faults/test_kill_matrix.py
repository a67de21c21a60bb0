"""The flow process SIGKILLed at every stage boundary and in the middle of every stage (test hook
``NRL_FAULT_KILL_AT``), then resumed with ``nrl resume``: the run ends with the weights of the
uninterrupted reference run (``e2e_run``: same config and seed), bit for bit.

Each stage is killed twice: entering the stage (``before``: the boundary after the previous
stage) and with its work done but its output not committed (``during``; for ``refit``: while the
actors stream), on different steps. Two stages share a run (:data:`PAIRS`: four kills in run
order, then a resume that finishes); the actors survive the first and third kill (a Ray cluster
outliving the flow: resume re-attaches and verifies them) and are killed with the second and the
fourth (a local Ray dying with the flow: resume restores the last checkpoint and replays the
persisted ``train`` stages). ``train@2:after`` (between
``train`` and ``refit``) and ``checkpoint@3:during`` are covered by ``tests/flows/test_resume.py``
in the fast suite. The ``advantages`` + ``checkpoint`` run goes with ``storage.fsync=false`` (no fsyncs: still
consistent across killed processes, the page cache survives them).

Invariant: a stage's output is committed (manifest written last) or absent; every resume
recomputes exactly the absent outputs, deterministically (seeds from ``(seed, step, stage,
sample)``), and restores the policy to the last trained step (checkpoint + replay of committed
``train`` stages, verified against their recorded checksums) before anything else.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import yaml

from tests.faults.helpers import checkpoint_bytes, run_nrl, train_checksum
from tests.fixtures.grpo_runs import E2E_RUN_ID, kill_run_actors, tiny_run_config

#: stage -> (first kill, second kill), in run order; checkpoints exist at steps 2 and 3 only
POINTS = {
    "prompts": ("prompts@1:before", "prompts@2:during"),
    "generate": ("generate@1:before", "generate@3:during"),
    "score": ("score@1:during", "score@2:before"),
    "logprob": ("logprob@1:before", "logprob@2:during"),
    "advantages": ("advantages@2:during", "advantages@3:before"),
    "train": ("train@1:before", "train@3:during"),
    "refit": ("refit@1:during", "refit@2:before"),
    "checkpoint": ("checkpoint@2:before", "checkpoint@3:during"),
}

#: two stages a run: their four kills interleaved in run order (a1, b1, a2, b2), none inside a stage
#: that runs beside the previous point's (score and logprob overlap, so they are not paired)
PAIRS = [("prompts", "generate"), ("score", "train"), ("logprob", "refit"), ("advantages", "checkpoint")]

#: ``storage.fsync=false`` keeps datasets consistent across killed processes: one run goes without fsyncs
CASES = [pytest.param(a, b, a != "advantages", id=f"{a}+{b}" if a != "advantages" else f"{a}+{b}-nofsync") for a, b in PAIRS]


def test_the_pairs_cover_every_stage_once_in_run_order():
    assert sorted(s for pair in PAIRS for s in pair) == sorted(POINTS)
    for a, b in PAIRS:
        (a1, a2), (b1, b2) = POINTS[a], POINTS[b]
        steps = [int(p.split("@")[1].split(":")[0]) for p in (a1, b1, a2, b2)]
        assert steps == sorted(steps), (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("first,second,fsync", CASES)
def test_flow_killed_at_stage_then_resumed(
    first, second, fsync, e2e_run, prefect_harness, ray_session, tiny_model_dir, tmp_path
):
    baseline = e2e_run["root"]
    root = str(tmp_path / "runs")
    run_id = f"kill-{first}-{second}" if fsync else f"kill-{first}-{second}-nofsync"
    cfg = tiny_run_config(tiny_model_dir, root, ray_session)
    cfg.setdefault("storage", {})["fsync"] = fsync
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    (a1, a2), (b1, b2) = POINTS[first], POINTS[second]
    killed = -signal.SIGKILL
    try:
        p = run_nrl(["grpo", "--config", str(cfg_path), "--run-id", run_id], prefect_harness, kill_at=a1)
        assert p.returncode == killed, (a1, p.stderr[-3000:])
        for n, point in enumerate((b1, a2, b2), start=2):
            p = run_nrl(["resume", run_id, "--storage", root], prefect_harness, kill_at=point)
            assert p.returncode == killed, (point, p.stdout[-2000:] + p.stderr[-3000:])
            if n % 2 == 0:  # kills 1 and 3: the actors outlive the flow; 2 and 4: they go with it
                kill_run_actors(run_id)
        p = run_nrl(["resume", run_id, "--storage", root], prefect_harness)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    finally:
        kill_run_actors(run_id)
    for step in (2, 3):
        assert checkpoint_bytes(root, run_id, step) == checkpoint_bytes(baseline, E2E_RUN_ID, step), step
    for step in (1, 2, 3):
        assert train_checksum(root, run_id, step) == train_checksum(baseline, E2E_RUN_ID, step), step
    from flows.observe.metrics import read_metrics

    assert [r["step"] for r in read_metrics(os.path.join(root, run_id, "metrics.jsonl"))] == [1, 2, 3]
    with open(os.path.join(root, run_id, "status.json")) as fh:
        assert json.load(fh)["status"] == "completed"


@pytest.mark.slow
def test_lora_run_killed_twice_then_resumed_is_bit_identical(prefect_harness, ray_session, tiny_model_dir, tmp_path):
    """LoRA on (``configs/grpo_tiny_lora.yaml``'s adapters, adapters-only refits) with a reward that
    varies (so the adapters train: every step's checksum differs): SIGKILLed inside step 2's
    ``train`` (actors survive) and while step 3's refit streams the adapters (actors go with the
    flow), then resumed. The adapter files of both checkpoints and every step's
    train checksum equal an uninterrupted LoRA run's, bit for bit."""
    with open("configs/grpo_tiny_lora.yaml", encoding="utf-8") as fh:
        lora = yaml.safe_load(fh)["policy"]["dtensor_cfg"]["lora_cfg"]
    reward = {"env.reward_fn": "tests.flows.test_dynamic_sampling:parity_reward"}
    runs = {}
    for name in ("reference", "killed"):
        root = str(tmp_path / name)
        cfg = tiny_run_config(tiny_model_dir, root, ray_session, **reward)
        cfg["policy"]["dtensor_cfg"] = {"lora_cfg": lora}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        runs[name] = (root, f"lora-{name}", path)
    root, run_id, path = runs["reference"]
    try:
        p = run_nrl(["grpo", "--config", str(path), "--run-id", run_id], prefect_harness)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    finally:
        kill_run_actors(run_id)
    root, run_id, path = runs["killed"]
    try:
        p = run_nrl(["grpo", "--config", str(path), "--run-id", run_id], prefect_harness, kill_at="train@2:during")
        assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
        p = run_nrl(["resume", run_id, "--storage", root], prefect_harness, kill_at="refit@3:during")
        assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
        kill_run_actors(run_id)
        p = run_nrl(["resume", run_id, "--storage", root], prefect_harness)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    finally:
        kill_run_actors(run_id)
    ref_root, ref_id, _ = runs["reference"]
    sums = [train_checksum(ref_root, ref_id, step) for step in (1, 2, 3)]
    assert len(set(sums)) == 3, sums  # the adapters trained at every step
    assert [train_checksum(root, run_id, step) for step in (1, 2, 3)] == sums
    for step in (2, 3):
        got, want = checkpoint_bytes(root, run_id, step), checkpoint_bytes(ref_root, ref_id, step)
        assert any(name.endswith("adapter_model.safetensors") for name in want), sorted(want)
        assert got == want, step
