"""The resume plan is a pure function of what storage holds and how the actors are."""

from __future__ import annotations

import pytest

from nrl_tasks.stages.errors import DamagedRunError
from nrl_tasks.stages.resume_plan import ActorHealth, RunFacts, plan_resume


def _facts(last=4, checkpoints=(2,), missing=None, checksums=None):
    return RunFacts("r", last, tuple(checkpoints), missing or {}, checksums or {s: f"c{s}" for s in range(1, last + 1)})


LIVE = ActorHealth(policy_version=4, generation_version=4, generation_alive=True, policy_checksum="c4")


def test_healthy_actors_at_the_run_version_need_nothing():
    plan = plan_resume(_facts(), LIVE)
    assert not plan.touches_actors and plan.restore_from is None and plan.replay == ()
    assert "nothing to do" in plan.describe()
    assert plan_resume(_facts(), LIVE, force_refit=True).refit  # every resume starts with a full refit


def test_a_dead_policy_is_recreated_restored_from_the_anchor_and_replayed():
    plan = plan_resume(_facts(), ActorHealth(policy_version=None, generation_version=4, generation_alive=True))
    assert plan.recreate_policy and plan.restore_from == 2 and plan.replay == (3, 4)
    assert not plan.refit and not plan.recreate_generation  # the workers still hold version 4


def test_fresh_actors_without_a_checkpoint_replay_from_the_start():
    fresh = ActorHealth(policy_version=0, generation_version=0, generation_alive=True, policy_fresh=True)
    plan = plan_resume(_facts(last=3, checkpoints=()), fresh)
    assert plan.restore_from == 0 and plan.replay == (1, 2, 3) and not plan.recreate_policy and plan.refit


def test_live_actors_with_other_weights_are_restored():
    wrong = ActorHealth(policy_version=4, generation_version=4, generation_alive=True, policy_checksum="other")
    plan = plan_resume(_facts(), wrong)
    assert plan.restore_from == 2 and plan.replay == (3, 4) and "does not hold the recorded weights" in plan.describe()
    older = ActorHealth(policy_version=1, generation_version=1, generation_alive=True)
    no_ckpt = plan_resume(_facts(checkpoints=()), older)
    assert no_ckpt.recreate_policy and no_ckpt.restore_from == 0 and no_ckpt.refit  # back to the initial weights


def test_dead_or_stale_generation_workers_are_recreated_or_refitted():
    dead = ActorHealth(policy_version=4, generation_version=None, generation_alive=False, policy_checksum="c4")
    plan = plan_resume(_facts(), dead)
    assert plan.recreate_generation and plan.refit and plan.restore_from is None
    stale = ActorHealth(policy_version=4, generation_version=None, generation_alive=True, policy_checksum="c4")
    assert plan_resume(_facts(), stale).refit and not plan_resume(_facts(), stale).recreate_generation


def test_missing_datasets_of_a_replayed_step_are_recomputed_then_verified():
    plan = plan_resume(_facts(missing={3: ("rollouts",)}), LIVE)
    assert plan.restore_from == 2 and plan.recompute == {3: ("rollouts",)} and plan.replay == (3, 4)
    assert plan.refit  # recomputing refits the workers to step 2's weights first
    with pytest.raises(DamagedRunError, match="recorded no weights checksum"):
        plan_resume(_facts(missing={3: ("rollouts",)}, checksums={4: "c4"}), LIVE)


def test_steps_at_or_before_the_anchor_are_never_replayed():
    plan = plan_resume(_facts(last=2, checkpoints=(2,)), ActorHealth(None, 2, True))
    assert plan.restore_from == 2 and plan.replay == ()
