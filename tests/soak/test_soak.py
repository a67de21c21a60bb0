"""Soak: a 50-step tiny-model GRPO run (validation and checkpoints every 5 steps, retention on)
in its own flow process, sampled after every step from outside.

Per step (when its line lands in ``metrics.jsonl``): the RSS of the flow process (the driver)
and of every actor process (policy and generation workers: Ray workers under the driver whose
title names the actor class), and the bytes of the run on storage. Asserted:

- **memory**: over the last 40 steps, for the driver and each actor, the least-squares slope
  of RSS < ``SLOPE_MB_PER_STEP`` and max - min < ``SPREAD_MB``. The bound is set against the
  leaks that matter here: a leaked refit bucket (4 MiB per step on CPU), a leaked copy of the
  tiny model + Adam state (~1.3 MB per step) or per-step Prefect futures/artifacts kept alive
  all exceed 0.5 MB/step, i.e. 20 MB over 40 steps; the noise measured on this machine was about
  an order of magnitude below (allocator arenas, Python's free lists; see the printed series).
- **storage**: with ``storage.keep_last_k_steps=3`` and ``checkpointing.keep_last_k=2`` +
  ``keep_top_k=1`` the run's bytes stay bounded: at the end they are below what the first 12
  steps held plus the ``train``/``val`` markers every step keeps; without retention the bytes of
  every step and checkpoint (each measured when written) add up linearly.
- **no leaks after shutdown**: no named actor or placement group of the run, no actor process,
  and after ``ray.shutdown()`` no Ray process under the driver.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from tests.fixtures.processes import alive
from tests.scaleout.helpers import REPO, TINY_CONFIG, clean_env

RUN_ID = "soak"
STEPS = 50
WINDOW = 40
SLOPE_MB_PER_STEP = 0.5
SPREAD_MB = 40.0
MB = 1024 * 1024


def _du(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except FileNotFoundError:  # deleted by retention meanwhile
                pass
    return total


def _slope(ys: list[float]) -> float:
    n = len(ys)
    xm, ym = (n - 1) / 2, sum(ys) / n
    den = sum((x - xm) ** 2 for x in range(n))
    return sum((x - xm) * (y - ym) for x, y in enumerate(ys)) / den


def _roles(driver: psutil.Process, known: dict[int, str]) -> dict[str, psutil.Process]:
    """Driver and actor processes by role. An actor is recognised by its process title once
    (``known`` remembers it by pid): Ray rewrites titles per call, and a read racing a rewrite
    must not drop a sample of a process that is still the same actor."""
    out: dict[str, psutil.Process] = {"driver": driver}
    for p in driver.children(recursive=True):
        role = known.get(p.pid)
        if role is None:
            try:
                title = p.cmdline()[0] if p.cmdline() else ""
            except psutil.Error:
                continue
            if title.startswith("ray::PolicyWorker"):
                role = known[p.pid] = f"policy:{p.pid}"
            elif title.startswith("ray::HfGenerationWorker"):
                role = known[p.pid] = f"generation:{p.pid}"
            else:
                continue
        out[role] = p
    return out



def _config(model_dir: str, root: str) -> dict:
    import yaml

    with open(TINY_CONFIG, encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    cfg["policy"]["model_name"] = model_dir
    cfg["storage"].update(root=root, keep_last_k_steps=3)
    cfg["grpo"].update(max_num_steps=STEPS, val_period=5)
    cfg["checkpointing"].update(save_period=5, keep_last_k=2, keep_top_k=1)
    cfg["logger"]["console"] = False
    return cfg


@pytest.mark.slow
def test_soak_50_steps(tmp_path, tiny_model_dir):
    root = str(tmp_path / "runs")
    run_dir = os.path.join(root, RUN_ID)
    cfg_path, report_path = str(tmp_path / "cfg.json"), str(tmp_path / "report.json")
    with open(cfg_path, "w") as fh:
        json.dump(_config(tiny_model_dir, root), fh)
    ray_tmp = tempfile.mkdtemp(prefix="nrl-soak-", dir="/tmp")  # Ray's socket paths stay short
    env = clean_env(str(tmp_path), RAY_AUTH_MODE="disabled", PREFECT_LOGGING_LEVEL="WARNING")
    log_path = str(tmp_path / "driver.log")
    samples: list[dict] = []
    known: dict[int, str] = {}  # actor pid -> role
    spawned: set[psutil.Process] = set()
    step_bytes: dict[int, int] = {}
    ck_bytes: dict[str, int] = {}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.soak.soak_driver", cfg_path, RUN_ID, report_path, ray_tmp],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    driver = psutil.Process(proc.pid)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    seen = 0
    t0 = time.monotonic()
    try:
        while proc.poll() is None and time.monotonic() - t0 < 1500:
            time.sleep(0.2)
            try:
                with open(metrics) as fh:
                    n = sum(1 for _ in fh)
            except FileNotFoundError:
                continue
            if n <= seen:
                continue
            seen = n
            rss = {}
            try:
                spawned.update(driver.children(recursive=True))
            except psutil.Error:
                pass
            for role, p in _roles(driver, known).items():
                try:
                    rss[role] = p.memory_info().rss / MB
                except psutil.Error:
                    pass
            step_dir = os.path.join(run_dir, "steps", f"step_{n:06d}")
            step_bytes[n] = _du(step_dir)
            ck_root = os.path.join(run_dir, "checkpoints")
            for name in os.listdir(ck_root) if os.path.isdir(ck_root) else []:
                if not name.startswith(".") and name not in ck_bytes:
                    ck_bytes[name] = _du(os.path.join(ck_root, name))
            samples.append({"step": n, "rss_mb": rss, "run_bytes": _du(run_dir), "t": time.monotonic() - t0})
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            for p in [driver] + driver.children(recursive=True):
                try:
                    p.kill()
                except psutil.Error:
                    pass
        shutil.rmtree(ray_tmp, ignore_errors=True)
    with open(log_path) as fh:
        log_tail = fh.read()[-4000:]
    assert rc == 0, log_tail
    report = json.load(open(report_path))

    # ---- summary
    roles = sorted({r for s in samples for r in s["rss_mb"]})
    print(f"\nsoak: {report['last_step']} steps in {report['seconds']:.0f} s, {len(samples)} samples")
    print("| process | RSS first | RSS step 10 | RSS last | min..max (last 40) | slope MB/step (last 40) |")
    print("|---|---|---|---|---|---|")
    series: dict[str, list[float]] = {}
    for role in roles:
        ys = [s["rss_mb"][role] for s in samples if role in s["rss_mb"]]
        series[role] = ys
        tail = ys[-WINDOW:]
        print(
            f"| {role} | {ys[0]:.1f} | {ys[min(9, len(ys) - 1)]:.1f} | {ys[-1]:.1f} | "
            f"{min(tail):.1f}..{max(tail):.1f} | {_slope(tail):+.3f} |"
        )
    sizes = [s["run_bytes"] for s in samples]
    no_retention = sum(step_bytes.values()) + sum(ck_bytes.values())
    print(
        f"storage: run bytes at steps {'/'.join(str(samples[i]['step']) for i in (4, 11, 24, -1))} = "
        f"{', '.join(f'{sizes[i] / MB:.2f}' for i in (4, 11, 24, -1))} MB with retention; "
        f"without retention it would be {no_retention / MB:.2f} MB "
        f"({sum(step_bytes.values()) / len(step_bytes) / 1024:.0f} KiB/step + {len(ck_bytes)} checkpoints x "
        f"{sum(ck_bytes.values()) / max(1, len(ck_bytes)) / MB:.2f} MB)"
    )

    # ---- a sample per step (a busy machine may merge two), every process seen throughout
    steps = [s["step"] for s in samples]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS and len(steps) >= STEPS - 5, steps
    assert any(r.startswith("policy:") for r in roles) and any(r.startswith("generation:") for r in roles)
    # The same actor processes all along: no actor re-created (as many actor pids as at step 1),
    # each one sampled at every step. The last step's sample is left out for actors: the flow
    # tears them down once that step's metrics line is written, so the sample races their exit
    # (seen in CI: an actor missing, or an RSS of 0 from an exiting process).
    first_actors = {r for r in samples[0]["rss_mb"] if r != "driver"}
    assert {r for r in roles if r != "driver"} == first_actors, (roles, first_actors)
    for role in roles:
        kept = samples if role == "driver" else samples[:-1]
        assert all(role in s["rss_mb"] for s in kept), (role, [s["step"] for s in kept if role not in s["rss_mb"]])
        ys = [s["rss_mb"][role] for s in kept]
        tail = ys[-WINDOW:]
        assert _slope(tail) < SLOPE_MB_PER_STEP, (role, _slope(tail), tail)
        assert max(tail) - min(tail) < SPREAD_MB, (role, min(tail), max(tail))

    # ---- storage bounded by retention
    marker_bytes = max(
        _du(os.path.join(run_dir, "steps", f"step_{s:06d}")) for s in range(1, STEPS - 3)
    )  # what an old step keeps (train + val datasets)
    # early peak + one more kept checkpoint (top-k) + what every step keeps + its metrics line
    early = [s["run_bytes"] for s in samples if 10 <= s["step"] <= 20]
    late = [s["run_bytes"] for s in samples if s["step"] > 20]
    bound = max(early) + max(ck_bytes.values()) + STEPS * (marker_bytes + 2048)
    print(f"storage bound {bound / MB:.2f} MB (old step keeps {marker_bytes} B), end {sizes[-1] / MB:.2f} MB")
    assert max(late) < bound, (sizes, bound)
    assert sizes[-1] < no_retention / 3
    kept = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert "step_000050" in kept and len(kept) <= 3, kept

    # ---- nothing left after shutdown
    assert report["named_actors_left"] == [], report
    assert report["placement_groups_left"] == [], report
    assert report["actor_processes_left"] == [], report
    assert report["ray_processes_left"] == [], report
    deadline = time.monotonic() + 60  # the ephemeral Prefect server goes with the driver's exit
    while any(alive(p) for p in spawned) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [(p.pid, p.name()) for p in spawned if alive(p)]
    assert not left, f"processes of the run left: {left}"
