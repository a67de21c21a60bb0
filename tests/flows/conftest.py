"""Fixtures of the flow tests: one Prefect test server per session, tiny-run configs, cleanup."""

from __future__ import annotations

import os
from typing import Any

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_CONFIG = os.path.join(REPO, "configs", "grpo_tiny.yaml")
E2E_RUN_ID = "e2e-tiny"


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect server for the session (~11 s once); yields its API URL."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield PREFECT_API_URL.value()


def tiny_run_config(model_dir: str, root: str, ray_address: str | None, **overrides: Any) -> dict[str, Any]:
    """``configs/grpo_tiny.yaml`` as a dict, on the session's tiny model, storage and Ray."""
    with open(TINY_CONFIG, encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    data["policy"]["model_name"] = model_dir
    data["storage"]["root"] = root
    data.setdefault("cluster", {}).setdefault("ray", {})["address"] = ray_address
    data["logger"]["console"] = False
    for dotted, value in overrides.items():
        node = data
        *path, last = dotted.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return data


def kill_run_actors(run_id: str) -> None:
    """Kill a run's policy/generation actors and placement groups (a lost local Ray, as seen by resume)."""
    from flows.runtime import drop_runtime, namespace_for
    from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster
    from nrl_tasks.distributed.worker_groups import RayWorkerGroup

    drop_runtime(run_id)
    ns = namespace_for(run_id)
    for prefix in ("lm_policy", "generation", "reward_model"):
        try:
            RayWorkerGroup.attach(prefix, ns).shutdown(force=True)
        except LookupError:
            pass
    for role in ("policy", "generation", "reward"):
        try:
            RayVirtualCluster.attach(f"{run_id}-{role}", ns, pg_timeout_s=5).shutdown()
        except LookupError:
            pass


@pytest.fixture(scope="session")
def e2e_run(prefect_harness, ray_session, tiny_model_dir, tmp_path_factory):
    """The end-to-end flow run (``configs/grpo_tiny.yaml``: 3 steps, checkpoints at 2 and 3, plus
    validation at step 2) with an injected mid-stream failure of the step-2 refit; actors kept
    for the refit test. Also the uninterrupted baseline of the kill-and-resume test."""
    from flows.grpo import grpo
    from flows.runtime import get_runtime

    root = str(tmp_path_factory.mktemp("runs"))
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{"grpo.val_period": 2})
    os.environ["NRL_FAULT_REFIT_PARTIAL"] = "2"
    os.environ["NRL_KEEP_ACTORS"] = "1"
    try:
        result = grpo(config=cfg, run_id=E2E_RUN_ID)
    finally:
        os.environ.pop("NRL_FAULT_REFIT_PARTIAL", None)
        os.environ.pop("NRL_KEEP_ACTORS", None)
    from flows.config import load_config

    rt = get_runtime(load_config(cfg), E2E_RUN_ID)
    yield {"result": result, "root": root, "cfg": cfg, "rt": rt}
    kill_run_actors(E2E_RUN_ID)
