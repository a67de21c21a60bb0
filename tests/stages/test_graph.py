"""The stage graph is the one list the rest derives from: recompute dependants, replay inputs,
retention, the metrics keys and the dataset names all agree with it."""

from __future__ import annotations

from nrl_tasks.stages import graph


def test_every_input_is_an_earlier_output():
    seen: set[str] = set()
    for spec in graph.STAGES:
        assert set(spec.all_inputs) <= seen, spec
        seen.add(spec.output)


def test_dependants_are_transitive_and_in_pipeline_order():
    assert graph.dependants("prompts") == graph.DATA_STAGES
    assert graph.dependants("generate") == ("rollouts", "rewards", "logprobs", "advantages", "train")
    # advantages may read logprobs (REINFORCE++ with the KL in the reward): recomputed with them
    assert graph.dependants("logprobs") == ("logprobs", "advantages", "train")
    assert graph.dependants("train") == ("train",)


def test_derived_tables_follow_the_graph():
    from flows.observe.metrics import STAGE_ATTEMPTS, STAGE_SECONDS
    from flows.run.recompute import DATASET_STAGE
    from flows.run.retention import PRUNABLE_STAGES
    from flows.run.recompute import RECOMPUTE_ALIASES
    from nrl_tasks.run_layout import DATA_STAGES
    from nrl_tasks.stages.train import TRAIN_INPUT_STAGES

    assert DATA_STAGES == graph.DATA_STAGES
    assert TRAIN_INPUT_STAGES == graph.spec("train").inputs == graph.REPLAY_INPUTS
    assert PRUNABLE_STAGES == tuple(d for d in graph.DATA_STAGES if d != "train")
    assert set(STAGE_SECONDS) == {s.name for s in graph.STAGES}
    assert set(STAGE_ATTEMPTS) == set(graph.RETRIED_STAGES) == {"generate", "logprob", "train"}
    assert {d: DATASET_STAGE[d] for d in graph.DATA_STAGES} == {s.output: s.name for s in graph.STAGES}
    for s in graph.STAGES:
        assert RECOMPUTE_ALIASES[s.name] == RECOMPUTE_ALIASES[s.output] == graph.dependants(s.name)


def test_unknown_names_are_a_clear_error():
    import pytest

    with pytest.raises(KeyError, match="no stage or dataset named 'refit'"):
        graph.spec("refit")
