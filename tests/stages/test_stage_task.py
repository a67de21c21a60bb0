"""StageTask: Prefect tasks that pass the run config through unvisited and reuse their option variants."""

from __future__ import annotations

import pytest
from prefect import flow

from flows.config import MasterConfig, load_config
from nrl_tasks.stages.common import TASK_DEFAULTS, StageTask, stage_task
from nrl_tasks.stages.recovery import STAGE_RETRY, with_stage_retries


@stage_task(name="probe-stage", task_run_name="probe-{run_id}-step{step}", **TASK_DEFAULTS, **STAGE_RETRY)
def probe_stage(cfg, run_id: str, step: int, extra=None) -> dict:
    return {"cfg_type": type(cfg).__name__, "seed": cfg.grpo.seed, "same": cfg is extra, "step": step}


@pytest.fixture(scope="module")
def cfg() -> MasterConfig:
    return load_config("configs/grpo_tiny.yaml", ["grpo.seed=7"])


def test_with_options_variants_are_stage_tasks_built_once(cfg):
    a = with_stage_retries(probe_stage, cfg)
    b = with_stage_retries(probe_stage, cfg)
    assert isinstance(a, StageTask) and a is b
    assert a.retries == cfg.grpo.stage_retries and a.retry_condition_fn is probe_stage.retry_condition_fn
    c = probe_stage.with_options(retries=0, retry_delay_seconds=[0.5])
    assert isinstance(c, StageTask) and c is not a and c.retries == 0
    assert probe_stage.with_options(retries=0, retry_delay_seconds=[0.5]) is c
    assert probe_stage.with_options(retries=0, retry_delay_seconds=(0.5,)) is c  # lists and tuples alike
    assert probe_stage.with_options(retries=1, retry_delay_seconds=[0.5]) is not c


def test_config_reaches_the_function_as_passed(cfg):
    @flow(persist_result=False)
    def run() -> list[dict]:
        return [
            probe_stage(cfg, "r", 1, extra=cfg),
            with_stage_retries(probe_stage, cfg)(cfg, "r", 2, extra=cfg),
            probe_stage(cfg=cfg, run_id="r", step=3, extra=cfg),
        ]

    out = run()
    assert [o["step"] for o in out] == [1, 2, 3]
    assert all(o["cfg_type"] == "MasterConfig" and o["seed"] == 7 and o["same"] for o in out)


class _Watched(MasterConfig):
    """A config that counts how often something walks its fields (what Prefect's visitor does)."""

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()


def test_prefect_does_not_walk_the_config(cfg):
    watched = _Watched.model_validate(cfg.model_dump())
    _Watched.walks = 0

    @flow(persist_result=False)
    def run() -> dict:
        return probe_stage(watched, "r", 1)

    assert run()["seed"] == 7
    assert _Watched.walks == 0
    plain = probe_stage.fn  # the same function as an ordinary Prefect task walks it
    from prefect import task

    @flow(persist_result=False)
    def run_plain() -> dict:
        return task(name="plain", **TASK_DEFAULTS)(plain)(watched, "r", 1)

    assert run_plain()["seed"] == 7 and _Watched.walks > 0
