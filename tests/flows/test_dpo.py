"""``nrl dpo`` through the real flow (tiny model on Ray, real Prefect runs, Arrow on disk) on a
small preference set written here: 16 arithmetic pairs (chosen: the sum, rejected: the sum + 1),
8 pairs a step, 8 steps, checkpoints at 3, 6 and 8.

Checked: the chosen-vs-rejected margin rises; every step persists its pairs, reference logprobs
and train metrics and the metrics line carries them; the flow SIGKILLed in the middle of step 5's
update and resumed with ``nrl resume`` ends with the uninterrupted run's weights at every step (a
replay of step 4 from checkpoint 3 included); bad preference files are clear errors naming the
file, line and field.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest
import torch
import yaml

from tests.faults.helpers import flip_byte, run_nrl, train_checksum
from tests.fixtures.grpo_runs import REPO, kill_run_actors

RUN_ID = "dpo-tiny"
STEPS = tuple(range(1, 9))


def _pairs_file(path) -> str:
    rows = [{"prompt": f"{a}+{b}=", "chosen": f" {a + b}", "rejected": f" {a + b + 1}"} for a in range(4) for b in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _config(tmp_path, model_dir: str, root: str, ray_address: str | None) -> dict:
    with open(os.path.join(REPO, "configs", "dpo_tiny.yaml"), encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    cfg["dpo"]["max_num_steps"] = 8
    cfg["policy"]["model_name"] = model_dir
    cfg["data"] = {"train_path": _pairs_file(tmp_path / "pairs.jsonl")}
    cfg["checkpointing"]["save_period"] = 3
    cfg["storage"]["root"] = root
    cfg.setdefault("cluster", {}).setdefault("ray", {})["address"] = ray_address
    cfg.setdefault("logger", {})["console"] = False
    return cfg


@pytest.fixture(scope="module")
def dpo_run(prefect_harness, ray_session, tiny_model_dir, tmp_path_factory):
    from flows.algorithms.dpo import dpo

    tmp = tmp_path_factory.mktemp("dpo")
    root = str(tmp / "runs")
    cfg = _config(tmp, tiny_model_dir, root, ray_session)
    try:
        out = dpo(config=cfg, run_id=RUN_ID)
    finally:
        kill_run_actors(RUN_ID)
    return {"root": root, "out": out, "tmp": tmp}


def test_margin_rises_and_every_step_is_persisted(dpo_run):
    import storage
    from flows.observe.metrics import read_metrics

    root = dpo_run["root"]
    rows = read_metrics(os.path.join(root, RUN_ID, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(STEPS)
    margins = [r["rewards_margin_mean"] for r in rows]
    assert margins[0] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert sum(margins[-3:]) / 3 > sum(margins[:3]) / 3 + 0.05, margins
    assert rows[-1]["accuracy"] >= 0.75, rows[-1]
    for s in STEPS:
        d = os.path.join(root, RUN_ID, "steps", f"step_{s:06d}")
        pairs = storage.load_batch(os.path.join(d, "pairs"))
        ref = storage.load_batch(os.path.join(d, "reference"))
        assert pairs.size == 16 and torch.equal(pairs["pair_index"], torch.arange(8).repeat_interleave(2))
        assert ref["reference_policy_logprobs"].shape == pairs["input_ids"].shape
        assert storage.read_manifest(os.path.join(d, "train")).meta["weights_checksum"]
    assert [os.path.basename(c) for c in dpo_run["out"]["checkpoints"]] == ["step_000003", "step_000006", "step_000008"]
    with open(os.path.join(root, RUN_ID, "status.json"), encoding="utf-8") as fh:
        assert json.load(fh)["status"] == "completed"


@pytest.mark.slow  # a killed whole-flow run and its resume: in the slow suite (keeps make test under 10 minutes)
def test_killed_mid_update_then_resumed_is_bit_identical(dpo_run, tmp_path, prefect_harness, ray_session, tiny_model_dir):
    root = str(tmp_path / "runs")
    cfg_path = tmp_path / "dpo.yaml"
    cfg_path.write_text(yaml.safe_dump(_config(tmp_path, tiny_model_dir, root, ray_session)))
    run_id = "dpo-kill"
    try:
        p = run_nrl(["dpo", "--config", str(cfg_path), "--run-id", run_id], prefect_harness, kill_at="dpo_train@5:during")
        assert p.returncode == -signal.SIGKILL, p.stdout[-2000:] + p.stderr[-3000:]
        kill_run_actors(run_id)
        p = run_nrl(["resume", run_id, "--storage", root], prefect_harness)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    finally:
        kill_run_actors(run_id)
    with open(os.path.join(root, run_id, "status.json"), encoding="utf-8") as fh:
        status = json.load(fh)
    assert status["status"] == "completed"
    assert status["restored"] == {"restored_from": os.path.join(root, run_id, "checkpoints", "step_000003"), "replayed": [4],
                                  "recomputed": {}}
    ref = dpo_run["root"]
    assert [train_checksum(root, run_id, s) for s in STEPS] == [train_checksum(ref, RUN_ID, s) for s in STEPS]
    from flows.observe.metrics import read_metrics

    assert [r["step"] for r in read_metrics(os.path.join(root, run_id, "metrics.jsonl"))] == list(STEPS)


def test_bad_preference_files_name_the_file_line_and_field(tmp_path):
    from nrl_tasks.stages.preferences import load_preference_file

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "1+1=", "chosen": " 2", "rejected": " 3"}\n{"prompt": "2+2=", "chosen": " 4"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl.*line 2.*missing field 'rejected'"):
        load_preference_file(str(f))
    f.write_text('{"prompt": "1+1=", "chosen": " 2", "rejected": " 2"}\n')
    with pytest.raises(ValueError, match=r"line 1.*same text"):
        load_preference_file(str(f))
    f.write_text('{"prompt": "1+1=", "chosen": "", "rejected": " 2"}\n')
    with pytest.raises(ValueError, match=r"line 1, row 0: field 'chosen' must be a non-empty string"):
        load_preference_file(str(f))


def test_pair_batch_interleaves_and_masks_the_responses(tiny_model_dir):
    from transformers import AutoTokenizer

    from flows.config import load_config
    from nrl_tasks.stages.preferences import build_pair_batch

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = load_config(os.path.join(REPO, "configs", "dpo_tiny.yaml"))
    recs = [{"prompt": "1+2=", "chosen": " 3", "rejected": " 44"}, {"prompt": "2+2=", "chosen": " 4", "rejected": " 5"}]
    b = build_pair_batch(recs, [1, 0], tok, cfg.data, 64)
    assert torch.equal(b["record_index"], torch.tensor([1, 1, 0, 0]))
    for row, (rec, field) in enumerate([(recs[1], "chosen"), (recs[1], "rejected"), (recs[0], "chosen"), (recs[0], "rejected")]):
        resp = tok(rec[field], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        n = int(b["input_lengths"][row])
        assert b["input_ids"][row, n - len(resp): n].tolist() == resp
        assert b["token_mask"][row].nonzero().flatten().tolist() == list(range(n - len(resp), n))
    # max length 4: " 44" + EOS (4 tokens) keeps its first 3, after the prompt's last token
    short = build_pair_batch(recs, [0], tok, cfg.data, 4)
    prompt = tok("1+2=", add_special_tokens=False)["input_ids"]
    resp = tok(" 44", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert len(resp) == 4 and short["input_ids"][1].tolist() == [prompt[-1], *resp[:3]]
    assert short["token_mask"][1].tolist() == [0.0, 1.0, 1.0, 1.0]


def test_cli_refuses_a_grpo_config_for_dpo(capsys, tmp_path):
    from flows.cli import main

    assert main(["dpo", "--config", os.path.join(REPO, "configs", "grpo_tiny.yaml"), "--storage", str(tmp_path)]) == 2
    assert "no `dpo` section" in capsys.readouterr().err


def _popen_nrl(args: list[str], api_url: str) -> Any:
    import subprocess
    import sys

    env = {**os.environ, "PREFECT_API_URL": api_url, "NRL_KEEP_ACTORS": "0"}
    env.pop("NRL_FAULT_KILL_AT", None)
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow  # a killed whole-flow run and its resume: in the slow suite (keeps make test under 10 minutes)
def test_sigterm_exits_143_interrupted_then_resumes_bit_identically(dpo_run, tmp_path, prefect_harness, ray_session, tiny_model_dir):
    """The run session's guarantees, for DPO as for GRPO: SIGTERM stops the flow cleanly (exit
    143, ``status.json`` ``interrupted``, not ``failed``) and ``nrl resume`` ends on the
    uninterrupted run's weights at every step."""
    import time

    root = str(tmp_path / "runs")
    cfg_path = tmp_path / "dpo.yaml"
    cfg_path.write_text(yaml.safe_dump(_config(tmp_path, tiny_model_dir, root, ray_session)))
    run_id = "dpo-term"
    marker = os.path.join(root, run_id, "steps", "step_000004", "pairs", "_manifest.json")
    proc = _popen_nrl(["dpo", "--config", str(cfg_path), "--run-id", run_id], prefect_harness)
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(marker) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[0][-3000:]  # still training at step 4
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=180)[0]
        assert proc.returncode == 143, out[-3000:]
        assert "stopped by SIGTERM" in out and f"nrl resume {run_id}" in out, out[-3000:]
        with open(os.path.join(root, run_id, "status.json"), encoding="utf-8") as fh:
            status = json.load(fh)
        assert status["status"] == "interrupted" and status["algorithm"] == "dpo", status
        kill_run_actors(run_id)
        p = run_nrl(["resume", run_id, "--storage", root], prefect_harness)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_run_actors(run_id)
    with open(os.path.join(root, run_id, "status.json"), encoding="utf-8") as fh:
        assert json.load(fh)["status"] == "completed"
    ref = dpo_run["root"]
    assert [train_checksum(root, run_id, s) for s in STEPS] == [train_checksum(ref, RUN_ID, s) for s in STEPS]


_BAD_PREFERENCE_FILES = {
    # name: (file text or None for no file, override, the words the error must hold)
    "missing-field": ('{"prompt": "1+1=", "chosen": " 2", "rejected": " 3"}\n{"prompt": "2+2=", "chosen": " 4"}\n',
                      None, ["data.train_path", "p.jsonl", "line 2", "missing field 'rejected'"]),
    "not-a-string": ('{"prompt": "1+1=", "chosen": 2, "rejected": " 3"}\n', None,
                     ["data.train_path", "p.jsonl", "line 1", "field 'chosen' must be a non-empty string"]),
    "empty-prompt": ('{"prompt": " ", "chosen": " 2", "rejected": " 3"}\n', None,
                     ["p.jsonl", "line 1", "field 'prompt' must be a non-empty string"]),
    "bad-json": ('{"prompt": "1+1=", "chosen": " 2", "rejected": " 3"}\n{"prompt": \n', None, ["p.jsonl", "line 2", "invalid JSON"]),
    "no-file": (None, None, ["data.train_path", "p.jsonl"]),
    "no-model": ('{"prompt": "1+1=", "chosen": " 2", "rejected": " 3"}\n', "policy.model_name=/no/such/model",
                 ["policy.model_name", "/no/such/model"]),
}


@pytest.mark.parametrize("case", sorted(_BAD_PREFERENCE_FILES))
def test_nrl_dpo_preflight_refuses_a_bad_preference_file_before_anything_starts(case, tmp_path, capsys, monkeypatch):
    """``nrl dpo`` checks the preference pairs and the model before the Prefect server, Ray or the
    run directory (issue 27, item 4): exit 2 naming the key, file, line and field; nothing written,
    so the same ``--run-id`` starts once the file is fixed."""
    import flows.cli_run
    from flows.cli import main

    text, override, words = _BAD_PREFERENCE_FILES[case]
    pairs = tmp_path / "p.jsonl"
    if text is not None:
        pairs.write_text(text)
    started = []
    monkeypatch.setattr(flows.cli_run, "run_flow", lambda *a, **k: started.append(a) or 0)
    monkeypatch.setattr("flows.cli.run_flow", lambda *a, **k: started.append(a) or 0)
    root = tmp_path / "runs"
    args = ["dpo", "--config", os.path.join(REPO, "configs", "dpo_tiny.yaml"), "--storage", str(root), "--run-id", "d1",
            "data.dataset=file", f"data.train_path={pairs}", *([override] if override else [])]
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("nrl: error:") == 1, err
    assert all(w in err for w in words), err
    assert started == [] and not (root / "d1").exists()


def _shard(dataset_dir: str) -> str:
    return os.path.join(dataset_dir, next(f for f in sorted(os.listdir(dataset_dir)) if f.endswith(".arrow")))


@pytest.mark.slow  # a whole-flow resume (the module's reference run is shared with the fast tests)
def test_damaged_dpo_data_is_found_before_start_and_made_again_on_resume(dpo_run, tmp_path, capsys):
    """Issue 27, item 4: the run is a copy of the reference run as a kill while checkpointing step 8
    leaves it (steps 1-8 but step 8's train, checkpoint 6 the newest): a resume restores
    checkpoint 6, replays step 7 and trains step 8.

    - step 7's ``train`` damaged: ``nrl resume`` stops before anything starts (exit 2) naming the
      shard, and says it cannot be recomputed;
    - step 7's ``pairs`` (replayed), step 8's ``reference`` (not trained yet) and the frozen
      preference pairs damaged: ``nrl resume`` names them in its plan, makes them again (the same
      bytes) and finishes on the reference run's weights at every step."""
    import shutil

    import storage
    from flows.cli import main

    base, root, run_id = dpo_run["root"], str(tmp_path / "runs"), "dpo-damaged"
    run = os.path.join(root, run_id)
    shutil.copytree(os.path.join(base, RUN_ID), run)
    shutil.rmtree(os.path.join(run, "checkpoints", "step_000008"))
    storage.delete_batch(os.path.join(run, "steps", "step_000008", "train"))
    step = lambda s, d: os.path.join(run, "steps", f"step_{s:06d}", d)  # noqa: E731

    train7 = _shard(step(7, "train"))
    flip_byte(train7, 100)
    assert main(["resume", run_id, "--storage", root]) == 2
    err = capsys.readouterr().err
    assert train7 in err and "cannot be recomputed" in err, err
    shutil.copyfile(_shard(os.path.join(base, RUN_ID, "steps", "step_000007", "train")), train7)

    damaged = [_shard(step(7, "pairs")), _shard(step(8, "reference")), _shard(os.path.join(run, "data", "preferences"))]
    for shard in damaged:
        flip_byte(shard)
    try:
        assert main(["resume", run_id, "--storage", root]) == 0, capsys.readouterr().err[-3000:]
    finally:
        kill_run_actors(run_id)
    out = capsys.readouterr().out
    assert "make again the damaged" in out and all(os.path.dirname(s) in out for s in damaged), out[-3000:]
    assert [train_checksum(root, run_id, s) for s in STEPS] == [train_checksum(base, RUN_ID, s) for s in STEPS]
    for shard in damaged:  # made again: the same data as the reference run's
        rel = os.path.relpath(os.path.dirname(shard), run)
        mine, ref = storage.load_batch(os.path.dirname(shard)), storage.load_batch(os.path.join(base, RUN_ID, rel))
        assert all(torch.equal(mine[k], ref[k]) if torch.is_tensor(ref[k]) else list(mine[k]) == list(ref[k]) for k in ref), rel


def test_nrl_resume_of_a_dpo_run_runs_its_preflight(tmp_path, capsys, monkeypatch):
    """A DPO run stopped before it froze its pairs reads its preference file again when resumed:
    ``nrl resume`` checks it first (issue 27, item 4), exit 2 naming the file, line and field,
    and starts nothing."""
    from flows.cli import main
    from flows.algorithms.dpo import DPO
    from flows.run.resolve import resolve_config
    from flows.run.state import init_run
    from nrl_tasks.run_layout import RunLayout

    pairs, root = tmp_path / "p.jsonl", str(tmp_path / "runs")
    pairs.write_text('{"prompt": "1+1=", "chosen": " 2", "rejected": " 3"}\n')
    cfg = resolve_config(os.path.join(REPO, "configs", "dpo_tiny.yaml"), ["data.dataset=file", f"data.train_path={pairs}"],
                         root, recipe=DPO)
    init_run(RunLayout(root, "d2"), cfg, resume=False)  # config.yaml written, nothing else (killed then)
    pairs.write_text('{"prompt": "1+1=", "chosen": " 2", "rejected": " 3"}\n{"prompt": "2+2=", "rejected": " 5"}\n')
    started = []
    monkeypatch.setattr("flows.cli.run_flow", lambda *a, **k: started.append(a) or 0)
    assert main(["resume", "d2", "--storage", root]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in ("data.train_path", str(pairs), "line 2", "missing field 'chosen'")), err
    assert started == [] and sorted(os.listdir(os.path.join(root, "d2"))) == ["config.yaml"]


@pytest.mark.slow  # a killed whole-flow run and its resume
def test_dpo_resume_without_optimizer_state_is_refused_unless_fresh_optimizer(
    dpo_run, tmp_path, capsys, prefect_harness, ray_session, tiny_model_dir
):
    """Issue 27, item 1 for DPO: a run saved with ``checkpointing.save_optimizer: false`` and killed
    in step 5 (checkpoint 3, step 4 trained) is refused by ``nrl resume`` (exit 2, naming the key
    and ``--fresh-optimizer``) and by ``--fresh-optimizer`` too (step 4's replay must reproduce its
    recorded weights). Where nothing is replayed (a kill before step 4's update was committed),
    ``--fresh-optimizer`` trains on and records ``optimizer_reset``: steps 1-3 keep the reference
    run's weights, step 4 on does not (a fresh optimizer)."""
    import storage
    from flows.cli import main

    root, run_id = str(tmp_path / "runs"), "dpo-no-opt"
    cfg = _config(tmp_path, tiny_model_dir, root, ray_session)
    cfg["checkpointing"]["save_optimizer"] = False
    cfg_path = tmp_path / "dpo.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    try:
        p = run_nrl(["dpo", "--config", str(cfg_path), "--run-id", run_id], prefect_harness, kill_at="dpo_train@5:during")
        assert p.returncode == -signal.SIGKILL, p.stdout[-2000:] + p.stderr[-3000:]
        kill_run_actors(run_id)
        assert main(["resume", run_id, "--storage", root]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "checkpointing.save_optimizer" in err and f"nrl resume {run_id} --fresh-optimizer" in err, err
        assert main(["resume", run_id, "--storage", root, "--fresh-optimizer"]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "step 4 was trained after it" in err and "checkpointing.save_optimizer" in err, err
        assert not storage.is_committed(os.path.join(root, run_id, "steps", "step_000005", "train"))

        storage.delete_batch(os.path.join(root, run_id, "steps", "step_000004", "train"))  # as a kill before it left it
        assert main(["resume", run_id, "--storage", root, "--fresh-optimizer"]) == 0, capsys.readouterr().err[-3000:]
    finally:
        kill_run_actors(run_id)
    with open(os.path.join(root, run_id, "status.json"), encoding="utf-8") as fh:
        status = json.load(fh)
    assert status["status"] == "completed"
    assert status["optimizer_reset"]["checkpoint_step"] == 3 and status["optimizer_reset"]["first_step"] == 4, status
    from flows.observe.metrics import read_metrics

    lines = {r["step"]: r for r in read_metrics(os.path.join(root, run_id, "metrics.jsonl"))}
    assert lines[4].get("optimizer_reset") is True and all("optimizer_reset" not in lines[s] for s in STEPS if s != 4)
    ref = dpo_run["root"]
    same = [train_checksum(root, run_id, s) == train_checksum(ref, RUN_ID, s) for s in STEPS]
    assert same == [True] * 3 + [False] * 5, same
