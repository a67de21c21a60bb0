"""The finite-value guard of ``PolicyWorker.train`` (issue 14): a non-finite loss, grad_norm or
learning rate fails the call before ``optimizer.step()`` with weights and optimizer state
bit-identical; a parameter made non-finite by the step fails it and marks the weights invalid
until a checkpoint is loaded. In this process (one rank) and on real Ray actors (DP=2)."""

from __future__ import annotations

import copy
import math
import time
import uuid

import pytest
import torch

from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn
from nrl_tasks.models.policy import PolicyConfig
from nrl_tasks.models.policy.errors import NonFiniteTrainingError

from nrl_tasks.models.policy.workers.in_process import in_process_worker

from .helpers import make_batch

ROWS, WIDTH, GBS, MBS = 8, 24, 8, 4
LOSS = ClippedPGLossFn({"reference_policy_kl_penalty": 0.05})


def _config(model_dir: str, **overrides) -> PolicyConfig:
    base = dict(
        model_name=model_dir,
        train_global_batch_size=GBS,
        train_micro_batch_size=MBS,
        max_grad_norm=1.0,
        optimizer={"kwargs": {"lr": 1e-3, "weight_decay": 0.01}},
        num_cpus_per_worker=0.5,
    )
    base.update(overrides)
    return PolicyConfig(**base)


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    with in_process_worker(_config(tiny_model_dir)) as w:
        w.train(make_batch(ROWS, WIDTH, seed=1), LOSS, gbs=GBS, mbs=MBS)  # optimizer state is not empty
        yield w


def _snapshot(w) -> dict:
    return {
        "model": {k: v.detach().clone() for k, v in w.model.state_dict().items()},
        "optimizer": copy.deepcopy(w.optimizer.state_dict()),
        "scheduler": copy.deepcopy(w.scheduler.state_dict()),
        "version": w.weights_version,
    }


def _assert_same(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{path} changed"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), f"{path}: {a!r} != {b!r}"


def test_inf_lr_fails_before_the_step_and_changes_nothing(worker):
    batch = make_batch(ROWS, WIDTH, seed=2)
    before = _snapshot(worker)
    lrs = [g["lr"] for g in worker.optimizer.param_groups]
    try:
        for g in worker.optimizer.param_groups:
            g["lr"] = float("inf")
        with pytest.raises(NonFiniteTrainingError, match="non-finite learning rate") as info:
            worker.train(batch, LOSS, gbs=GBS, mbs=MBS)
        for g, lr in zip(worker.optimizer.param_groups, lrs):
            assert g["lr"] == float("inf")
            g["lr"] = lr
    finally:
        for g, lr in zip(worker.optimizer.param_groups, lrs):
            g["lr"] = lr
    err = info.value
    assert (err.what, err.weights_valid, err.weights_version, err.global_batch) == ("lr", True, before["version"] + 1, 0)
    assert "unchanged" in str(err)
    _assert_same(_snapshot(worker), before)
    assert worker.status()["weights_valid"]
    out = worker.train(batch, LOSS, gbs=GBS, mbs=MBS)  # still usable
    assert worker.weights_version == before["version"] + 1 and math.isfinite(out["grad_norm"][0])


def test_nan_advantage_fails_before_the_step_and_changes_nothing(worker):
    batch = make_batch(ROWS, WIDTH, seed=3)
    batch["advantages"][5, 2] = float("nan")  # row 5: second micro-batch of 4 rows
    before = _snapshot(worker)
    with pytest.raises(NonFiniteTrainingError, match="non-finite loss") as info:
        worker.train(batch, LOSS, gbs=GBS, mbs=MBS)
    err = info.value
    assert (err.what, err.microbatch, err.global_batch, err.weights_valid) == ("loss", 1, 0, True)
    assert "micro-batch 1" in str(err) and f"weights version {before['version'] + 1}" in str(err)
    _assert_same(_snapshot(worker), before)
    assert worker.get_gradients() == {}  # the partial gradients were dropped


def test_huge_advantages_give_a_non_finite_grad_norm_before_the_step(worker):
    """What a reward of 1e30 does (an unnormalised advantage of 1e30): the norm overflows."""
    batch = make_batch(ROWS, WIDTH, seed=4)
    batch["advantages"] = batch["advantages"] * 1e30
    before = _snapshot(worker)
    with pytest.raises(NonFiniteTrainingError, match="non-finite grad_norm") as info:
        worker.train(batch, LOSS, gbs=GBS, mbs=MBS)
    assert (info.value.what, info.value.weights_valid) == ("grad_norm", True)
    assert math.isinf(info.value.value)
    _assert_same(_snapshot(worker), before)


def test_a_failure_after_an_earlier_step_of_the_call_marks_the_weights_invalid(worker, tmp_path):
    good = _snapshot(worker)
    worker.save_checkpoint(str(tmp_path / "w"), str(tmp_path / "o"), None, [worker.get_rng_state()])
    batch = make_batch(2 * GBS, WIDTH, seed=5)
    batch["advantages"][GBS + 1, 2] = float("nan")  # second global batch
    with pytest.raises(NonFiniteTrainingError, match="partial") as info:
        worker.train(batch, LOSS, gbs=GBS, mbs=MBS)
    assert (info.value.what, info.value.global_batch, info.value.weights_valid) == ("loss", 1, False)
    assert worker.weights_version == good["version"]  # the version did not move
    assert not worker.status()["weights_valid"]
    worker.load_checkpoint(str(tmp_path / "w"), str(tmp_path / "o"))
    assert worker.status()["weights_valid"]
    _assert_same(_snapshot(worker)["model"], good["model"])


@pytest.mark.parametrize(
    "lr, weight_decay, what",
    [(1e39, 0.01, "update"), (3.3e37, 10.0, "parameter")],
    ids=["step_size_beyond_float32", "parameter_overflows"],
)
def test_overflowing_update_raises_and_the_weights_are_refused_until_restored(worker, tmp_path, lr, weight_decay, what):
    """A finite but huge lr: 1e39 (float64) is a step size torch refuses half-way through the
    step; 3.3e37 with weight decay 10 makes the norm weights (1.0) overflow to inf. Both are
    caught in/after the step: the weights are then refused until a checkpoint is loaded."""
    w = worker
    w.save_checkpoint(str(tmp_path / "w"), str(tmp_path / "o"), None, [w.get_rng_state()])
    good = _snapshot(w)
    groups = [(g["lr"], g["weight_decay"]) for g in w.optimizer.param_groups]
    for g in w.optimizer.param_groups:
        g["lr"], g["weight_decay"] = lr, weight_decay
    batch = make_batch(ROWS, WIDTH, seed=6)
    with pytest.raises(NonFiniteTrainingError, match="no longer valid") as info:
        w.train(batch, LOSS, gbs=GBS, mbs=MBS)
    err = info.value
    assert err.what == what and not err.weights_valid
    if what == "parameter":
        assert err.parameter in w.param_names and err.parameter in str(err)
    assert w.weights_version == good["version"] and not w.status()["weights_valid"]
    for call in (
        lambda: w.train(batch, LOSS, gbs=GBS, mbs=MBS),
        lambda: w.get_logprobs(batch),
        lambda: w.weights_checksum(),
        lambda: w.save_checkpoint(str(tmp_path / "w2"), None, None, []),
    ):
        with pytest.raises(NonFiniteTrainingError, match="weights are invalid") as refused:
            call()
        assert refused.value.what == "invalid_weights" and not refused.value.weights_valid
    assert not (tmp_path / "w2").exists()  # nothing non-finite was written
    w.load_checkpoint(str(tmp_path / "w"), str(tmp_path / "o"))
    assert w.status()["weights_valid"]
    assert [(g["lr"], g["weight_decay"]) for g in w.optimizer.param_groups] == groups
    _assert_same(_snapshot(w), good)
    assert torch.isfinite(w.get_logprobs(batch)["logprobs"]).all()


def test_ray_policy_dp2_both_ranks_fail_alike_and_stay_usable(ray_session, tiny_model_dir):
    """Real actors: NaN only in rank 1's shard; both ranks refuse the step (no rank left in a
    collective), the error arrives through Ray as a RayTaskError that is a
    NonFiniteTrainingError, is not an actor fault, and the policy trains on afterwards."""
    import ray.exceptions as rx

    from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster
    from nrl_tasks.models.policy.lm_policy import Policy
    from nrl_tasks.stages.errors import is_actor_fault, policy_weights_invalid

    tag = uuid.uuid4().hex[:6]
    cluster = RayVirtualCluster([2], name=f"nonfinite-{tag}", num_cpus_per_bundle=0.5)
    policy = Policy(cluster, _config(tiny_model_dir, dist_timeout_s=60), None, name_prefix=f"nonfinite-{tag}",
                    namespace=f"nrl-test-{tag}")
    try:
        batch = make_batch(ROWS, WIDTH, seed=7)
        checksum = policy.weights_checksum()
        batch["advantages"][ROWS - 1, 2] = float("nan")  # the last row: rank 1's shard
        with pytest.raises(NonFiniteTrainingError) as info:
            policy.train(batch, LOSS, gbs=GBS, mbs=MBS // 2)
        err = info.value
        assert isinstance(err, rx.RayTaskError) and isinstance(err.cause, NonFiniteTrainingError)
        assert err.what == "loss" and err.weights_valid
        assert not is_actor_fault(err) and not policy_weights_invalid(err)
        assert policy.weights_checksum() == checksum and policy.weights_version == 0
        deadline = time.monotonic() + 60  # the call returns at the first rank's error; the other may still unwind
        while any(s["busy"] is not None for s in policy.worker_status()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(s["weights_valid"] and s["busy"] is None for s in policy.worker_status())
        batch["advantages"][ROWS - 1, 2] = 0.0
        out = policy.train(batch, LOSS, gbs=GBS, mbs=MBS // 2)
        assert policy.weights_version == 1 and math.isfinite(out["grad_norm"])
    finally:
        policy.shutdown()
        cluster.shutdown()
