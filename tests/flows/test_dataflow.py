"""The step as Prefect records it, read back from Prefect's API for the session's finished tiny run
(``e2e_run``: 3 steps, step 2's refit failed once and the step ran again): every step is a named
subflow under the run's flow run tagged with the run id, its stage task runs are named after the
run and the stage, and their upstream edges are the data flow (train <- rollouts, logprobs, advantages; logprob <- generate;
score <- generate; advantages <- generate, score; generate <- prompts; refit <- train).

Plus the in-memory step (``flows/algorithms/inmemory.py``, no Prefect, no persistence) on fresh actors ends
with bit-identical weights: the flow and the readable loop are the same algorithm."""

from __future__ import annotations

import asyncio

from tests.flows.conftest import E2E_RUN_ID as RUN_ID

#: stage -> {argument: upstream stage}
EDGES = {
    "generate": {"prompts": "prompts"},
    "score": {"rollouts": "generate"},
    "logprob": {"rollouts": "generate"},
    "advantages": {"rollouts": "generate", "rewards": "score"},
    "train": {"rollouts": "generate", "logprobs": "logprob", "advantages": "advantages"},
    "refit": {"trained": "train"},
}


def _read_run():
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    async def run():
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=RUN_ID)))
            tasks = []
            for r in runs:
                tasks += await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [r.id]}), limit=200)
            return runs, tasks

    return asyncio.run(run())


def _stage(task_run) -> str:
    return task_run.name.split(f"-{RUN_ID}-", 1)[0]


def test_steps_are_named_subflows_with_data_edges(e2e_run):
    runs, tasks = _read_run()
    # the run's first flow run: tests that resume a copy of this run (same run id, same API) add later ones
    parent = min((r for r in runs if r.name == RUN_ID), key=lambda r: r.created)
    tracking = {t.id: t for t in tasks if t.flow_run_id == parent.id}
    # the subflows of that flow run (a resumed copy's last step has the same name, under its own flow run)
    by_name = {r.name: r for r in runs if r.parent_task_run_id in tracking}
    for step in (1, 2, 3):
        sub = by_name[f"{RUN_ID}-step-{step:04d}" + ("-retry1" if step == 2 else "")]
        assert sub.state.is_completed() and sub.parent_task_run_id in tracking  # a group under the run
        assert f"run:{RUN_ID}" in sub.tags
        inside = {_stage(t): t for t in tasks if t.flow_run_id == sub.id}
        assert set(inside) >= {"prompts", "generate", "score", "logprob", "advantages", "train", "refit"}, sorted(inside)
        for stage, t in inside.items():
            assert f"-{RUN_ID}-" in t.name and not t.tags, (stage, t.name, t.tags)  # no tag leases (see flows/algorithms/step.py)
        for stage, args in EDGES.items():
            got = inside[stage].task_inputs
            for arg, upstream in args.items():
                ids = {getattr(i, "id", None) for i in got.get(arg, [])}
                assert ids == {inside[upstream].id}, (step, stage, arg, got.get(arg))
            # the context is passed quoted: Prefect draws no edge through it
            assert not got.get("ctx"), (stage, got.get("ctx"))


def test_in_memory_loop_ends_bit_identical_to_the_flow(e2e_run, ray_session):
    from flows.config import load_config
    from flows.algorithms.inmemory import run_in_memory
    from flows.run.runtime import Runtime, load_tokenizer
    from nrl_tasks.run_layout import RunLayout, namespace_for
    from nrl_tasks.stages.data import load_prompt_records
    from tests.faults.helpers import train_checksum
    from tests.fixtures.grpo_runs import kill_run_actors

    cfg = load_config(e2e_run["cfg"])
    run_id = "inmemory-twin"
    rt = Runtime(cfg=cfg, run_id=run_id, layout=RunLayout(cfg.storage.root, run_id), namespace=namespace_for(run_id),
                 tokenizer=load_tokenizer(cfg))
    try:
        rt.start_policy(fresh=True)
        rt.start_generation(fresh=True)
        rows = run_in_memory(rt, cfg, cfg.grpo.max_num_steps, load_prompt_records(cfg.data, "train", cfg.grpo.seed))
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert rt.policy.weights_checksum() == train_checksum(e2e_run["root"], RUN_ID, 3)
    finally:
        rt.shutdown()
        kill_run_actors(run_id)


def test_without_step_subflows_the_tasks_join_the_run_flow_with_the_same_edges(prefect_harness, ray_session, tiny_model_dir, tmp_path):
    """``logger.step_subflows=false``: no subflow, the step's task runs sit in the run's flow run
    (tagged with the run id), with the same data edges."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from flows.algorithms.grpo import grpo
    from tests.fixtures.grpo_runs import kill_run_actors, tiny_run_config

    run_id = "flat-steps"
    cfg = tiny_run_config(
        tiny_model_dir, str(tmp_path), ray_session,
        **{"grpo.max_num_steps": 1, "checkpointing.enabled": False, "logger.step_subflows": False},
    )
    try:
        grpo(config=cfg, run_id=run_id)
    finally:
        kill_run_actors(run_id)

    async def read():
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=run_id)))
            tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [r.id for r in runs]}), limit=200)
            return runs, tasks

    runs, tasks = asyncio.run(read())
    assert [r.name for r in runs] == [run_id]
    inside = {t.name.split(f"-{run_id}-", 1)[0]: t for t in tasks if f"-{run_id}-" in t.name}
    assert {"prompts", "generate", "score", "logprob", "advantages", "train", "refit"} <= set(inside)
    assert f"run:{run_id}" in runs[0].tags
    train_in = {k: {i.id for i in v} for k, v in inside["train"].task_inputs.items() if v and k != "__parents__"}
    assert train_in == {"rollouts": {inside["generate"].id}, "logprobs": {inside["logprob"].id},
                        "advantages": {inside["advantages"].id}}
