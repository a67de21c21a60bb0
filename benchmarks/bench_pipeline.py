"""Orchestration + persistence overhead of the GRPO flow.

The same GRPO steps (same config, seed and kind of actors) run

(a) through the Prefect flow ``flows.algorithms.grpo.grpo``: one task per stage, every batch persisted as
    Arrow and read back by the next stage, metrics line + artifacts per step;
(b) as a plain Python loop (``flows.algorithms.inmemory.run_in_memory``) calling the same stage functions
    on the same kind of actors with the batches kept in memory.

Prints the median per-stage seconds of both (first step excluded as warm-up), the median step
wall time and the overhead ratio ``(a - b) / b``, and checks that both end with bit-identical
weights (the pipeline is deterministic). Checkpoints and validation are off in both.

The flow runs twice, with ``storage.fsync=true`` (the default: every committed dataset is
durable across a power loss) and ``storage.fsync=false`` (consistent across killed processes
only), and its step time is split into components (``benchmarks/_flow_spans.py``): Prefect
task machinery, save/load of batches, fsyncs, idempotency checks, actor probes, the weights
checksum, the metrics line, actor work and the rest; plus the CPU seconds per step of the flow
process and of its Prefect server subprocess (which competes for the same cores).

``--groupings`` adds the step groupings (issue 29): a subflow a step, the default (a flow run's
steps in at most 4 subflows) and no subflows, each as the whole loop's time per step (subflow
starts and ends included, which per-step medians would hide) against the in-memory loop's.

    python -m benchmarks.bench_pipeline [--quick] [--steps N] [--groupings] [--config PATH] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

from benchmarks._common import quiet_env
from benchmarks._flow_spans import COMPONENTS, FlowSpans

STAGES = ("prompts", "generate", "score", "logprob", "advantages", "train", "refit")


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def run_memory(cfg: Any, steps: int) -> tuple[list[dict[str, Any]], str, float]:
    from flows.algorithms.inmemory import run_in_memory
    from nrl_tasks.run_layout import RunLayout
    from flows.run.runtime import Runtime, load_tokenizer, namespace_for
    from nrl_tasks.stages.data import load_prompt_records

    run_id = f"bench-mem-{os.getpid()}"
    rt = Runtime(
        cfg=cfg, run_id=run_id, layout=RunLayout(cfg.storage.root, run_id), namespace=namespace_for(run_id),
        tokenizer=load_tokenizer(cfg),
    )
    t = time.perf_counter()
    rt.start_policy()
    rt.start_generation()
    setup = time.perf_counter() - t
    try:
        rows = run_in_memory(rt, cfg, steps, load_prompt_records(cfg.data, "train", cfg.grpo.seed))
        checksum = rt.policy.weights_checksum(as_sent=False)
    finally:
        rt.shutdown()
    return rows, checksum, setup


Components = list[dict[str, float]]


def _grpo_with_checksum(cfg: Any, run_id: str) -> tuple[dict[str, Any], str]:
    """The GRPO flow run ``run_id`` (its actors kept), then its final weights' checksum read from
    the kept policy: ``(flow result, checksum)``."""
    from flows.algorithms.grpo import grpo
    from flows.run.runtime import setup_runtime

    os.environ["NRL_KEEP_ACTORS"] = "1"
    try:
        res = grpo(config=cfg, run_id=run_id)
    finally:
        os.environ.pop("NRL_KEEP_ACTORS", None)
    rt = setup_runtime(cfg, run_id)  # attaches to the kept actors
    try:
        return res, rt.policy.weights_checksum(as_sent=False)
    finally:
        rt.shutdown()


def run_flow(cfg: Any, steps: int, tag: str = "") -> tuple[list[dict[str, Any]], str, list[float], Components]:
    """``(metrics rows, final weights checksum, step wall seconds, per-step components)``."""
    from flows.observe.metrics import read_metrics

    with FlowSpans() as spans:
        res, checksum = _grpo_with_checksum(cfg, f"bench-flow{tag}-{os.getpid()}")
    rows = read_metrics(res["metrics_uri"])
    return rows, checksum, res["step_wall_s"], spans.per_step()


#: the step groupings compared by ``--groupings``: label -> config overrides (issue 29, item 3)
GROUPINGS = {
    "a subflow a step (logger.steps_per_subflow=1)": {"steps_per_subflow": 1},
    "default: at most 4 subflows a flow run": {},
    "no subflows (logger.step_subflows=false)": {"step_subflows": False},
}


def run_grouping(cfg: Any, steps: int, logger_update: dict[str, Any], tag: str) -> dict[str, Any]:
    """One flow run with the logger settings ``logger_update``: the whole step loop's seconds per
    step (``loop_s / steps``: what the run pays, subflow starts and ends included), the actor work
    per step, the flow runs it created and the final weights' checksum."""
    from flows.observe.metrics import read_metrics

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    run_id = f"bench-group{tag}-{os.getpid()}"
    res, checksum = _grpo_with_checksum(cfg.model_copy(update={"logger": cfg.logger.model_copy(update=logger_update)}), run_id)
    rows = read_metrics(res["metrics_uri"])
    with get_client(sync_client=True) as client:
        flow_runs = len(client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=run_id)), limit=200))
    return {"loop_per_step": res["loop_s"] / steps, "work_per_step": sum(r.get("compute_s") or 0.0 for r in rows) / steps,
            "flow_runs": flow_runs, "checksum": checksum}


def print_groupings(cfg: Any, steps: int, mem_rows: list[dict[str, Any]], mem_sum: str) -> dict[str, Any]:
    """The flow at each step grouping (:data:`GROUPINGS`) against the in-memory loop, means over all steps."""
    mem = sum(r["step_s"] for r in mem_rows) / steps
    results = {label: run_grouping(cfg, steps, upd, f"-g{i}") for i, (label, upd) in enumerate(GROUPINGS.items())}
    print(f"\n### step grouping: what a step costs, means over all {steps} steps (total loop time / steps)\n")
    print("| grouping | flow runs | s per step | orchestration ms per step (wall - work) | x in-memory loop |")
    print("|---|---:|---:|---:|---:|")
    for label, r in results.items():
        print(f"| {label} | {r['flow_runs']} | {r['loop_per_step']:.4f} | {(r['loop_per_step'] - r['work_per_step']) * 1000:.1f} | "
              f"{r['loop_per_step'] / mem:.2f}x |")
    print(f"| in-memory loop | - | {mem:.4f} | - | 1.00x |")
    same = all(r["checksum"] == mem_sum for r in results.values())
    print(f"\nfinal weights identical (every grouping and the loop): {same}")
    return {label: r["loop_per_step"] / mem for label, r in results.items()}


_BASELINE_DRIVER = """
import json, os, sys
from benchmarks._common import quiet_env
quiet_env(prefect_home=sys.argv[1])
from flows.config import load_config
from flows.run.runtime import connect_ray
from benchmarks.bench_pipeline import run_flow
cfg = load_config(sys.argv[2], json.loads(sys.argv[3]))
os.makedirs(cfg.storage.root, exist_ok=True)
connect_ray(cfg)
rows, checksum, wall, comps = run_flow(cfg, int(sys.argv[4]))
print("BASELINE-JSON " + json.dumps({"wall": wall, "compute": [r.get("compute_s") for r in rows], "checksum": checksum}))
"""


def run_baseline(ref: str, config: str, overrides: list[str], steps: int, tmp: str) -> dict[str, Any]:
    """The same flow run on the code of git ``ref`` (a temporary worktree, its own process and Ray):
    ``{"wall": [step seconds], "compute": [actor seconds], "checksum"}``."""
    import json
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tree = os.path.join(tmp, f"baseline-{ref}")
    subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", "-q", tree, ref], check=True)
    try:
        cfg_path = config if os.path.isabs(config) else os.path.join(repo, config)
        env = {**os.environ, "PYTHONPATH": tree}
        env.pop("PREFECT_HOME", None)
        args = [os.path.join(tmp, "prefect-baseline"), cfg_path, json.dumps(overrides), str(steps)]
        out = subprocess.run([sys.executable, "-c", _BASELINE_DRIVER, *args], cwd=tree, env=env, capture_output=True,
                             text=True, timeout=1800)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BASELINE-JSON ")), None)
        if line is None:
            raise RuntimeError(f"baseline run at {ref} failed:\n{out.stderr[-3000:]}")
        return json.loads(line.split(" ", 1)[1])
    finally:
        subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", tree], check=False)


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.1f}"


def print_breakdown(runs: dict[str, tuple[list[dict[str, Any]], Components]], warm: slice, mem_step: float) -> None:
    """The per-component table: milliseconds per step (medians over the warm steps) of each flow run."""
    med: dict[str, dict[str, float]] = {}
    for label, (rows, comps) in runs.items():
        c = [dict(x, compute=r.get("compute_s") or 0.0) for x, r in zip(comps, rows)][warm]
        m = FlowSpans.medians(c)
        m["rest"] = statistics.median(x["other"] - x["compute"] for x in c)
        m["overhead"] = statistics.median(x["wall"] - x["compute"] for x in c)
        med[label] = m
    labels = list(runs)
    print("\n### where a flow step's time goes (ms per step, medians)\n")
    print("| component | " + " | ".join(labels) + " |")
    print("|---|" + "---:|" * len(labels))
    table = [("**step wall**", "wall"), ("actor + reward work (compute_s)", "compute")]
    table += [(desc, key) for key, desc in COMPONENTS.items()]
    table += [("rest (stage glue, batch assembly, scheduling)", "rest")]
    table += [("**in-run overhead (wall - work)**", "overhead")]
    table += [("CPU of the flow process", "cpu_flow"), ("CPU of its Prefect server subprocess", "cpu_server")]
    for desc, key in table:
        print(f"| {desc} | " + " | ".join(_ms(med[lab].get(key)) for lab in labels) + " |")
    print(f"\nin-memory loop step wall: {mem_step * 1000:.1f} ms")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_pipeline", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 steps of the tiny config (< ~60 s after start-up)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--config", default="configs/grpo_tiny.yaml")
    ap.add_argument(
        "--baseline-ref", default=None,
        help="also run the flow on the code of this git ref (e.g. the commit before a change) and compare",
    )
    ap.add_argument("--groupings", action="store_true",
                    help="also run the flow with a subflow a step, the default grouping and no subflows (means over all steps)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    steps = args.steps or (3 if args.quick else 8)
    tmp = tempfile.mkdtemp(prefix="nrl-bench-pipeline-")
    quiet_env(prefect_home=os.path.join(tmp, "prefect"))

    from flows.config import load_config
    from flows.run.runtime import connect_ray

    overrides = [
        f"grpo.max_num_steps={steps}",
        "grpo.val_period=0",
        "checkpointing.enabled=false",
        "logger.console=false",
        f"storage.root={os.path.join(tmp, 'runs')}",
        *args.overrides,
    ]
    cfg = load_config(args.config, overrides)
    base = None
    if args.baseline_ref:  # before anything of ours starts Ray: the baseline gets the machine alone
        base_over = [o if not o.startswith("storage.root=") else f"storage.root={os.path.join(tmp, 'runs-baseline')}" for o in overrides]
        base = run_baseline(args.baseline_ref, args.config, base_over, steps, tmp)
    os.makedirs(cfg.storage.root, exist_ok=True)
    connect_ray(cfg)
    mem_rows, mem_sum, _ = run_memory(cfg, steps)
    flow_rows, flow_sum, flow_wall, flow_comps = run_flow(cfg, steps)
    nosync = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"fsync": False})})
    ns_rows, ns_sum, ns_wall, ns_comps = run_flow(nosync, steps, tag="-nofsync")

    warm = slice(1, None) if steps > 1 else slice(0, None)
    mem_w, flow_w = mem_rows[warm], flow_rows[warm]
    mem_step = statistics.median(r["step_s"] for r in mem_w)
    flow_step = statistics.median(flow_wall[warm])
    overhead = (flow_step - mem_step) / mem_step
    print(f"\n## bench_pipeline: {args.config}, {steps} steps (medians of steps 2..{steps})\n")
    print("| stage | flow (Prefect + Arrow) s | in-memory loop s |")
    print("|---|---:|---:|")
    for st in STAGES:
        f, m = _median(flow_w, f"{st}_s"), _median(mem_w, f"{st}_s")
        print(f"| {st} | {f if f is None else round(f, 4)} | {m if m is None else round(m, 4)} |")
    print(f"| **step wall** | **{flow_step:.4f}** | **{mem_step:.4f}** |")
    print(f"\noverhead ratio (flow - loop) / loop: **{overhead * 100:.1f}%** ({(flow_step - mem_step) * 1000:.0f} ms per step)")
    # within the flow run itself (robust to load drifting between the two runs on a shared
    # machine): step wall time minus the time spent in actor calls and the reward function
    inner = [w - r["compute_s"] for w, r in zip(flow_wall[warm], flow_w) if r.get("compute_s") is not None]
    if inner:
        in_run = statistics.median(inner)
        comp = statistics.median(r["compute_s"] for r in flow_w if r.get("compute_s") is not None)
        print(
            f"in-run overhead of the flow (step wall - actor/reward time): {in_run * 1000:.0f} ms per step = "
            f"**{100 * in_run / comp:.1f}%** of {comp:.3f} s of work"
        )
    ns_step = statistics.median(ns_wall[warm])
    ns_ratio = 100 * (ns_step - mem_step) / mem_step
    print(f"flow with storage.fsync=false: step wall **{ns_step:.4f}** s, overhead ratio {ns_ratio:.1f}%")
    print_breakdown(
        {"flow, fsync=true (default)": (flow_rows, flow_comps), "flow, fsync=false": (ns_rows, ns_comps)},
        warm,
        mem_step,
    )
    same = flow_sum == mem_sum == ns_sum
    print(f"\nfinal weights identical (flow fsync=true, flow fsync=false, loop): {same} ({flow_sum[:16]})")
    grouping = print_groupings(cfg, steps, mem_rows, mem_sum) if args.groupings else None
    if base is not None:
        b_over = [w - c for w, c in list(zip(base["wall"], base["compute"]))[warm] if c is not None]
        b_in = statistics.median(b_over)
        print("\n### before and after: per-step orchestration overhead (step wall - actor work), ms\n")
        print("| code | overhead ms/step | step wall s |\n|---|---:|---:|")
        print(f"| baseline {args.baseline_ref} | {b_in * 1000:.1f} | {statistics.median(base['wall'][warm]):.4f} |")
        print(f"| this tree | {in_run * 1000:.1f} | {flow_step:.4f} |")
        sub = statistics.median(c["prefect_subflow"] for c in flow_comps[warm])
        print(f"\nchange: {100 * (in_run - b_in) / b_in:+.1f}% ({(in_run - b_in) * 1000:+.1f} ms); of this tree's overhead the "
              f"step subflow (grouping) costs {sub * 1000:.1f} ms per step")
        print(f"baseline final weights identical to this tree's: {base['checksum'] == flow_sum}")
    return {
        "overhead": overhead, "flow_step_s": flow_step, "mem_step_s": mem_step, "identical": same,
        "flow_nofsync_step_s": ns_step, "grouping": grouping,
    }


if __name__ == "__main__":
    main()
