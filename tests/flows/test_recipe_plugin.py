"""An algorithm defined only here, on the recipe interface, runs through ``nrl`` (issue 40).

:data:`REINFORCE` is REINFORCE without a baseline (Williams 1992): the advantage of a sampled
response is its reward as it is (no group mean subtracted, no scaling), the update GRPO's policy
gradient on those advantages, on-policy (``loss_fn.force_on_policy_ratio``, no KL: no logprob
stage). It is GRPO's recipe with another ``update``: a few lines, and no module of the project
is edited for it; the config names it ``algorithm: tests.flows.test_recipe_plugin:REINFORCE``.

Checked: ``nrl train`` runs it (its advantages are the raw rewards), its summary shows the plot,
and a SIGKILL inside its train of step 2 then ``nrl resume`` ends bit-identical (slow).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch
import yaml
from prefect import task
from prefect.utilities.annotations import quote

from flows.algorithms.grpo import GRPO
from flows.algorithms.lanes import beside
from flows.algorithms.training import recipe_flow
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.runner import TASK_DEFAULTS, run_stage
from nrl_tasks.stages.train import train
from tests.faults.helpers import run_nrl, train_checksum

KIND = "tests.flows.test_recipe_plugin:REINFORCE"
#: runs of nrl in processes of their own: the slow suite (keeps make test under 10 minutes)
pytestmark = pytest.mark.slow


@task(name="advantages", task_run_name="advantages-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def raw_reward_advantages(ctx: Any, rollouts: Any, rewards: Any) -> Any:
    """A_i = r_i (an invalid reward: the sample is masked out)."""

    def compute(inputs: Any, timer: Any) -> Any:
        r, ok = inputs["rewards"]["rewards"].to(torch.float32), inputs["rewards"]["reward_valid"].to(torch.float32)
        return BatchedDataDict({"advantages": r * ok, "sample_mask": ok, "rewards": r}), {}

    return run_stage(ctx, "advantages", compute, inputs={"rollouts": rollouts, "rewards": rewards})


class Reinforce:
    """REINFORCE without a baseline: GRPO's recipe (composed, not inherited) with its own update."""

    kind = KIND

    def __getattr__(self, name: str) -> Any:  # everything else is GRPO's
        return getattr(GRPO, name)

    def update(self, ctx: Any, inputs: Any) -> dict[str, Any]:
        c = quote(ctx)
        rewards = beside(inputs["rewards"], lambda: None)[1]  # a submitted score: its result
        adv = raw_reward_advantages(c, inputs["rollouts"], rewards)
        return {**inputs, "rewards": rewards, "logprobs": None, "advantages": adv,
                "train": train(c, inputs["rollouts"], None, adv)}

    def recompute(self, run: Any, step: int, generation_version: int) -> None:
        self.update(run.step(step), self.inputs(run.step(step), generation_version))

    def run(self, **params: Any) -> dict[str, Any]:
        return recipe_flow(self)(**params)


REINFORCE = Reinforce()


def _config(tmp_path, model_dir: str, root: str) -> str:
    from tests.fixtures.grpo_runs import tiny_run_config

    cfg = tiny_run_config(model_dir, root, None, **{
        "algorithm": KIND, "grpo.max_num_steps": 3, "checkpointing.save_period": 1,
        "loss_fn.force_on_policy_ratio": True, "loss_fn.reference_policy_kl_penalty": 0.0,
    })
    cfg["cluster"].pop("ray", None)
    path = tmp_path / "reinforce.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture(scope="module")
def reinforce_run(prefect_harness, tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reinforce")
    root = str(tmp / "runs")
    proc = run_nrl(["train", "--config", _config(tmp, tiny_model_dir, root), "--storage", root, "--run-id", "rf"],
                   prefect_harness, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {"root": root, "tmp": tmp, "stdout": proc.stdout}


def test_a_recipe_defined_in_a_test_module_runs_through_nrl(reinforce_run):
    import storage

    from flows.observe.metrics import read_metrics

    root = reinforce_run["root"]
    assert "nrl: tests.flows.test_recipe_plugin:REINFORCE run rf" in reinforce_run["stdout"]
    rows = read_metrics(os.path.join(root, "rf", "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["logprob_skipped"] for r in rows)
    for step in (1, 2, 3):
        d = os.path.join(root, "rf", "steps", f"step_{step:06d}")
        adv, rw = storage.load_batch(os.path.join(d, "advantages")), storage.load_batch(os.path.join(d, "rewards"))
        assert torch.equal(adv["advantages"], rw["rewards"].float() * rw["reward_valid"].float())  # no baseline
        assert not os.path.exists(os.path.join(d, "logprobs"))
    status = yaml.safe_load(open(os.path.join(root, "rf", "status.json"), encoding="utf-8"))
    assert status["algorithm"] == KIND and status["status"] == "completed"


def test_its_summary_shows_the_plot(reinforce_run):
    from tests.flows.test_supervised_recipes import _read_artifact

    from flows.observe.artifacts import artifact_key

    md = _read_artifact(artifact_key("rf", "summary"))
    assert "step 3 of 3" in md and "![reward per step" in md and "**History**" in md


def test_it_resumes_bit_identically_after_sigkill(reinforce_run, prefect_harness, tiny_model_dir, tmp_path):
    root = str(tmp_path / "runs")
    cfg = _config(tmp_path, tiny_model_dir, root)
    proc = run_nrl(["train", "--config", cfg, "--storage", root, "--run-id", "rf"], prefect_harness,
                   kill_at="train@2:during", timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-3000:]
    proc = run_nrl(["resume", "rf", "--storage", root], prefect_harness, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [train_checksum(root, "rf", s) for s in (1, 2, 3)] == [train_checksum(reinforce_run["root"], "rf", s) for s in (1, 2, 3)]
