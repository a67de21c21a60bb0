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


# ---------------------------------------------------------------------------------------------
# damaged checkpoints (restore verification): the plan falls back from facts alone

def _damaged(last=4, checkpoints=(2, 4), damaged=None, missing=None, checksums=None):
    return RunFacts("r", last, tuple(checkpoints), missing or {}, checksums or {s: f"c{s}" for s in range(1, last + 1)},
                    damaged or {})


FRESH = ActorHealth(policy_version=0, generation_version=0, generation_alive=True, policy_fresh=True)


def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one_and_is_discarded():
    problem = "/r/checkpoints/step_000004/optimizer/optimizer.json is missing (checkpoint.json lists it)"
    facts = _damaged(damaged={4: problem})
    assert facts.anchor == 2 and facts.skipped_checkpoints == (4,)
    plan = plan_resume(facts, FRESH, force_refit=True)
    assert plan.restore_from == 2 and plan.replay == (3, 4) and plan.discard == {4: problem}
    assert plan.restore_checksum == "c2"  # what the restored weights must hash to
    text = plan.describe()
    assert "discard damaged checkpoint(s) 4" in text and "optimizer/optimizer.json is missing" in text
    assert "restore checkpoint 2 instead" in text


def test_no_intact_checkpoint_falls_back_to_the_initial_weights():
    facts = _damaged(damaged={2: "weights/model.safetensors has checksum x", 4: "y"})
    live = ActorHealth(policy_version=4, generation_version=4, generation_alive=True, policy_checksum="other")
    plan = plan_resume(facts, live)
    assert plan.restore_from == 0 and plan.replay == (1, 2, 3, 4) and plan.recreate_policy  # live actors hold others
    assert sorted(plan.discard) == [2, 4] and plan.restore_checksum is None
    assert "restore the initial weights instead" in plan.describe()


def test_no_usable_fallback_stops_naming_the_damaged_file():
    problem = "/r/checkpoints/step_000002/weights/model.safetensors has checksum a1, checkpoint.json lists b2"
    facts = _damaged(last=3, checkpoints=(2,), damaged={2: problem}, missing={1: ("rollouts",)},
                     checksums={2: "c2", 3: "c3"})
    with pytest.raises(DamagedRunError, match="no valid checkpoint to restore") as err:
        plan_resume(facts, FRESH)
    assert problem in str(err.value) and "step 1" in str(err.value)


def test_a_damaged_checkpoint_never_touches_a_live_policy_that_holds_the_run_weights():
    plan = plan_resume(_damaged(damaged={4: "x"}), LIVE)
    assert not plan.touches_actors and plan.discard == {}


def test_damaged_checkpoints_after_the_trained_prefix_do_not_matter():
    facts = _damaged(last=3, checkpoints=(2, 4), damaged={4: "x"})
    assert facts.anchor == 2 and facts.skipped_checkpoints == ()
    plan = plan_resume(facts, FRESH)
    assert plan.restore_from == 2 and plan.discard == {}


# async GRPO: steps generated ahead on older weights (lookahead a: step s generates on max(0, s-1-a))


def _async(last=4, checkpoints=(2, 4), ungenerated=(), missing=None, lookahead=1):
    return RunFacts("r", last, tuple(checkpoints), missing or {}, {s: f"c{s}" for s in range(1, last + 1)},
                    lookahead=lookahead, ungenerated=tuple(ungenerated))


def test_async_nothing_lost_keeps_the_live_policy():
    plan = plan_resume(_async(), LIVE)
    assert not plan.touches_actors and plan.generate_at == {}


def test_async_lost_rollouts_of_the_next_step_restore_before_its_version():
    # step 5 generates on version 3 (< 4): checkpoint 4 is too new, checkpoint 2 is the anchor
    plan = plan_resume(_async(ungenerated=(5,)), LIVE)
    assert plan.restore_from == 2 and plan.replay == (3, 4) and plan.generate_at == {3: (5,)}
    assert plan.refit and not plan.recreate_policy
    assert "step 5 on version 3" in plan.describe()


def test_async_age_2_lost_steps_generate_at_each_version_from_the_initial_weights():
    plan = plan_resume(_async(last=3, checkpoints=(3,), ungenerated=(4, 5), lookahead=2), FRESH)
    assert plan.restore_from == 0 and plan.replay == (1, 2, 3)
    assert plan.generate_at == {1: (4,), 2: (5,)}


def test_async_replayed_step_lacking_rollouts_moves_the_anchor_back_to_its_version():
    # step 4 (replayed from checkpoint 3) lacks its rollouts, generated on version 2: checkpoint 2
    facts = _async(last=4, checkpoints=(2, 3), missing={4: ("rollouts", "rewards")})
    assert facts.anchor == 2
    plan = plan_resume(facts, LIVE)
    assert plan.restore_from == 2 and plan.replay == (3, 4) and plan.generate_at == {2: (4,)}


def test_sync_facts_have_no_schedule_effects():
    facts = _facts(missing={3: ("rollouts",)})
    assert facts.anchor == 2
    assert plan_resume(facts, LIVE).generate_at == {2: (3,)}  # sync: generated on step - 1, as before
