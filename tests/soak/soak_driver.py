"""The flow process of the soak test (run as a subprocess, so its memory is the driver's alone).

    python -m tests.soak.soak_driver CONFIG_JSON RUN_ID REPORT_JSON RAY_TEMP_DIR

Starts a local Ray, runs the ``grpo`` flow (Prefect's ephemeral API) to the end, then checks what
is left: named actors and placement groups of the run (after ``shutdown``), Ray worker
processes still hosting the run's actors, and after ``ray.shutdown()`` any Ray process under
this one. Writes a JSON report.
"""

from __future__ import annotations

import json
import sys
import time

import psutil


def _ray_descendants() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if ("site-packages/ray/" in cmd or cmd.startswith("ray::")) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _actor_processes() -> list[dict]:
    out = []
    for p in _ray_descendants():
        try:
            title = p.cmdline()[0] if p.cmdline() else ""
        except psutil.Error:
            continue
        if title.startswith("ray::") and ("PolicyWorker" in title or "GenerationWorker" in title):
            out.append({"pid": p.pid, "title": title})
    return out


def _wait(pred, timeout_s: float) -> list:
    deadline = time.monotonic() + timeout_s
    while True:
        left = pred()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def main(argv: list[str]) -> int:
    cfg_path, run_id, report_path, ray_tmp = argv
    from flows.cli import _quiet_env

    _quiet_env()  # as `nrl` does: among others a patient ephemeral Prefect server (the default 20 s timed out in CI)
    import ray

    from flows.algorithms.grpo import grpo
    from flows.run.runtime import namespace_for
    from nrl_tasks.distributed.virtual_cluster import init_ray

    with open(cfg_path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    init_ray(None, num_cpus=4, temp_dir=ray_tmp)
    t0 = time.perf_counter()
    result = grpo(config=cfg, run_id=run_id)
    seconds = time.perf_counter() - t0

    ns = namespace_for(run_id)
    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == ns]
    pgs = [
        pg["name"] for pg in ray.util.placement_group_table().values()
        if str(pg.get("name", "")).startswith(run_id) and pg["state"] != "REMOVED"
    ]
    actor_procs = _wait(_actor_processes, 30)
    ray.shutdown()
    ray_left = _wait(_ray_descendants, 60)
    report = {
        "run_id": result["run_id"],
        "last_step": result["last_step"],
        "seconds": seconds,
        "named_actors_left": named,
        "placement_groups_left": pgs,
        "actor_processes_left": actor_procs,
        "ray_processes_left": [{"pid": p.pid, "cmd": " ".join(p.cmdline())[:200]} for p in ray_left],
    }
    with open(report_path, "w", encoding="utf-8") as fh:
        json.dump(report, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
