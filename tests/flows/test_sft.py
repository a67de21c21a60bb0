"""SFT's batch (prompt + `` answer`` + EOS, loss only on the completion) and one writer per SFT run."""

from __future__ import annotations

import torch

from tests.fixtures.grpo_runs import TINY_CONFIG


def test_sft_batch_masks_the_answer_and_its_eos(tiny_model_dir):
    from transformers import AutoTokenizer

    from flows.config import load_config
    from flows.algorithms.sft import build_sft_batch

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = load_config(TINY_CONFIG)
    recs = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "10+20=", "answer": "30"}]
    b = build_sft_batch(recs, tok, cfg.data, 64)
    for row, r in enumerate(recs):
        ans = tok(" " + r["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        n = int(b["input_lengths"][row])
        assert b["input_ids"][row, n - len(ans): n].tolist() == ans
        assert b["token_mask"][row].nonzero().flatten().tolist() == list(range(n - len(ans), n))
    assert torch.equal(b["sample_mask"], torch.ones(2))


def test_a_second_writer_of_a_running_sft_is_refused(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    """An SFT run is a run of its own session: while one flow trains it, a second one
    with the same run id is refused at once, naming the holder, and writes nothing; the holder's
    ``status.json`` says ``running`` with its own process and ``algorithm: sft``."""
    import json
    import os
    import subprocess
    import sys
    import time

    import pytest
    import yaml

    from flows.algorithms.sft import sft
    from storage.lease import LeaseHeldError
    from tests.fixtures.grpo_runs import REPO, kill_run_actors, tiny_run_config

    root = str(tmp_path / "runs")
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({**tiny_run_config(tiny_model_dir, root, ray_session), "sft": {"max_num_steps": 100000}}))
    run_id = "busy-sft"
    code = f"from flows.algorithms.sft import sft; sft(config={str(path)!r}, run_id={run_id!r})"
    env = {**os.environ, "PREFECT_API_URL": prefect_harness}
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    status_path = os.path.join(root, run_id, "status.json")
    try:
        deadline = time.monotonic() + 180
        while holder.poll() is None and time.monotonic() < deadline:
            if os.path.exists(status_path) and json.load(open(status_path, encoding="utf-8")).get("status") == "running":
                break
            time.sleep(0.2)
        assert holder.poll() is None, holder.communicate()[0][-3000:]
        before = open(status_path, encoding="utf-8").read()
        with pytest.raises(LeaseHeldError, match=str(holder.pid)):
            sft(config=str(path), run_id=run_id, overrides=["sft.max_num_steps=1"])
        assert open(status_path, encoding="utf-8").read() == before  # the refused writer wrote nothing
        status = json.loads(before)
        assert status["algorithm"] == "sft" and status["flow_process"]["pid"] == holder.pid, status
    finally:
        holder.kill()
        holder.wait()
        kill_run_actors(run_id)
