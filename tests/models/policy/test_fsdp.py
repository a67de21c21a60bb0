"""Torch's FSDP2 on the policy workers (2 Ray ranks over gloo, tiny model): sharded
(``dtensor_cfg.enabled``) vs replicated vs one rank, the state each rank holds, the gathered
checkpoint loaded on one rank, sampling with sharded weights."""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch
from safetensors.torch import load_file

from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn
from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster
from nrl_tasks.models.policy import PolicyConfig
from nrl_tasks.models.policy.lm_policy import Policy
from nrl_tasks.models.policy.workers import sharding
from nrl_tasks.models.policy.workers.in_process import in_process_worker

from .helpers import make_batch, policy_config

WIDTH = 24


def _config(model_dir: str, **overrides) -> PolicyConfig:
    # one row per decode loop: a rank with more rows runs more forwards (see the sampling test)
    overrides.setdefault("generation", {"temperature": 0.8, "max_new_tokens": 6, "max_batch_size": 1})
    return policy_config(model_dir, **overrides)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _policy(cfg: PolicyConfig, tokenizer, prefix: str):
    cluster = RayVirtualCluster([2], name=f"{prefix}-{uuid.uuid4().hex[:6]}", num_cpus_per_bundle=0.5)
    policy = Policy(cluster, cfg, tokenizer, name_prefix=prefix, namespace=f"nrl-fsdp-{uuid.uuid4().hex[:6]}")
    return cluster, policy


@pytest.fixture(scope="module")
def sharded(ray_session, tiny_model_dir, tokenizer):
    cluster, policy = _policy(_config(tiny_model_dir), tokenizer, "fsdp-sharded")
    yield policy
    policy.shutdown()
    cluster.shutdown()


def _gradients(policy: Policy) -> dict[str, torch.Tensor]:
    return policy.run_all_workers_single_data("get_gradients")[0]  # a collective when sharded


def test_sharded_replicated_and_one_rank_agree_on_the_first_step(sharded, ray_session, tiny_model_dir, tokenizer):
    """Same batch, same initial weights: the first step's loss and gradients agree to float32
    rounding whether the 2 ranks shard the model, replicate it or one rank holds it all; the
    sharded ranks each hold about half the state."""
    batch = make_batch(8, WIDTH, seed=5)
    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.01})
    assert {s["parallel"] for s in sharded.worker_status()} == {"fsdp2-sharded"}
    assert sharded.layout.sharded
    r_shard = sharded.train(batch, loss_fn)
    g_shard = _gradients(sharded)

    cluster, replicated = _policy(_config(tiny_model_dir, dtensor_cfg={"enabled": False}), tokenizer, "fsdp-repl")
    try:
        assert {s["parallel"] for s in replicated.worker_status()} == {"fsdp2-replicated"}
        r_repl = replicated.train(batch, loss_fn)
        g_repl = _gradients(replicated)
    finally:
        replicated.shutdown()
        cluster.shutdown()

    with in_process_worker(_config(tiny_model_dir)) as one:
        assert one.status()["parallel"] == "single"
        (shard,) = sharding.shard_for_train(batch, 1, one.cfg, batch_size=8)
        r_one = one.train(shard, loss_fn, gbs=8, mbs=2)
        g_one = one.get_gradients()
        one_mb = one.state_mb()

    assert r_shard["loss"] == pytest.approx(r_one["global_loss"][0], rel=1e-6)
    assert r_repl["loss"] == pytest.approx(r_one["global_loss"][0], rel=1e-6)
    assert r_shard["grad_norm"] == pytest.approx(r_one["grad_norm"][0], rel=1e-5)
    assert r_repl["grad_norm"] == pytest.approx(r_one["grad_norm"][0], rel=1e-5)
    assert set(g_shard) == set(g_repl) == set(g_one) and len(g_one) > 10
    for name, g in g_one.items():
        assert float(g.abs().max()) > 0, name
        torch.testing.assert_close(g_shard[name], g, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(g_repl[name], g, rtol=1e-5, atol=1e-6, msg=name)

    # parameters + gradients + AdamW moments: a replicated rank holds all of it, a sharded one half
    assert r_repl["policy_state_mb_per_rank"] == pytest.approx(one_mb, rel=1e-9)
    assert r_shard["policy_state_mb_per_rank"] <= 0.6 * r_repl["policy_state_mb_per_rank"]
    assert r_shard["policy_state_mb_per_rank"] >= 0.45 * r_repl["policy_state_mb_per_rank"]


def test_sharded_checkpoint_is_hf_loadable_and_resumes_on_one_rank(sharded, tiny_model_dir, tmp_path):
    """The gathered checkpoint of 2 sharded ranks loads with ``from_pretrained`` and, optimizer
    included, into one rank: the weights bit for bit, the AdamW moments as saved; training then
    goes on alike to float32 rounding (the reduction order differs, so not bit for bit)."""
    from transformers import AutoModelForCausalLM

    loss_fn = ClippedPGLossFn()
    sharded.train(make_batch(8, WIDTH, seed=6), loss_fn)
    w, o = str(tmp_path / "policy"), str(tmp_path / "optimizer")
    sharded.save_checkpoint(w, o)
    checksum = sharded.weights_checksum(as_sent=False)
    saved = load_file(os.path.join(w, "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(w)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    doc = json.loads((tmp_path / "optimizer" / "optimizer.json").read_text())
    assert doc["data_parallel_size"] == 2 and doc["parallel"] == "fsdp2-sharded"
    moments = load_file(os.path.join(o, "optimizer.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    assert moments[f"state.{name}.exp_avg"].shape == saved[name].shape  # whole, not a shard

    nxt = make_batch(8, WIDTH, seed=7)
    with in_process_worker(_config(tiny_model_dir)) as one:
        one.load_checkpoint(w, o)
        assert one.weights_checksum(as_sent=False) == checksum
        assert one.weights_version == sharded.weights_version
        state = one.optimizer.state[dict(zip(one.param_names, one.params))[name]]
        assert torch.equal(state["exp_avg"], moments[f"state.{name}.exp_avg"])
        (shard,) = sharding.shard_for_train(nxt, 1, one.cfg, batch_size=8)
        r_one = one.train(shard, loss_fn, gbs=8, mbs=2)
    r_two = sharded.train(nxt, loss_fn)
    assert r_two["loss"] == pytest.approx(r_one["global_loss"][0], rel=1e-5)


def test_sampling_with_sharded_weights_matches_one_rank(sharded, tiny_model_dir, tmp_path):
    """``Policy.generate`` gathers the weights once per call, so ranks may run different numbers
    of forwards (here 3 decode loops on one rank, 2 on the other); greedy outputs equal a one-rank
    policy's with the same weights."""
    w = str(tmp_path / "now")
    sharded.save_checkpoint(w)
    batch = make_batch(5, 8, seed=8, rl_keys=False, min_len=2)  # 3 rows on rank 0, 2 on rank 1
    out = sharded.generate(batch, greedy=True)
    with in_process_worker(_config(tiny_model_dir)) as one:
        one.load_checkpoint(w)
        ref = one.generate(batch, greedy=True)
    assert torch.equal(out["generation_lengths"], ref["generation_lengths"])
    ends = (batch["input_lengths"] + ref["generation_lengths"]).tolist()
    for row, end in enumerate(ends):  # the padding differs (the Ray policy has a tokenizer)
        assert torch.equal(out["output_ids"][row, :end], ref["output_ids"][row, :end]), row
    # the weights are sharded again afterwards: training still works
    sharded.train(make_batch(8, WIDTH, seed=9), ClippedPGLossFn())


def test_lora_with_sharded_weights(ray_session, tiny_model_dir, tokenizer, tmp_path):
    """LoRA under sharding: adapters train, the adapter and merged checkpoints are whole (the
    merge gathered by every rank) and load on one rank with the same adapters-only checksum, and
    load back into the sharded ranks."""
    from transformers import AutoModelForCausalLM

    lora = {"enabled": True, "dim": 4, "alpha": 8.0, "save_merged": True}
    cfg = _config(tiny_model_dir, dtensor_cfg={"lora_cfg": lora})
    cluster, policy = _policy(cfg, tokenizer, "fsdp-lora")
    try:
        assert policy.layout.sharded
        r = policy.train(make_batch(8, WIDTH, seed=11), ClippedPGLossFn())
        assert r["grad_norm"] > 0
        checksum = policy.weights_checksum()
        w, o = str(tmp_path / "policy"), str(tmp_path / "optimizer")
        policy.save_checkpoint(w, o)
        with in_process_worker(cfg) as one:
            one.load_checkpoint(w, o)
            assert one.weights_checksum() == checksum
            from nrl_tasks.models.policy.workers.lora import merged_state

            expected = merged_state(one.model)
        merged = AutoModelForCausalLM.from_pretrained(w + "_merged").state_dict()
        for name, tensor in expected.items():
            torch.testing.assert_close(merged[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
        policy.train(make_batch(8, WIDTH, seed=12), ClippedPGLossFn())
        assert policy.weights_checksum() != checksum
        policy.load_checkpoint(w, o)
        assert policy.weights_checksum() == checksum
    finally:
        policy.shutdown()
        cluster.shutdown()
