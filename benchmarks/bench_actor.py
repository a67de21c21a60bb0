"""The same train call in a plain process and in the Ray-hosted Policy actor, side by side (issue 45, item 1).

    python -m benchmarks.bench_actor [--quick] [--repeats 6] [--threads 2] [--model builtin:smollm2]

Both sides build the same ``PolicyWorker`` from the same ``PolicyConfig`` (``configs/grpo_smollm2_vs_trl.yaml``'s
policy: float32, one micro-batch of 32, prompt sharing on, ``torch_num_threads``) and train on the same
batch: 8 prompts x 4 samples of random tokens (48 prompt tokens, 4..16 completion tokens, the
completion marked in ``token_mask`` as a rollout's is), an NLL loss, one AdamW step per call.

- **plain process**: a child ``python`` (no Ray in it) running
  :func:`~nrl_tasks.models.policy.workers.in_process.in_process_worker`, driven over a pipe;
- **actor**: ``Policy`` on a one-bundle ``RayVirtualCluster`` of a local Ray started by the project's
  ``init_ray``, exactly as ``nrl`` starts it; timed from the caller (``Policy.train``, batch transfer
  included) and inside the actor (the worker's own ``train``, via ``__ray_call__``).

The calls alternate (process, actor, process, actor, ...) after one warm-up each, so drift of the
machine hits both alike; the medians and the actor/process ratio are printed, with what each
process runs under (niceness, CPU affinity, torch intra/inter-op threads, OpenMP/MKL variables, the
allocator, its thread count), so a difference shows where it comes from. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import torch

from benchmarks._common import quiet_env

#: what a process runs under: the candidates for an actor-vs-process difference
ENV_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME",
            "LD_PRELOAD", "MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "PYTHONMALLOC")


def process_facts() -> dict[str, Any]:
    """What this process runs under (called in each process measured)."""
    import threading

    return {
        "pid": os.getpid(),
        "nice": os.nice(0),
        "affinity": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "main_thread": threading.current_thread() is threading.main_thread(),
        "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
        "libs": sorted({os.path.basename(line.split()[-1]) for line in open("/proc/self/maps")
                        if any(s in line for s in ("jemalloc", "tcmalloc", "libgomp", "libiomp", "libmkl_gnu", "libmkl_intel"))}),
    }


def make_batch(vocab: int, prompts: int = 8, samples: int = 4, prompt_len: int = 48, new: int = 16, seed: int = 0):
    """``prompts x samples`` rows: each prompt repeated ``samples`` times, a random completion of
    4..``new`` tokens after it (``token_mask`` 1 on the completion), right-padded."""
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict

    g = torch.Generator().manual_seed(seed)
    rows, width = prompts * samples, prompt_len + new
    heads = torch.randint(3, vocab, (prompts, prompt_len), generator=g).repeat_interleave(samples, 0)
    tails = torch.randint(3, vocab, (rows, new), generator=g)
    lengths = prompt_len + torch.randint(4, new + 1, (rows,), generator=g)
    ids = torch.cat([heads, tails], 1)
    pos = torch.arange(width).unsqueeze(0)
    valid = pos < lengths.unsqueeze(1)
    ids = torch.where(valid, ids, torch.zeros_like(ids))
    mask = (valid & (pos >= prompt_len)).float()
    return BatchedDataDict({"input_ids": ids, "input_lengths": lengths, "token_mask": mask, "sample_mask": torch.ones(rows)})


def timed_train(worker, batch, loss_fn) -> dict[str, float]:
    """One train call of ``worker`` in this process: wall and CPU seconds, minor page faults,
    voluntary and involuntary context switches (the whole process's, during the call)."""
    import resource

    r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
    worker.train(batch, loss_fn)
    t1, c1, r1 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
    return {"s": t1 - t0, "cpu_s": c1 - c0, "minflt": r1.ru_minflt - r0.ru_minflt,
            "nvcsw": r1.ru_nvcsw - r0.ru_nvcsw, "nivcsw": r1.ru_nivcsw - r0.ru_nivcsw}


def _loss_fn():
    from nrl_tasks.algorithms.loss_functions import NLLLossFn

    return NLLLossFn()


def child(spec_path: str) -> None:
    """The plain process: one in-process worker; a line ``train`` on stdin -> one JSON line of seconds."""
    from safetensors.torch import load_file

    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
    from nrl_tasks.models.policy import PolicyConfig
    from nrl_tasks.models.policy.workers.in_process import in_process_worker

    spec = json.load(open(spec_path))
    cfg = PolicyConfig.model_validate(spec["policy"])
    batch = BatchedDataDict(load_file(spec["batch"]))
    loss_fn = _loss_fn()
    with in_process_worker(cfg) as worker:
        print(json.dumps({"ready": True, "facts": process_facts()}), flush=True)
        for line in sys.stdin:
            if line.strip() != "train":
                break
            print(json.dumps(timed_train(worker, batch, loss_fn)), flush=True)


def _inside(worker, batch, loss_fn) -> dict[str, Any]:
    """Runs in the actor (``__ray_call__``): the worker's own train call, timed there."""
    return {**timed_train(worker, batch, loss_fn), "facts": process_facts()}


class PlainProcess:
    """The child process of :func:`child`, driven over its pipes."""

    def __init__(self, spec_path: str, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_actor", "--child", spec_path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        self.facts = self._read()["facts"]

    def _read(self) -> dict[str, Any]:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the plain process ended (exit {self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def train(self) -> dict[str, float]:
        self.proc.stdin.write("train\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except Exception:  # noqa: BLE001 - a benchmark's child: stopped whatever happened
            self.proc.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny built-in model, 3 calls a side: a smoke run")
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2, help="torch_num_threads on both sides")
    parser.add_argument("--jemalloc", action="store_true",
                        help="also a plain process with jemalloc (Ray's own libjemalloc.so, LD_PRELOAD) instead of glibc malloc")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child)
        return
    quiet_env()
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from flows.config import load_config
    from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster, init_ray
    from nrl_tasks.models.builtin import resolve_model_path
    from nrl_tasks.models.policy.lm_policy import Policy

    model = "builtin:tiny" if args.quick else args.model
    repeats = 3 if args.quick else args.repeats
    cfg = load_config("configs/grpo_smollm2_vs_trl.yaml", overrides=[f"policy.model_name={model}",
                                                                   f"policy.torch_num_threads={args.threads}"])
    pc = cfg.policy_config()
    tok = AutoTokenizer.from_pretrained(resolve_model_path(model))
    batch = make_batch(len(tok))
    work = tempfile.mkdtemp(prefix="bench-actor-")
    save_file({k: v.contiguous() for k, v in batch.items()}, os.path.join(work, "batch.safetensors"))
    spec = os.path.join(work, "spec.json")
    json.dump({"policy": pc.model_dump(mode="json"), "batch": os.path.join(work, "batch.safetensors")}, open(spec, "w"))
    print(f"model {model}, batch {batch.size} rows x {batch['input_ids'].shape[1]} "
          f"({int(batch['input_lengths'].sum())} tokens), {args.threads} threads, {repeats} calls a side, "
          f"load {os.getloadavg()[0]:.2f}")

    import ray

    plain = PlainProcess(spec)
    others = {}
    if args.jemalloc:
        lib = os.path.join(os.path.dirname(ray.__file__), "core", "libjemalloc.so")
        others["plain process, jemalloc"] = PlainProcess(spec, {"LD_PRELOAD": lib})
    init_ray(num_cpus=max(2, os.cpu_count() or 2), temp_dir=tempfile.mkdtemp(prefix="ray-", dir="/tmp"),
             namespace=f"bench-actor-{uuid.uuid4().hex[:6]}")
    cluster = RayVirtualCluster([1], name=f"bench-actor-{uuid.uuid4().hex[:4]}", num_cpus_per_bundle=1.0)
    loss_fn = _loss_fn()
    calls: dict[str, list[dict[str, float]]] = {"plain process": [], **{k: [] for k in others},
                                                "actor, from the caller": [], "actor, inside": []}
    try:
        policy = Policy(cluster, pc, tok, name_prefix="bench_actor")
        worker = policy.worker_group.workers[0]
        batch_ref = ray.put(batch)
        plain.train()  # warm-up of each side
        for proc in others.values():
            proc.train()
        policy.train(batch, loss_fn)
        actor_facts: dict[str, Any] = {}
        for _ in range(repeats):
            calls["plain process"].append(plain.train())
            for name, proc in others.items():
                calls[name].append(proc.train())
            t0 = time.perf_counter()
            policy.train(batch, loss_fn)
            calls["actor, from the caller"].append({"s": time.perf_counter() - t0})
            inside = ray.get(worker.__ray_call__.remote(_inside, batch_ref, loss_fn))
            actor_facts = inside.pop("facts")
            calls["actor, inside"].append(inside)
        policy.shutdown()
    finally:
        for proc in (plain, *others.values()):
            proc.close()
        cluster.shutdown()
        ray.shutdown()

    def med(rows: list[dict[str, float]], key: str) -> str:
        vals = [r[key] for r in rows if key in r]
        return f"{statistics.median(vals):,.3f}".rstrip("0").rstrip(".") if vals else "-"

    base = statistics.median(r["s"] for r in calls["plain process"])
    print("\n| train call (medians) | wall s | min s | max s | vs plain process | CPU s | minor faults | vol. / invol. switches |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, rows in calls.items():
        ts = [r["s"] for r in rows]
        print(f"| {name} | {statistics.median(ts):.3f} | {min(ts):.3f} | {max(ts):.3f} | {statistics.median(ts) / base:.3f}x "
              f"| {med(rows, 'cpu_s')} | {med(rows, 'minflt')} | {med(rows, 'nvcsw')} / {med(rows, 'nivcsw')} |")
    print("\n| runs under | plain process | actor |")
    print("|---|---|---|")
    for key in ("nice", "affinity", "torch_threads", "interop_threads", "os_threads", "main_thread", "env", "libs"):
        print(f"| {key} | {plain.facts.get(key)} | {actor_facts.get(key)} |")
    print(f"\nload at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
