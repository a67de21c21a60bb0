"""The step schedule (``nrl_tasks/stages/schedule.py``): versions per step, and a phase order in
which every generation runs on exactly its scheduled version, before its step trains, and every
refit sends the version the policy holds at that moment."""

from __future__ import annotations

import pytest

from nrl_tasks.stages.schedule import Event, StepSchedule


def test_versions_per_step_for_age_1_and_2_and_sync():
    assert [StepSchedule(6, 1).generation_version(n) for n in range(1, 7)] == [0, 0, 1, 2, 3, 4]
    assert [StepSchedule(6, 2).generation_version(n) for n in range(1, 7)] == [0, 0, 0, 1, 2, 3]
    assert [StepSchedule(6).generation_version(n) for n in range(1, 7)] == [0, 1, 2, 3, 4, 5]
    assert [StepSchedule(6, 2).trajectory_age(n) for n in range(1, 7)] == [0, 1, 2, 2, 2, 2]
    assert [StepSchedule(6).trajectory_age(n) for n in range(1, 7)] == [0] * 6


def test_age_2_overlaps_two_generations_with_the_first_train():
    phases = StepSchedule(5, 2).phases()
    assert phases[1] == [Event("train", 1, 1), Event("generate", 2, 0), Event("generate", 3, 0)]
    assert phases[2] == [Event("refit", 1, 1)] and phases[3] == [Event("train", 2, 2), Event("generate", 4, 1)]


@pytest.mark.parametrize("age", [None, 1, 2, 3])
@pytest.mark.parametrize("steps", range(1, 9))
def test_every_schedule_is_consistent(age, steps):
    sched = StepSchedule(steps, age)
    held, policy = 0, 0  # what the generation workers and the policy hold
    generated: dict[int, int] = {}
    trained: list[int] = []
    for phase in sched.phases():
        trains = [e for e in phase if e.kind == "train"]
        assert len(trains) <= 1 and all(e.kind != "refit" for e in phase) or phase == [phase[0]]
        for e in phase:
            if e.kind == "generate":
                assert e.version == held == sched.generation_version(e.step), (e, held)
                assert e.step not in generated
                assert not trains or e.step > trains[0].step  # never overlaps the train that reads it
                generated[e.step] = e.version
            elif e.kind == "refit":
                assert e.version == policy, (e, policy)  # the policy sends what it holds
                held = e.version
        for e in trains:
            assert e.step in generated and e.step == policy + 1, (e, generated)
            trained.append(e.step)
            policy = e.step
    assert trained == list(range(1, steps + 1))
    assert sorted(generated) == trained
    if age is None:  # sync: today's order, generate -> train -> refit per step
        assert all(len(p) == 1 for p in sched.phases())


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="age must be >= 1"):
        StepSchedule(3, 0)
    with pytest.raises(ValueError, match="max_steps"):
        StepSchedule(0, 1)
