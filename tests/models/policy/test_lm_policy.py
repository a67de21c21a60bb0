"""Policy on real Ray actors (tiny model, CPU, gloo): DP=2 vs DP=1, logprobs vs HF, reference,
checkpoints and bit-identical resume, attach from another process, refit producer, learning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch
from safetensors.torch import load_file

from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn, NLLLossFn
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster
from nrl_tasks.models.policy import PolicyConfig
from nrl_tasks.models.policy.interfaces import ColocatablePolicyInterface
from nrl_tasks.models.policy.lm_policy import Policy

from nrl_tasks.models.policy.workers import sharding

from nrl_tasks.models.policy.workers.in_process import in_process_worker

from .helpers import make_batch, policy_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
WIDTH = 24


def _config(model_dir: str, **overrides) -> PolicyConfig:
    return policy_config(model_dir, **overrides)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def namespace():
    return f"nrl-test-{uuid.uuid4().hex[:8]}"


def _start(ray_session, cfg, tokenizer, namespace, dp, prefix, tmp_path_factory):
    cluster = RayVirtualCluster([dp], name=f"{prefix}-{uuid.uuid4().hex[:6]}", num_cpus_per_bundle=0.5)
    policy = Policy(cluster, cfg, tokenizer, name_prefix=prefix, namespace=namespace)
    fresh = tmp_path_factory.mktemp(f"{prefix}-fresh")
    policy.save_checkpoint(str(fresh / "w"), str(fresh / "o"))
    return cluster, policy, (str(fresh / "w"), str(fresh / "o"))


@pytest.fixture(scope="module")
def policy2(ray_session, tiny_model_dir, tokenizer, namespace, tmp_path_factory):
    """DP=2 policy plus a checkpoint of its initial state (to reset between tests)."""
    cluster, policy, fresh = _start(ray_session, _config(tiny_model_dir), tokenizer, namespace, 2, "lm_policy", tmp_path_factory)
    yield policy, fresh
    policy.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def local_worker(tiny_model_dir):
    """The same policy as one rank in this process: the DP=1 reference run."""
    with in_process_worker(_config(tiny_model_dir)) as worker:
        yield worker


def _weights(policy, path) -> dict[str, torch.Tensor]:
    policy.save_checkpoint(str(path))
    return load_file(os.path.join(str(path), "model.safetensors"))


def _hf_logprobs(model_dir, batch, temperature):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    out = torch.zeros(ids.shape)
    with torch.no_grad():
        for i, n in enumerate(lengths.tolist()):
            logits = model(ids[i : i + 1, :n]).logits[0, :-1] / temperature
            out[i, 1:n] = torch.log_softmax(logits, -1).gather(-1, ids[i, 1:n, None]).squeeze(-1)
    return out


def test_dp2_training_matches_dp1(local_worker, policy2, tmp_path):
    """Same global batch, same initial state: DP=2 (two Ray actors, gloo all-reduce) and DP=1
    end with the same weights.

    Tolerance: the ranks sum losses and gradients in a different order, so results agree to
    float32 rounding, amplified a little by AdamW's normalisation: |dW| <= 2e-5 after two steps
    at lr 1e-3 (the weights moved by more than 5e-4).
    """
    p2, fresh2 = policy2
    p2.load_checkpoint(*fresh2)
    batch = make_batch(16, WIDTH, seed=1)
    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.01})
    (shard,) = sharding.shard_for_train(batch, 1, local_worker.cfg, batch_size=8)
    r1 = local_worker.train(shard, loss_fn, gbs=8, mbs=2)
    r2 = p2.train(batch, loss_fn)
    assert r2["num_global_batches"] == 2 and r2["num_microbatches"] == [[2, 2], [2, 2]]
    assert r2["num_valid_tokens"] == sum(r1["global_valid_toks"])
    for a, b in zip(r1["global_loss"], r2["losses"]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    for a, b in zip(r1["grad_norm"], r2["grad_norms"]):
        assert a == pytest.approx(b, rel=1e-4)
    w1 = {k: v.detach().clone() for k, v in local_worker.model.state_dict().items()}
    w2 = _weights(p2, tmp_path / "w2")
    w0 = load_file(os.path.join(fresh2[0], "model.safetensors"))
    moved = max(float((w1[k] - w0[k]).abs().max()) for k in w0)
    assert moved > 5e-4  # training really changed the weights
    for k in w2:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=2e-5, msg=k)
    assert p2.weights_version == local_worker.weights_version == 1


def test_logprobs_match_hf_forward_and_reference_stays(policy2, tiny_model_dir, tmp_path):
    policy, fresh = policy2
    policy.load_checkpoint(*fresh)
    batch = make_batch(7, WIDTH, seed=2, rl_keys=False)  # 7 rows: uneven shards over 2 ranks
    temperature = policy.cfg.temperature
    lp0 = policy.get_logprobs(batch)["logprobs"]
    torch.testing.assert_close(lp0, _hf_logprobs(tiny_model_dir, batch, temperature), rtol=0, atol=1e-5)
    ref0 = policy.get_reference_policy_logprobs(batch)["reference_logprobs"]
    torch.testing.assert_close(ref0, lp0, rtol=0, atol=0)

    policy.train(make_batch(8, WIDTH, seed=3), NLLLossFn())
    lp1 = policy.get_logprobs(batch)["logprobs"]
    ref1 = policy.get_reference_policy_logprobs(batch)["reference_logprobs"]
    assert torch.equal(ref1, ref0)  # the reference did not move
    assert float((lp1 - lp0).abs().max()) > 1e-3  # the policy did
    # and the live weights (not the reference) are what get_logprobs uses
    policy.save_checkpoint(str(tmp_path / "now"))
    torch.testing.assert_close(lp1, _hf_logprobs(str(tmp_path / "now"), batch, temperature), rtol=0, atol=1e-5)


def test_checkpoint_round_trip_and_bit_identical_resume(policy2, local_worker, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    policy, fresh = policy2
    policy.load_checkpoint(*fresh)
    assert policy.weights_version == 0
    batches = [make_batch(8, WIDTH, seed=10 + i) for i in range(4)]
    loss_fn = ClippedPGLossFn()
    for b in batches[:2]:
        policy.train(b, loss_fn)
    ckpt = tmp_path / "step2"
    policy.save_checkpoint(str(ckpt / "policy"), str(ckpt / "optimizer"), tokenizer_path=str(ckpt / "policy"))
    saved = load_file(str(ckpt / "policy" / "model.safetensors"))
    for b in batches[2:]:
        policy.train(b, loss_fn)
    uninterrupted = policy.weights_checksum(as_sent=False)
    assert policy.weights_version == 4

    # HF-loadable weights and tokenizer, no pickle anywhere
    model = AutoModelForCausalLM.from_pretrained(str(ckpt / "policy"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    files = [os.path.join(d, f) for d, _, fs in os.walk(ckpt) for f in fs]
    assert all(f.endswith((".safetensors", ".json", ".jinja")) for f in files), files
    doc = json.loads((ckpt / "optimizer" / "optimizer.json").read_text())
    assert doc["weights_version"] == 2 and doc["data_parallel_size"] == 2
    assert doc["scheduler"]["last_epoch"] == 2
    assert sorted(os.listdir(ckpt / "optimizer" / "rng")) == [
        "rank_00000.json", "rank_00000.safetensors", "rank_00001.json", "rank_00001.safetensors",
    ]

    # restore into the live actors and replay: bit-identical to never stopping
    policy.load_checkpoint(str(ckpt / "policy"), str(ckpt / "optimizer"))
    assert policy.weights_version == 2
    for b in batches[2:]:
        policy.train(b, loss_fn)
    assert policy.weights_checksum(as_sent=False) == uninterrupted
    assert policy.weights_version == 4

    with pytest.raises(ValueError, match="not a directory"):
        policy.load_checkpoint(str(tmp_path / "missing"))

    # a DP=1 worker restores the DP=2 checkpoint (weights and optimizer state gathered whole by rank 0)
    local_worker.load_checkpoint(str(ckpt / "policy"), str(ckpt / "optimizer"))
    assert local_worker.weights_version == 2
    for name, tensor in local_worker.model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    steps = {int(v["step"]) for v in local_worker.optimizer.state.values()}
    assert steps == {2}


def test_second_process_attaches_by_name(policy2, ray_session, tiny_model_dir, namespace):
    policy, _ = policy2
    batch = make_batch(5, WIDTH, seed=4, rl_keys=False)
    expected = policy.get_logprobs(batch)["logprobs"]
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {REPO!r})
        import ray
        from nrl_tasks.models.policy.lm_policy import Policy
        from tests.models.policy.helpers import make_batch
        ray.init(address={ray_session!r}, log_to_driver=False)
        policy = Policy.attach(None, None, namespace={namespace!r})  # no tokenizer needed to score
        lp = policy.get_logprobs(make_batch(5, {WIDTH}, seed=4, rl_keys=False))["logprobs"]
        print(json.dumps({{"dp": policy.data_parallel_size, "version": policy.weights_version, "lp": lp.tolist()}}))
        """
    )
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=env, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["dp"] == 2 and got["version"] == policy.weights_version
    assert torch.equal(torch.tensor(got["lp"]), expected)
    # the other driver is gone; the actors (and their weights) are not
    assert torch.equal(policy.get_logprobs(batch)["logprobs"], expected)

    attached = Policy.attach(policy.cfg, None, namespace=namespace)
    assert attached.weights_version == policy.weights_version
    with pytest.raises(ValueError, match="optimizer.kwargs.lr"):
        Policy.attach(_config(tiny_model_dir, optimizer={"kwargs": {"lr": 0.5}}), None, namespace=namespace)
    with pytest.raises(LookupError, match="lm_policy-0"):
        Policy.attach(None, None, namespace="nrl-no-such-run")


def test_refit_producer_streams_the_live_weights(policy2):
    """The test process plays a generation worker: rank 1 of the refit group."""
    import ray

    from nrl_tasks.utils.collective import create_broadcast_group, find_free_port
    from nrl_tasks.utils.packed_tensor import packed_broadcast_consumer
    from nrl_tasks.utils.refit import RefitInfo, weights_checksum

    policy, _ = policy2
    info = RefitInfo.from_dict(policy.prepare_refit_info())
    assert info.weights_version == policy.weights_version
    assert info.metadata[0][0] == "model.embed_tokens.weight"
    port = find_free_port()
    refs = policy.init_collective("127.0.0.1", port, 2, train_world_size=1)
    group = create_broadcast_group("127.0.0.1", port, 1, 2, timeout_s=60)
    try:
        assert ray.get(refs) == [True, False]  # only DP rank 0 joins
        received: list[tuple[str, torch.Tensor]] = []
        send = policy.broadcast_weights_for_collective()
        packed_broadcast_consumer(
            info.consumer_iter(), group, 0,
            lambda items: received.extend((n, t.clone()) for n, t in items),
            buffer_size_bytes=info.buffer_size_bytes,
        )
        ray.get(send)
    finally:
        group.close()
    assert [n for n, _ in received] == [n for n, _, _ in info.metadata]
    assert weights_checksum(received) == policy.weights_checksum()


def test_clipped_pg_learns_a_tiny_task(policy2):
    """PPO-style epochs on one batch (prev_logprobs fixed at the start): 'good' completions
    (advantage +1) gain probability, 'bad' ones (-1) lose it, and the clipped-PG loss falls from
    0 to its clip bound -(1.2 - 0.8) / 2 = -0.2 (every good ratio >= 1.2, every bad one <= 0.8)."""
    policy, fresh = policy2
    policy.load_checkpoint(*fresh)
    rows, width = 8, 12
    ids = torch.zeros(rows, width, dtype=torch.long)
    ids[:, :4] = torch.tensor([5, 6, 7, 8])
    ids[: rows // 2, 4:] = 40  # good completion
    ids[rows // 2 :, 4:] = 90  # bad completion
    batch = BatchedDataDict(
        {
            "input_ids": ids,
            "input_lengths": torch.full((rows,), width),
            "token_mask": (torch.arange(width) >= 4).float().expand(rows, width).contiguous(),
            "sample_mask": torch.ones(rows),
        }
    )
    lp0 = policy.get_logprobs(batch)["logprobs"]
    adv = torch.cat([torch.ones(rows // 2), -torch.ones(rows // 2)]).unsqueeze(1).expand(rows, width).contiguous()
    batch.update(advantages=adv, prev_logprobs=lp0, generation_logprobs=lp0, reference_policy_logprobs=lp0)
    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0})
    losses = [policy.train(batch, loss_fn)["loss"] for _ in range(6)]
    assert losses[0] == pytest.approx(0.0, abs=1e-6)  # ratio 1 and balanced advantages
    assert losses[1] < losses[0] and all(b <= a + 1e-6 for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] == pytest.approx(-0.2, abs=1e-4), losses
    lp = policy.get_logprobs(batch)["logprobs"]
    gain = (lp - lp0)[:, 5:].mean(dim=1)
    assert (gain[: rows // 2] > 0.1).all() and (gain[rows // 2 :] < -0.1).all(), gain


def test_topk_generate_and_lifecycle(policy2, tmp_path):
    policy, fresh = policy2
    policy.load_checkpoint(*fresh)
    batch = make_batch(3, 8, seed=6, rl_keys=False)
    lp = policy.get_logprobs(batch)["logprobs"]
    top = policy.get_topk_logits(batch, k=5)
    assert top["topk_logits"].shape == (3, 8, 5) and top["topk_indices"].shape == (3, 8, 5)
    assert (top["topk_logits"][:, :, :-1] >= top["topk_logits"][:, :, 1:]).all()

    out = policy.generate(BatchedDataDict({"input_ids": batch["input_ids"], "input_lengths": batch["input_lengths"]}), greedy=True)
    for key in ("output_ids", "logprobs", "generation_lengths", "unpadded_sequence_lengths", "truncated"):
        assert out[key].shape[0] == 3, key
    for i, n in enumerate(batch["input_lengths"].tolist()):
        assert torch.equal(out["output_ids"][i, :n], batch["input_ids"][i, :n])
    # generation logprobs follow get_logprobs' convention (same temperature, same positions)
    regen = BatchedDataDict({"input_ids": out["output_ids"], "input_lengths": out["unpadded_sequence_lengths"]})
    relp = policy.get_logprobs(regen)["logprobs"]
    gen_mask = out["logprobs"] != 0
    assert gen_mask.any()
    torch.testing.assert_close(relp[gen_mask], out["logprobs"][gen_mask], rtol=0, atol=1e-4)
    assert torch.equal(lp, policy.get_logprobs(batch)["logprobs"])

    assert isinstance(policy, ColocatablePolicyInterface)
    assert policy.prepare_for_generation() and policy.finish_generation() and policy.invalidate_kv_cache()
    policy.prepare_for_lp_inference()
    policy.prepare_for_training()
    policy.finish_training()
    policy.offload_before_refit()
    policy.offload_after_refit()
    policy.offload_to_cpu()
    policy.finish_inference()
    assert policy.finalize_async_save() is None
    assert policy.get_free_memory_bytes() > 0
    nodes = policy.print_node_ip_and_gpu_id()
    assert len(nodes) == 2 and all(gpu == -1 for _, gpu in nodes)
    policy.start_gpu_profiling()
    policy.get_logprobs(batch)
    traces = policy.stop_gpu_profiling()
    assert len(traces) == 2 and all(os.path.getsize(t) > 0 for t in traces)
    for t in traces:
        os.remove(t)

    shards, unsorted = policy._shard_for_logprob(batch)
    assert len(shards) == 2 and unsorted is None
    policy._report_sharded_payload(shards, "test")
    assert policy.last_sharded_payload["boundary"] == "test"
    assert sum(policy.last_sharded_payload["bytes_per_shard"]) > 0


def test_bad_calls_raise_clear_errors(policy2, tiny_model_dir, tokenizer, ray_session, tmp_path):
    policy, _ = policy2
    batch = make_batch(8, WIDTH, seed=7)
    with pytest.raises(ValueError, match="not a positive multiple of gbs 8"):
        policy.train(batch.slice(0, 6), NLLLossFn())
    with pytest.raises(ValueError, match="not a multiple of the data-parallel size 2"):
        policy.train(batch.slice(0, 3), NLLLossFn(), gbs=3)
    with pytest.raises(ValueError, match="not a multiple of mbs 3"):
        policy.train(batch, NLLLossFn(), mbs=3)
    with pytest.raises(ValueError, match="missing key 'input_lengths'"):
        policy.get_logprobs(BatchedDataDict({"input_ids": batch["input_ids"]}))
    with pytest.raises(ValueError, match="exceeds max_total_sequence_length 64"):
        policy.get_logprobs(make_batch(2, 80, seed=0, rl_keys=False))
    with pytest.raises(ValueError, match="reward_model_cfg.enabled"):
        policy.score(batch)
    with pytest.raises(ValueError, match="k must be a positive int"):
        policy.get_topk_logits(batch, 0)

    cluster = policy.cluster
    with pytest.raises(ValueError, match="not a local directory"):
        Policy(cluster, _config(str(tmp_path / "nope")), tokenizer, name_prefix="bad")
    with pytest.raises(ValueError, match=r"workers_per_node\[0\]=3"):
        Policy(cluster, _config(tiny_model_dir), tokenizer, name_prefix="bad", workers_per_node=3)
    with pytest.raises(ValueError, match="num_cpus_per_worker=4 does not fit"):
        Policy(cluster, _config(tiny_model_dir, num_cpus_per_worker=4), tokenizer, name_prefix="bad")
    with pytest.raises(ValueError, match="processor"):
        Policy(cluster, _config(tiny_model_dir), tokenizer, name_prefix="bad", processor=object())


def test_status_answers_during_a_long_call(policy2):
    """A second process re-attaching while the actors train must see them alive and busy."""
    import time

    import ray

    policy, _ = policy2
    big = make_batch(128, WIDTH, seed=40)
    refs = policy.worker_group.run_all_workers_sharded_data(
        "train", policy._shard_for_train(big, 8), NLLLossFn(), eval_mode=True, gbs=8, mbs=1
    )
    try:
        deadline, seen = time.monotonic() + 30, set()
        while time.monotonic() < deadline and not ray.wait(refs, num_returns=len(refs), timeout=0)[0]:
            seen |= {s["busy"] for s in policy.worker_status()}
            if "train" in seen:
                break
        assert "train" in seen
    finally:
        ray.get(refs)
    assert {s["busy"] for s in policy.worker_status()} == {None}
    assert policy.worker_group.alive(timeout_s=10)


def test_half_dead_policy_is_recreated(policy2, tokenizer, namespace, tiny_model_dir):
    """Runs last in this module: a killed rank makes the next ``Policy(...)`` with the same names
    kill the survivor and start both ranks afresh (initial weights, version 0)."""
    import ray

    policy, _ = policy2
    before = [s["pid"] for s in policy.run_all_workers_single_data("status")]
    policy.train(make_batch(8, WIDTH, seed=30), NLLLossFn())
    ray.kill(policy.worker_group.workers[1], no_restart=True)
    again = Policy(policy.cluster, policy.cfg, tokenizer, name_prefix="lm_policy", namespace=namespace)
    try:
        after = [s["pid"] for s in again.run_all_workers_single_data("status")]
        assert set(after).isdisjoint(before)
        assert again.weights_version == 0
        batch = make_batch(4, WIDTH, seed=31, rl_keys=False)
        torch.testing.assert_close(
            again.get_logprobs(batch)["logprobs"], _hf_logprobs(tiny_model_dir, batch, again.cfg.temperature),
            rtol=0, atol=1e-5,
        )
    finally:
        again.shutdown()
