"""PolicyWorker in this process (one rank, gloo): plain micro-batches, dynamic batching and
sequence packing give the same losses and gradients; errors name the problem."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn, NLLLossFn
from nrl_tasks.models.policy import PolicyConfig
from nrl_tasks.models.policy.workers import sharding

from nrl_tasks.models.policy.workers.in_process import in_process_worker

from .helpers import make_batch

ROWS, WIDTH, GBS = 16, 32, 8


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    cfg = PolicyConfig(
        model_name=tiny_model_dir,
        train_global_batch_size=GBS,
        train_micro_batch_size=4,
        max_grad_norm=None,
        optimizer={"kwargs": {"lr": 1e-3}},
        generation={"temperature": 0.8},
    )
    with in_process_worker(cfg) as w:
        yield w


def _shard(batch, mode):
    if mode == "plain":
        return batch.shard_by_batch_size(1, batch_size=GBS)[0]
    if mode == "dynamic":
        cfg = {"max_tokens_per_microbatch": 64, "sequence_length_round": 8, "input_key": "input_ids",
               "input_lengths_key": "input_lengths"}
        shards, _ = batch.shard_by_batch_size(1, batch_size=GBS, dynamic_batching_cfg=cfg)
        return shards[0]
    cfg = {"max_tokens_per_microbatch": 80, "input_key": "input_ids", "input_lengths_key": "input_lengths",
           "algorithm": "modified_first_fit_decreasing", "sequence_length_pad_multiple": 4}
    shards, _ = batch.shard_by_batch_size(1, batch_size=GBS, sequence_packing_cfg=cfg)
    return shards[0]


@pytest.mark.parametrize("loss_fn", [NLLLossFn(), ClippedPGLossFn({"reference_policy_kl_penalty": 0.05})], ids=["nll", "clipped_pg"])
def test_dynamic_batching_and_packing_match_plain(worker, loss_fn):
    batch = make_batch(ROWS, WIDTH, seed=11)
    initial = {k: v.clone() for k, v in worker.model.state_dict().items()}
    opt_state, sched_state = copy.deepcopy(worker.optimizer.state_dict()), worker.scheduler.state_dict()
    results, grads = {}, {}
    for mode in ("plain", "dynamic", "packing"):
        worker.model.load_state_dict(initial)
        worker.optimizer.load_state_dict(copy.deepcopy(opt_state))
        worker.scheduler.load_state_dict(sched_state)
        shard = _shard(batch, mode)
        results[mode] = worker.train(shard, loss_fn, gbs=GBS, mbs=4)
        grads[mode] = worker.get_gradients()
    worker.model.load_state_dict(initial)
    assert results["plain"]["num_microbatches"] == [2, 2]
    assert results["packing"]["num_microbatches"] != [GBS, GBS]  # rows really were packed together
    for mode in ("dynamic", "packing"):
        # same global losses (each the sum of its micro-batch losses), to float32 rounding
        np.testing.assert_allclose(results[mode]["global_loss"], results["plain"]["global_loss"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(results[mode]["grad_norm"], results["plain"]["grad_norm"], rtol=1e-4)
        assert results[mode]["global_valid_toks"] == results["plain"]["global_valid_toks"]
        for name, g in grads["plain"].items():
            torch.testing.assert_close(grads[mode][name], g, rtol=1e-4, atol=1e-6, msg=f"{mode}: {name}")


@pytest.mark.parametrize(
    "mode",
    [
        {"dynamic_batching": {"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 96, "sequence_length_round": 8}},
        {"sequence_packing": {"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 96, "sequence_length_pad_multiple": 4}},
    ],
    ids=["dynamic", "packing"],
)
def test_logprob_sharding_over_two_ranks_restores_row_order(worker, mode):
    """What ``Policy.get_logprobs`` does with DP=2, the two shards run one after the other here."""
    cfg = PolicyConfig.model_validate({**worker.cfg.model_dump(mode="json"), **mode})
    batch = make_batch(12, WIDTH, seed=21, min_len=2, rl_keys=False)
    shards, unsorted = sharding.shard_for_logprob(batch, 2, cfg)
    assert len(shards) == 2 and unsorted is not None and unsorted != list(range(12))
    merged = sharding.merge_results([worker.get_logprobs(s) for s in shards], unsorted)
    torch.testing.assert_close(merged["logprobs"], worker.get_logprobs(batch)["logprobs"], rtol=0, atol=1e-5)
    train_shards = sharding.shard_for_train(make_batch(16, WIDTH, seed=22), 2, cfg, batch_size=8)
    kind = "dynamic" if cfg.dynamic_batching.enabled else "packing"
    assert [s.micro_batch_kind for s in train_shards] == [kind, kind]
    assert len(train_shards[0].micro_batch_indices[0]) == len(train_shards[1].micro_batch_indices[0])  # lock-step


def test_eval_mode_does_not_step(worker):
    batch = make_batch(GBS, WIDTH, seed=2)
    before = {k: v.clone() for k, v in worker.model.state_dict().items()}
    version = worker.weights_version
    out = worker.train(_shard(batch, "plain"), NLLLossFn(), eval_mode=True, gbs=GBS)
    assert out["grad_norm"] == [0.0] and out["global_loss"][0] > 0
    assert worker.weights_version == version
    for k, v in worker.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_worker_errors(worker):
    batch = make_batch(GBS, WIDTH, seed=2)
    with pytest.raises(ValueError, match="not a multiple of the local batch 3"):
        worker.train(batch, NLLLossFn(), gbs=3)
    with pytest.raises(ValueError, match="missing key 'input_lengths'"):
        worker.get_logprobs(type(batch)({"input_ids": batch["input_ids"]}))
    with pytest.raises(ValueError, match="reward_model_cfg.enabled"):
        worker.score(batch)
    assert worker.get_logprobs(batch.slice(0, 0))["logprobs"].shape == (0, WIDTH)
    with pytest.raises(ValueError, match="kv_scales"):
        worker.broadcast_weights_for_collective(kv_scales={"a": 1.0})
    with pytest.raises(ValueError, match="train_world_size must be a positive int"):
        worker.init_collective("127.0.0.1", 1, 2, train_world_size=0)
