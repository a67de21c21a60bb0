"""The one stage skeleton (``run_stage``): skip if committed, inputs only from the references given,
attempts counted on the run, failures recorded, observers told; on real Arrow datasets, no actors."""

from __future__ import annotations

import types

import pytest
import torch

from flows.config import MasterConfig, load_config
from flows.run.runtime import build_run_context
from nrl_tasks.stages.context import Observers
from nrl_tasks.stages.runner import committed_ref, save_output

TINY = "configs/grpo_tiny.yaml"


class Recorder:
    def __init__(self):
        self.events = []

    def on_stage(self, ctx, stage, point):
        self.events.append((stage, ctx.step, point))

    def on_actor_call(self, ctx, stage, role, workers):
        self.events.append((stage, ctx.step, role))


@pytest.fixture()
def ctx1(tmp_path):
    cfg = load_config(TINY, [f"storage.root={tmp_path}"])
    actors = types.SimpleNamespace(namespace="-", policy=None, generation=None, reward_model=None)
    rec = Recorder()
    run = build_run_context(cfg, "runner", actors, tokenizer=None, observers=Observers([rec]))
    return run.step(1), rec


def _inputs(c):
    rollouts = save_output(
        {"group_id": torch.tensor([0, 0, 1, 1])}, c.uri("rollouts"), run_id=c.run_id, step=1, stage="rollouts",
        weights_version=0,
    )
    rewards = save_output(
        {"rewards": torch.tensor([1.0, 0.0, 1.0, 1.0]), "reward_valid": torch.tensor([True] * 4)}, c.uri("rewards"),
        run_id=c.run_id, step=1, stage="rewards", weights_version=None,
    )
    return rollouts, rewards


def test_runs_once_then_skips_and_counts_attempts(ctx1):
    from nrl_tasks.stages.advantages import advantages

    c, rec = ctx1
    rollouts, rewards = _inputs(c)
    out = advantages.fn(c, rollouts, rewards)
    assert out.stage == "advantages" and out.step == 1 and out.rows == 4 and out.attempts == 1
    assert out.get("groups_with_signal") == 1 and out.get("recovered") is False and out.seconds > 0
    assert committed_ref(c.uri("advantages")).checksum == out.checksum
    assert rec.events == [("advantages", 1, "start"), ("advantages", 1, "computed"), ("advantages", 1, "committed")]
    again = advantages.fn(c, rollouts, rewards)  # committed: nothing read, nothing computed
    assert again.checksum == out.checksum and again.attempts == 1 and len(rec.events) == 3
    assert c.run.attempts == {(1, "advantages"): 1}


def test_inputs_only_from_the_references_given(ctx1):
    from nrl_tasks.stages.advantages import advantages

    c, _ = ctx1
    rollouts, rewards = _inputs(c)
    with pytest.raises(ValueError, match="handed 'rewards' of step 1 as its 'rollouts' input"):
        advantages.fn(c, rewards, rewards)
    with pytest.raises(TypeError, match="not a DatasetRef"):
        advantages.fn(c, c.uri("rollouts"), rewards)
    assert c.run.last_failure == (1, "advantages")
    assert committed_ref(c.uri("advantages")) is None


def test_a_failed_compute_commits_nothing_and_is_recorded(ctx1):
    from nrl_tasks.stages.runner import run_stage

    c, rec = ctx1

    def boom(inputs, timer):
        raise RuntimeError("actor gone")

    with pytest.raises(RuntimeError, match="actor gone"):
        run_stage(c, "score", boom)
    assert c.run.last_failure == (1, "score") and c.run.attempts[(1, "score")] == 1
    assert committed_ref(c.uri("rewards")) is None and rec.events == [("score", 1, "start")]


def test_recovery_notes_go_to_the_next_commit_only(ctx1):
    from nrl_tasks.stages.advantages import advantages

    c, _ = ctx1
    rollouts, rewards = _inputs(c)
    c.run.recovery_notes = {"advantages": {"recovered": True, "replayed": "1"}}
    out = advantages.fn(c, rollouts, rewards)
    assert out.get("recovered") is True and out.get("replayed") == "1" and "advantages" not in c.run.recovery_notes


class _Watched(MasterConfig):
    """A config that counts how often something walks its fields (what Prefect's input visitor does)."""

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()


def test_prefect_neither_walks_nor_links_the_quoted_context(tmp_path, prefect_harness):
    """The flow hands each task ``quote(ctx)``: the task gets the context itself, Prefect does not
    visit the run's config, actors or tokenizer, and records no input edge through it."""
    from prefect import flow, task
    from prefect.utilities.annotations import quote

    from nrl_tasks.stages.runner import TASK_DEFAULTS

    cfg = _Watched.model_validate(load_config(TINY, [f"storage.root={tmp_path}", "grpo.seed=7"]).model_dump())
    actors = types.SimpleNamespace(namespace="-", policy=None, generation=None, reward_model=None)
    run = build_run_context(cfg, "quoted", actors, tokenizer=None)

    @task(name="probe", task_run_name="probe-{ctx.run_id}", **TASK_DEFAULTS)
    def probe(ctx):
        from prefect.runtime import task_run

        return ctx is run, ctx.cfg.grpo.seed, task_run.name

    @flow(persist_result=False)
    def go(quoted: bool):
        return probe(quote(run) if quoted else run)

    _Watched.walks = 0
    same, seed, name = go(True)
    assert same and seed == 7 and name == "probe-quoted"
    assert _Watched.walks == 0
    go(False)  # the same context unquoted: Prefect visits its fields (the config among them)
    assert _Watched.walks > 0
