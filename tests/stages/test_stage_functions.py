"""The pure parts of the stages (no Ray): rollout assembly, advantages, train input, eval summary,
checkpoint commit protocol, metrics lines."""

from __future__ import annotations


import json
import types

import pytest
import torch

from nrl_tasks.config.grpo import GRPOConfig
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict


class _Tok:
    """Decodes ids as letters (a far-side stand-in for a tokenizer)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + (i % 26)) for i in ids)


def _prompt_batch():
    return BatchedDataDict(
        {
            "input_ids": torch.tensor([[5, 6, 0], [7, 0, 0]]),
            "input_lengths": torch.tensor([2, 1]),
            "group_id": torch.tensor([0, 0]),
            "record_index": torch.tensor([3, 3]),
            "seeds": torch.tensor([11, 12]),
            "prompt": ["p", "p"],
            "answer": ["x", "x"],
        }
    )


def test_rollouts_from_generation_masks_response_tokens():
    from nrl_tasks.stages.generate import rollouts_from_generation

    gen = {
        "output_ids": torch.tensor([[5, 6, 1, 2, 0], [7, 3, 0, 0, 0]]),
        "logprobs": torch.tensor([[0, 0, -0.5, -0.25, 0], [0, -1.0, 0, 0, 0]]),
        "generation_lengths": torch.tensor([2, 1]),
        "unpadded_sequence_lengths": torch.tensor([4, 2]),
        "truncated": torch.tensor([False, True]),
    }
    r = rollouts_from_generation(_prompt_batch(), gen, _Tok())
    assert r["token_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 1, 0, 0, 0]]
    assert r["input_lengths"].tolist() == [4, 2] and r["prompt_lengths"].tolist() == [2, 1]
    assert r["response"] == ["bc", "d"]
    assert torch.equal(r["generation_logprobs"], gen["logprobs"].float() * r["token_mask"])
    assert r["seeds"].tolist() == [11, 12] and r["truncated"].tolist() == [False, True]


def test_prompt_batch_repeats_groups_and_seeds_per_sample(tiny_model_dir):
    from transformers import AutoTokenizer

    from nrl_tasks.stages.generate import build_prompt_batch, sample_seeds

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    data_cfg = types.SimpleNamespace(shuffle=True, prompt_template="{prompt}", chat_template=False, system_prompt=None, overlong_prompts="reject")
    recs = [{"prompt": f"What is {i}+1? Answer:", "answer": str(i + 1)} for i in range(10)]
    b = build_prompt_batch(recs, step=2, num_prompts=3, num_generations=4, seed=5, data_cfg=data_cfg, tokenizer=tok, max_prompt_tokens=32)
    assert b.size == 12 and b["group_id"].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert len(set(b["record_index"].tolist())) == 3
    assert b["seeds"].tolist() == sample_seeds(5, 2, "generate", 12).tolist()
    again = build_prompt_batch(recs, step=2, num_prompts=3, num_generations=4, seed=5, data_cfg=data_cfg, tokenizer=tok, max_prompt_tokens=32)
    assert torch.equal(again["input_ids"], b["input_ids"])


def test_advantages_and_train_input():
    from nrl_tasks.stages.advantages import compute_advantages
    from nrl_tasks.stages.train import build_train_data

    grpo = GRPOConfig(use_leave_one_out_baseline=True, normalize_rewards=True)
    adv = compute_advantages(torch.tensor([0, 0, 0, 0]), torch.tensor([1.0, 0, 0, 0]), torch.tensor([True, True, True, False]), grpo)
    a = adv["advantages"].tolist()
    assert a[3] == 0.0 and a[0] > 0 > a[1] and a[1] == pytest.approx(a[2])
    assert adv["sample_mask"].tolist() == [1.0, 1.0, 1.0, 0.0]
    rollouts = BatchedDataDict(
        {
            "input_ids": torch.zeros(4, 3, dtype=torch.int64),
            "input_lengths": torch.full((4,), 3),
            "token_mask": torch.tensor([[0, 1, 1]] * 4, dtype=torch.float32),
            "generation_logprobs": torch.zeros(4, 3),
        }
    )
    lp = BatchedDataDict({"prev_logprobs": torch.zeros(4, 3), "reference_policy_logprobs": torch.zeros(4, 3)})
    data = build_train_data(rollouts, lp, adv)
    assert data["advantages"].shape == (4, 3)
    assert data["advantages"][0].tolist() == [0.0, pytest.approx(a[0]), pytest.approx(a[0])]
    assert set(data.keys()) >= {"input_ids", "input_lengths", "token_mask", "sample_mask", "prev_logprobs",
                                "generation_logprobs", "reference_policy_logprobs"}


def test_summarize_eval_pass_at_k():
    from nrl_tasks.stages.evaluate import summarize_eval

    s = BatchedDataDict(
        {
            "mode": ["greedy", "greedy", "sample", "sample", "sample", "sample"],
            "record_index": torch.tensor([0, 1, 0, 0, 1, 1]),
            "reward": torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0]),
            "reward_valid": torch.tensor([True, True, True, True, True, True]),
        }
    )
    out = summarize_eval(s)
    assert out == {"accuracy": 0.5, "num_prompts": 2, "pass_at_k": 0.5, "k": 2, "sample_reward_mean": 0.25}


def test_checkpoint_commit_protocol(tmp_path):
    """A checkpoint exists for readers only once checkpoint.json is in place (tmp dir renamed)."""
    import os

    from nrl_tasks.stages.checkpoint import latest_checkpoint, list_checkpoints, save_checkpoint

    class FakePolicy:  # the far side of the interface: writes files like Policy.save_checkpoint
        def save_checkpoint(self, weights_path, optimizer_path=None, tokenizer_path=None):
            for p in {weights_path, optimizer_path, tokenizer_path} - {None}:
                os.makedirs(p, exist_ok=True)
                (open(os.path.join(p, "x.safetensors"), "wb")).write(b"w")

    root = tmp_path / "checkpoints"
    save_checkpoint(FakePolicy(), str(root / "step_000002"), {"step": 2, "weights_version": 2})
    os.makedirs(root / "step_000004")  # half-written leftover without checkpoint.json
    os.makedirs(root / ".tmp-step_000005-abc")
    assert list_checkpoints(str(root)) == [(2, str(root / "step_000002"))]
    assert latest_checkpoint(str(root), max_step=1) is None
    info = json.loads((root / "step_000002" / "checkpoint.json").read_text())
    assert info["step"] == 2 and os.path.isfile(root / "step_000002" / "weights" / "x.safetensors")
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-step_000002")]


def test_s3_checkpoint_commit_protocol(moto_s3, monkeypatch):
    """On S3 the policy uploads its dirs itself (here a far-side stand-in that writes objects like
    the workers do) with the options this process resolved, credentials from the AWS environment
    included; ``checkpoint.json`` comes last, a failed save commits nothing, and a save over an
    old prefix uncommits and clears it first."""
    import storage.fs as sfs
    from nrl_tasks.stages.checkpoint import is_checkpoint_committed, list_checkpoints, restore_checkpoint, save_checkpoint

    run_opts = {"endpoint_url": moto_s3.endpoint_url}  # what a run config holds: no credentials
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto_s3.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_s3.secret)
    root = f"{moto_s3.make_bucket()}/checkpoints"
    calls = []

    class FakeS3Policy:
        fail = False

        def save_checkpoint(self, weights_path, optimizer_path=None, tokenizer_path=None, *, storage_options=None):
            calls.append(("save", weights_path, optimizer_path, tokenizer_path, storage_options))
            assert not is_checkpoint_committed(weights_path.rsplit("/", 1)[0], run_opts)  # commit comes after
            sfs.write_bytes_atomic(f"{weights_path}/model.safetensors", b"w", storage_options=storage_options)
            if self.fail:
                raise RuntimeError("worker died mid-upload")
            sfs.write_bytes_atomic(f"{optimizer_path}/optimizer.json", b"{}", storage_options=storage_options)

        def load_checkpoint(self, weights_path, optimizer_path=None, *, storage_options=None):
            calls.append(("load", weights_path, optimizer_path, storage_options))

        def set_weights_version(self, v):
            calls.append(("version", v))

    uri = f"{root}/step_000002"
    sfs.write_bytes_atomic(f"{uri}/weights/stale.bin", b"old", storage_options=run_opts)  # uncommitted leftover
    save_checkpoint(FakeS3Policy(), uri, {"step": 2, "weights_version": 2}, storage_options=run_opts)
    _, w, o, t, opts = calls[0]
    assert (w, o, t) == (f"{uri}/weights", f"{uri}/optimizer", f"{uri}/weights")
    assert opts["key"] == moto_s3.key and opts["secret"] == moto_s3.secret  # resolved here, sent to the workers
    assert sorted(sfs.walk_files(uri, run_opts)) == ["checkpoint.json", "optimizer/optimizer.json", "weights/model.safetensors"]
    assert list_checkpoints(root, run_opts) == [(2, uri)]

    info = restore_checkpoint(FakeS3Policy(), uri, run_opts)
    assert info["step"] == 2 and calls[1][:3] == ("load", f"{uri}/weights", f"{uri}/optimizer")
    assert calls[1][3]["secret"] == moto_s3.secret and calls[2] == ("version", 2)

    bad = FakeS3Policy()
    bad.fail = True
    with pytest.raises(RuntimeError, match="mid-upload"):
        save_checkpoint(bad, uri, {"step": 2, "weights_version": 2}, storage_options=run_opts)  # over the committed one
    assert list_checkpoints(root, run_opts) == []  # uncommitted before anything was rewritten
    assert sfs.walk_files(uri, run_opts) == ["weights/model.safetensors"]


def test_metrics_upsert_one_line_per_step(tmp_path):
    from flows.observe.metrics import build_step_metrics, format_console_line, read_metrics, upsert_metrics

    uri = str(tmp_path / "metrics.jsonl")
    m = {"rewards": {"reward_mean": 0.5, "seconds": 0.1}, "train": {"loss": 0.2, "grad_norm": 1.0, "seconds": 0.3},
         "rollouts": {"seconds": 0.4, "tokens_per_s": 100.0}}
    for step in (1, 2, 1, 3, 2):
        upsert_metrics(uri, build_step_metrics(step, m, refit={"seconds": 0.05}), None)
    rows = read_metrics(uri)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    assert rows[0]["stages_s"] == pytest.approx(0.1 + 0.3 + 0.4 + 0.05)
    line = format_console_line("r", rows[0], 3)
    assert "step 1/3" in line and "reward 0.500" in line and "refit 0.05s" in line
