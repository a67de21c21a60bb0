"""DAPO's dynamic sampling through the real flow (tiny model, 3 steps, 4 prompts x 4 samples).

The reward is the parity of the response's length, so some groups of four agree (zero variance)
and some steps need a second generation batch. Checked: every step trains on exactly 4 groups
whose rewards differ, each row taken bit for bit from one of the step's generation batches, the
metrics line counts the generation batches; the flow SIGKILLed while the sampler commits and
resumed ends bit-identical to the uninterrupted run; a reward that never varies fails the step
after ``grpo.dynamic_sampling_max_gen_batches`` batches with an error naming the keys.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

import pytest
import torch
import yaml

from tests.faults.helpers import run_nrl, train_checksum
from tests.fixtures.grpo_runs import kill_run_actors, tiny_run_config

RUN_ID = "dapo-ds"
STEPS = (1, 2, 3)
OVERRIDES = {
    "grpo.use_dynamic_sampling": True,
    "grpo.dynamic_sampling_max_gen_batches": 6,
    "loss_fn.ratio_clip_max": 0.28,  # DAPO's clip-higher, as a DAPO config would set it
    "env.reward_fn": "tests.flows.test_dynamic_sampling:parity_reward",
}


def parity_reward(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    return [float(len(r) % 2) for r in responses]


def zero_reward(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    return [0.0 for _ in responses]


def _step_dir(root: str, run_id: str, step: int) -> str:
    return os.path.join(root, run_id, "steps", f"step_{step:06d}")


@pytest.fixture(scope="module")
def ds_run(prefect_harness, ray_session, tiny_model_dir, tmp_path_factory):
    from flows.algorithms.grpo import grpo

    root = str(tmp_path_factory.mktemp("dapo"))
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **OVERRIDES)
    try:
        out = grpo(config=cfg, run_id=RUN_ID)
    finally:
        kill_run_actors(RUN_ID)
    return {"root": root, "cfg": cfg, "out": out}


def test_each_step_trains_on_groups_with_reward_variance_from_its_generation_batches(ds_run):
    import storage
    from flows.observe.metrics import read_metrics

    root = ds_run["root"]
    rows = {r["step"]: r for r in read_metrics(os.path.join(root, RUN_ID, "metrics.jsonl"))}
    assert sorted(rows) == list(STEPS)
    batches_used = []
    for s in STEPS:
        d = _step_dir(root, RUN_ID, s)
        ro, rw = storage.load_batch(os.path.join(d, "rollouts")), storage.load_batch(os.path.join(d, "rewards"))
        pr = storage.load_batch(os.path.join(d, "prompts"))
        assert ro.size == rw.size == pr.size == 16
        assert torch.equal(ro["group_id"], torch.arange(4).repeat_interleave(4))
        assert torch.equal(pr["seeds"], ro["seeds"])
        for g in range(4):
            r = rw["rewards"][ro["group_id"] == g]
            assert r.max() > r.min(), (s, g, r)
        gen_dirs = sorted(os.listdir(os.path.join(d, "gen_batches")))
        batches_used.append(len(gen_dirs))
        assert rows[s]["dynamic_sampling_num_gen_batches"] == len(gen_dirs), (s, rows[s])
        # every sampled row is a generated row, bit for bit (the seeds are unique per row)
        gen = [storage.load_batch(os.path.join(d, "gen_batches", g, "rollouts")) for g in gen_dirs]
        gen_rw = [storage.load_batch(os.path.join(d, "gen_batches", g, "rewards")) for g in gen_dirs]
        by_seed = {int(b["seeds"][i]): (b, w, i) for b, w in zip(gen, gen_rw) for i in range(b.size)}
        zero_std = 0
        for b, w in zip(gen, gen_rw):
            for g in torch.unique(b["group_id"]).tolist():
                r = w["rewards"][b["group_id"] == g]
                zero_std += int(r.max() == r.min())
        assert rows[s]["dynamic_sampling_zero_std_groups"] == zero_std
        for i in range(ro.size):
            b, w, j = by_seed[int(ro["seeds"][i])]
            assert torch.equal(ro["input_ids"][i], b["input_ids"][j]) and ro["response"][i] == b["response"][j]
            assert float(rw["rewards"][i]) == float(w["rewards"][j])
        all_r = torch.cat([w["rewards"] for w in gen_rw]).double().mean()
        assert rows[s]["unfiltered_reward_mean"] == pytest.approx(float(all_r))
        assert rows[s]["dynamic_sampling_num_discarded_valid_samples"] % 4 == 0
    assert max(batches_used) > 1, f"no step needed a second generation batch ({batches_used}): the test proves little"


@pytest.mark.slow  # a whole flow run (+ resume): keeps make test under 15 minutes
def test_killed_while_sampling_then_resumed_is_bit_identical(ds_run, tmp_path, prefect_harness, ray_session, tiny_model_dir):
    from tests.faults.helpers import assert_same_rollouts

    root = str(tmp_path / "runs")
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **OVERRIDES)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    run_id = "dapo-ds-kill"
    try:
        p = run_nrl(["grpo", "--config", str(cfg_path), "--run-id", run_id], prefect_harness,
                    kill_at="dynamic_sampling@2:during")
        assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
        assert not os.path.exists(os.path.join(_step_dir(root, run_id, 2), "rollouts", "_manifest.json"))
        kill_run_actors(run_id)
        p = run_nrl(["resume", run_id, "--storage", root], prefect_harness)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    finally:
        kill_run_actors(run_id)
    ref = ds_run["root"]
    assert [train_checksum(root, run_id, s) for s in STEPS] == [train_checksum(ref, RUN_ID, s) for s in STEPS]
    for s in STEPS:
        assert_same_rollouts(root, run_id, ref, RUN_ID, s)


def test_rewards_that_never_vary_fail_after_the_last_generation_batch(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    from flows.algorithms.grpo import grpo
    from nrl_tasks.algorithms.dynamic_sampling import DynamicSamplingError

    root = str(tmp_path / "runs")
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{
        **OVERRIDES, "env.reward_fn": "tests.flows.test_dynamic_sampling:zero_reward",
        "grpo.dynamic_sampling_max_gen_batches": 2, "grpo.batch_multiplier": 2,
    })
    try:
        with pytest.raises(DynamicSamplingError, match=r"0 of the 4 groups.*grpo.dynamic_sampling_max_gen_batches"):
            grpo(config=cfg, run_id="dapo-zero")
    finally:
        kill_run_actors("dapo-zero")
    d = _step_dir(root, "dapo-zero", 1)
    assert sorted(os.listdir(os.path.join(d, "gen_batches"))) == ["000", "001"]
    import storage

    assert storage.load_batch(os.path.join(d, "gen_batches", "001", "prompts")).size == 2 * 4 * 4  # batch_multiplier 2
    assert not os.path.exists(os.path.join(d, "rollouts"))
