"""Against TRL, side by side: the same task, model, prompts, seeds and budget through TRL's GRPOTrainer and `nrl grpo`.

    python -m benchmarks.bench_vs_trl [--quick] [--same-batch] [--seeds 0 1 2] [--steps 25] [--val 200] [--json F] [key=value ...]
    python -m benchmarks.bench_vs_trl --budget tiny|smollm2|smollm2_fewshot --sweep N     # many seeds, resumable
    python -m benchmarks.bench_vs_trl --budget tiny --systems nrl --seeds K              # rerun one seed
    python -m benchmarks.bench_vs_trl --stats                                            # decisions and plots

Many seeds (``--budget``, issue 44): a budget (``benchmarks/_vs_trl_seeds.py``: config, overrides,
steps, held-out prompts, accuracy every ``val_every`` steps, the tiny model's shared SFT warm start)
runs each seed of each system and appends one JSON line to
``benchmarks/results/bench_vs_trl_seeds.jsonl``; ``--sweep N`` skips the seeds already there, so a
killed sweep resumes at the next seed. The outcome of a seed is deterministic: ``--seeds K`` reruns it
and says whether it reproduces the recorded line. ``--stats`` (also printed after a sweep) turns the
lines into a decision per budget (``benchmarks/_seed_stats.py``: distributions, Mann-Whitney U, a
permutation test, bootstrap intervals, the smallest detectable difference) and two plots
(``benchmarks/_seed_plots.py``: reward per step with its band, accuracy against training seconds).

Not part of CI (minutes per run on 2 cores). For each seed, TRL 1.16's ``GRPOTrainer`` (from its own
venv ``.venv-trl``, built by ``.ci/trl_venv.sh`` when missing, run as ``benchmarks/_trl_driver.py`` in a
subprocess: the project never imports TRL) and this project's ``nrl grpo --config
configs/grpo_smollm2_vs_trl.yaml`` (a subprocess too, so both are measured alike) train
SmolLM2-135M-Instruct (``builtin:smollm2``: the same local folder for both, no download) on
single-digit multiplication with the chat template (SmolLM2's default system line), 16 new tokens,
8 prompts x 4 samples, temperature 1, top-p 1, lr 5e-6 constant, AdamW without weight decay, clip
1.0, KL 0, one optimizer step per batch, TRL's advantage and ``dapo`` loss (the preset's math is held
to TRL's by ``tests/algorithms/test_trl_loss.py``), reward 1 when the first integer of the
completion is the product. TRL gets this project's prompts in this project's order (8 per step,
``shuffle_dataset=False``) and checks that it tokenises them to the same ids.

Reported per system and seed: held-out greedy accuracy before and after (the same ``--val`` prompts),
the training reward per step, the median step time (steps 2..N; ours without the validation) split
into generate / logprob / train / refit / other stages / orchestration for ours and generate / the
rest for TRL, generated tokens per second, peak memory (summed RSS of the system's process tree,
Ray actors and the Prefect server included for ours, sampled every 0.25 s) and the ratios side by side,
with the load average at start and end, and every difference that remains between the two.
``--same-batch``: no training; one step-1 rollout batch of this project's sampler goes through this
project's train path and through TRL's own ``_compute_loss`` (``benchmarks/_trl_same_batch.py``) and
their losses, gradient norms and per-parameter gradient norms are printed side by side (SmolLM2: about
a minute). ``--quick``: the tiny built-in model (``builtin:tiny``, the tests' model kit), 2 steps, 1 seed, 16
held-out prompts: a smoke run, not a result. ``--json F`` writes everything measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks._common import quiet_env
from benchmarks._vs_trl_report import DIFFERENCES, print_report
from benchmarks._vs_trl_seeds import (
    BUDGETS,
    PLOTS,
    RESULTS,
    Budget,
    append_line,
    recorded,
    same_outcome,
    seed_line,
)

CONFIG = "configs/grpo_smollm2_vs_trl.yaml"
TRL_VENV = ".venv-trl"
QUICK = ["policy.model_name=builtin:tiny", "policy.torch_num_threads=1", "generation.torch_num_threads=1"]


class TreeMemory:
    """Peak of the summed RSS of a process and its descendants, sampled on a thread (psutil)."""

    def __init__(self, pid: int, period_s: float = 0.25) -> None:
        import threading

        self.pid, self.period_s = pid, period_s
        self.peak_mb, self.by_name = 0.0, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            total, names = 0.0, {}
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            for p in procs:
                try:
                    rss = p.memory_info().rss / 1e6
                    name = (p.cmdline() or [p.name()])[0].split("/")[-1][:40]
                except psutil.Error:
                    continue
                total += rss
                names[name] = names.get(name, 0.0) + rss
            if total > self.peak_mb:
                self.peak_mb, self.by_name = total, names
            self._stop.wait(self.period_s)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=5)
        top = sorted(self.by_name.items(), key=lambda kv: -kv[1])[:6]
        return {"peak_mb": self.peak_mb, "at_peak_mb": {k: round(v) for k, v in top}}


def run_measured(cmd: list[str], log_path: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd`` with its output in ``log_path``; wall time and tree memory. Raises with the log's tail on failure."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        mem = TreeMemory(proc.pid)
        rc = proc.wait()
    memory = mem.stop()
    if rc != 0:
        tail = open(log_path).read()[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {rc}; the end of {log_path}:\n{tail}")
    return {"wall_s": time.perf_counter() - t0, **memory}


def ensure_trl_venv() -> str:
    python = os.path.join(TRL_VENV, "bin", "python")
    subprocess.run(["bash", ".ci/trl_venv.sh"], check=True)  # idempotent: builds once (~3 min)
    return python


def spec_rows(cfg: Any, tokenizer: Any, records: list[dict[str, str]]) -> list[dict[str, Any]]:
    """``{"prompt", "answer", "ids"}`` per record: the ids are this project's tokenisation of the templated prompt."""
    from nrl_tasks.stages.data import format_prompt, tokenize_prompts

    rows = []
    for r in records:
        text = format_prompt(r["prompt"], cfg.data, tokenizer, max_tokens=cfg.max_prompt_tokens())
        ids, _ = tokenize_prompts([text], tokenizer, max_length=cfg.max_prompt_tokens(), overlong=cfg.data.overlong_prompts)
        rows.append({"prompt": r["prompt"], "answer": r["answer"], "ids": ids[0].tolist(), "text": text})
    return rows


def build_spec(cfg: Any, seed: int, steps: int, val: int, micro_batch: int | None = None, val_every: int = 0) -> dict[str, Any]:
    """The TRL driver's spec: this project's train prompts in its order (steps x 8) and its first ``val`` held-out
    ones; TRL's micro-batch is ours unless ``micro_batch`` says otherwise; held-out accuracy every ``val_every``
    steps too (0: before and after only)."""
    from transformers import AutoTokenizer

    from nrl_tasks.models.builtin import resolve_model_path
    from nrl_tasks.stages.data import load_prompt_records, step_record_indices

    model_dir = resolve_model_path(cfg.policy.model_name)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    g = cfg.grpo
    train = load_prompt_records(cfg.data, "train", seed)
    order = [i for s in range(1, steps + 1) for i in step_record_indices(
        num_records=len(train), step=s, num_prompts=g.num_prompts_per_step, seed=seed, shuffle=cfg.data.shuffle)]
    held_out = load_prompt_records(cfg.data, "val", seed)[:val]
    return {
        "model_dir": model_dir, "seed": seed, "steps": steps, "prompts_per_step": g.num_prompts_per_step,
        "num_generations": g.num_generations_per_prompt, "micro_batch_size": micro_batch or cfg.policy.train_micro_batch_size,
        "max_new_tokens": cfg.gen.max_new_tokens, "temperature": cfg.gen.temperature, "top_p": cfg.gen.top_p,
        "lr": cfg.policy.optimizer.kwargs.lr, "max_grad_norm": cfg.policy.max_grad_norm,
        "threads": cfg.policy.torch_num_threads, "val_batch_size": g.val_batch_size, "chat": cfg.data.chat_template,
        "val_every": val_every,
        "train": spec_rows(cfg, tokenizer, [train[i] for i in order]), "val": spec_rows(cfg, tokenizer, held_out),
    }


def run_trl(python: str, spec: dict[str, Any], work: str) -> dict[str, Any]:
    spec_path, out_path = os.path.join(work, "trl_spec.json"), os.path.join(work, "trl_out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    measured = run_measured([python, "benchmarks/_trl_driver.py", spec_path, out_path], os.path.join(work, "trl.log"))
    out = json.load(open(out_path))
    steps = out["steps"]
    return {
        "val_before": out["val_before"], "val_after": out["val_after"], "responses_after": out["val_responses_after"],
        "rewards": [s["reward"] for s in steps], "step_s": [s["step_s"] for s in steps],
        "split": [{"generate": s["generate_s"], "rest": s["step_s"] - s["generate_s"]} for s in steps],
        "new_tokens": [s["completion_tokens"] for s in steps], "grad_norm": [s["grad_norm"] for s in steps],
        "prompt_order_matches": out["prompt_order_matches"], "token_id_mismatches": out["token_id_mismatches"],
        "config": out["config"], "versions": out["versions"], "curve": out["curve"], **measured,
    }


def run_ours(config: str, overrides: list[str], seed: int, steps: int, val: int, work: str, val_every: int = 0) -> dict[str, Any]:
    import shutil

    import storage
    from flows.observe.metrics import read_metrics

    root, run_id = os.path.join(work, "runs"), f"vs-trl-s{seed}"
    shutil.rmtree(os.path.join(root, run_id), ignore_errors=True)  # a killed earlier attempt is run again whole
    cmd = [sys.executable, "-m", "flows.cli", "grpo", "--config", config, "--storage", root, "--run-id", run_id,
           f"grpo.seed={seed}", f"grpo.max_num_steps={steps}", f"grpo.val_period={val_every or steps}",
           f"grpo.max_val_samples={val}", "grpo.val_at_start=true", "grpo.val_at_end=true", "logger.step_subflows=false",
           *overrides]
    measured = run_measured(cmd, os.path.join(work, "nrl.log"))
    run_uri = os.path.join(root, run_id)
    rows = read_metrics(os.path.join(run_uri, "metrics.jsonl"))

    def val_of(step: int) -> tuple[float | None, list[str]]:
        uri = os.path.join(run_uri, "steps", f"step_{step:06d}", "val")
        if not storage.is_committed(uri):
            return None, []
        b = storage.load_batch(uri)
        greedy = [i for i, m in enumerate(b["mode"]) if m == "greedy"]
        return storage.read_manifest(uri).meta.get("val_accuracy"), [b["response"][i] for i in greedy]

    def f(r: dict[str, Any], k: str) -> float:
        return float(r.get(k) or 0.0)

    split = []
    for r in rows:
        stages = {"generate": f(r, "generate_s"), "logprob": f(r, "logprob_s"), "train": f(r, "train_s"), "refit": f(r, "refit_s")}
        other = f(r, "stages_s") - sum(stages.values())
        split.append({**stages, "other stages": other, "orchestration": f(r, "step_s") - f(r, "stages_s") - f(r, "val_s")})
    prompts_per_step = [list(storage.load_batch(os.path.join(run_uri, "steps", f"step_{s:06d}", "rollouts"))["prompt"])
                        for s in range(1, len(rows) + 1)]
    before, _ = val_of(0)
    after, responses = val_of(steps)
    train_s = [0.0]
    for r in rows:  # training seconds so far, the validations left out (TRL's curve counts the same way)
        train_s.append(train_s[-1] + f(r, "step_s") - f(r, "val_s"))
    curve = [{"step": s, "train_s": train_s[s], "acc": val_of(s)[0]} for s in range(len(rows) + 1)
             if storage.is_committed(os.path.join(run_uri, "steps", f"step_{s:06d}", "val"))]
    return {
        "val_before": before, "val_after": after, "responses_after": responses,
        "rewards": [f(r, "reward_mean") for r in rows], "step_s": [f(r, "step_s") - f(r, "val_s") for r in rows],
        "split": split, "new_tokens": [f(r, "new_tokens") for r in rows], "grad_norm": [r.get("grad_norm") for r in rows],
        "logprob_skipped": all(r.get("logprob_skipped") for r in rows), "prompts_per_step": prompts_per_step,
        "curve": curve, **measured,
    }


def same_batch(python: str, cfg: Any, seed: int, work: str) -> dict[str, Any]:
    """One step-1 rollout batch from this project's sampler, rewarded by the task, through this project's train
    path (the policy worker's forward and normaliser, ``compute_advantages``, ``ClippedPGLossFn``) and through
    TRL's ``_compute_loss`` (``benchmarks/_trl_same_batch.py``): their losses and gradients, side by side."""
    import torch
    from transformers import AutoModelForCausalLM

    from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
    from nrl_tasks.environments.arithmetic import exact_match_reward
    from nrl_tasks.models.generation.hf_sampling import generate_batch
    from nrl_tasks.models.policy.workers.logprobs import padded_forward_logprobs
    from nrl_tasks.stages.advantages import compute_advantages
    from nrl_tasks.stages.train import build_train_data

    torch.set_num_threads(cfg.policy.torch_num_threads)
    spec = build_spec(cfg, seed, 1, 1)
    group, rows = cfg.grpo.num_generations_per_prompt, spec["train"]
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    width = max(len(r["ids"]) for r in rows)
    ids = torch.full((len(rows) * group, width), 0, dtype=torch.long)
    lens = torch.tensor([len(r["ids"]) for r in rows for _ in range(group)])
    for i, r in enumerate(x for x in rows for _ in range(group)):
        ids[i, :len(r["ids"])] = torch.tensor(r["ids"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    out = generate_batch(model, tok, ids, lens, max_new_tokens=cfg.gen.max_new_tokens, temperature=cfg.gen.temperature,
                         top_p=cfg.gen.top_p, seeds=torch.arange(len(lens)))
    n, gen_lens, full = len(lens), out["generation_lengths"], out["output_ids"]
    completions = [full[i, int(lens[i]):int(lens[i]) + int(gen_lens[i])].tolist() for i in range(n)]
    answers = [r["answer"] for r in rows for _ in range(group)]
    rewards = exact_match_reward([""] * n, [tok.decode(c, skip_special_tokens=True) for c in completions], answers)
    if len({tuple(rewards[i:i + group]) for i in range(0, n, group)}) <= 1 or not any(rewards):
        rewards = [float((i % group) < (i // group) % group) for i in range(n)]  # no signal: a mixed pattern instead
    pos = torch.arange(full.shape[1]).unsqueeze(0)
    token_mask = ((pos >= lens.unsqueeze(1)) & (pos < out["unpadded_sequence_lengths"].unsqueeze(1))).float()
    r_t = torch.tensor(rewards)
    adv = compute_advantages(torch.arange(n) // group, r_t, torch.ones(n), cfg.grpo, loss_cfg=cfg.loss_fn)
    data = build_train_data(BatchedDataDict({"input_ids": full, "input_lengths": out["unpadded_sequence_lengths"],
                                             "token_mask": token_mask, "generation_logprobs": out["logprobs"]}), None, adv)
    loss_fn, mbs = ClippedPGLossFn(cfg.loss_fn), cfg.policy.train_micro_batch_size
    toks = (data["token_mask"][:, 1:].double() * data["sample_mask"].double().unsqueeze(1)).sum().float()
    model.train()
    total = 0.0
    for start in range(0, n, mbs):
        mb = data.slice(start, min(start + mbs, n))
        loss, _ = loss_fn(padded_forward_logprobs(model, mb["input_ids"], mb["input_lengths"], cfg.policy.temperature)[:, 1:],
                          mb, data["sample_mask"].sum(), toks)
        loss.backward()
        total += float(loss.detach())
    norms = {name: float(p.grad.double().norm()) for name, p in model.named_parameters() if p.grad is not None}
    ours_path, batch_path = os.path.join(work, "same_batch_ours.pt"), os.path.join(work, "same_batch.json")
    torch.save({"loss": total, "grad_norm": sum(v * v for v in norms.values()) ** 0.5, "param_grad_norms": norms,
                "advantages": adv["advantages"]}, ours_path)
    with open(batch_path, "w") as f:
        json.dump({"model_dir": spec["model_dir"], "prompt_ids": [r["ids"] for r in rows for _ in range(group)],
                   "completion_ids": completions, "rewards": rewards, "group": group, "micro_batch": mbs,
                   "max_new_tokens": cfg.gen.max_new_tokens, "threads": cfg.policy.torch_num_threads,
                   "work": os.path.join(work, "trl-same-batch")}, f)
    done = subprocess.run([python, "benchmarks/_trl_same_batch.py", batch_path, ours_path], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"benchmarks/_trl_same_batch.py exited {done.returncode}:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["completion_lengths"] = [len(c) for c in completions]
    return result


def warm_start_overrides(b: Budget, keep: str) -> list[str]:
    """``policy.model_name=<weights>`` of the budget's SFT warm start, made once under ``keep`` (none: [])."""
    if b.warm_start is None:
        return []
    import shutil

    from flows.algorithms.warm_start import run_sft_warm_start

    steps, lr = b.warm_start
    root, run_id = os.path.join(keep, "warm"), "vs-trl-warm"
    weights = os.path.join(root, run_id, "checkpoints", f"step_{steps:06d}", "weights")
    if not os.path.exists(os.path.join(weights, "model.safetensors")):
        shutil.rmtree(os.path.join(root, run_id), ignore_errors=True)
        print(f"SFT warm start ({steps} steps, lr {lr}) for both systems ...", flush=True)
        weights = run_sft_warm_start(b.config, run_id, steps=steps, storage=root, lr=lr)
    return [f"policy.model_name={weights}"]


def run_seed(system: str, name: str, b: Budget, seed: int, overrides: list[str], python: str, keep: str) -> dict[str, Any]:
    """One seed of one system on budget ``name``: its results line. A TRL run that saw other prompts, or other
    token ids, than ours is an error, not a result."""
    from flows.config import load_config

    work = os.path.join(keep, f"seed{seed}-{system}")
    os.makedirs(work, exist_ok=True)
    if system == "trl":
        cfg = load_config(b.config, [*overrides, f"grpo.seed={seed}", f"grpo.max_num_steps={b.steps}"])
        run = run_trl(python, build_spec(cfg, seed, b.steps, b.val, b.trl_micro_batch, b.val_every), work)
        if not run["prompt_order_matches"] or any(run["token_id_mismatches"].values()):
            raise RuntimeError(f"TRL's run of seed {seed} saw other prompts than ours: prompt order matches "
                               f"{run['prompt_order_matches']}, token id mismatches {run['token_id_mismatches']}")
    else:
        run = run_ours(b.config, overrides, seed, b.steps, b.val, work, b.val_every)
    return seed_line(system, name, seed, b, run)


def run_budget(args: argparse.Namespace) -> None:
    """``--budget``: ``--sweep N`` runs seeds 0..N-1 of each system that the results file lacks and appends their
    lines; ``--seeds K ...`` reruns those seeds, prints their lines and says whether each reproduces the recorded one
    (``--record``: appends them too)."""
    import dataclasses

    b = BUDGETS[args.budget]
    if args.steps:
        b = dataclasses.replace(b, steps=args.steps, val_every=min(b.val_every, args.steps))
    keep = args.keep or os.path.join(tempfile.gettempdir(), f"bench-vs-trl-{args.budget}")  # kept: a rerun resumes
    os.makedirs(keep, exist_ok=True)
    quiet_env(prefect_home=os.path.join(keep, "prefect"))
    os.environ.setdefault("RAY_worker_niceness", "0")
    python = ensure_trl_venv() if "trl" in args.systems else ""
    overrides = [*b.overrides, *warm_start_overrides(b, keep), *args.overrides]
    done = recorded(args.results)
    seeds = list(range(args.sweep)) if args.sweep else (args.seeds or [0])
    for seed in seeds:
        for system in args.systems:
            key = (system, args.budget, seed)
            if args.sweep and key in done:
                continue
            print(f"{args.budget} seed {seed}: {system} ...", flush=True)
            line = run_seed(system, args.budget, b, seed, overrides, python, keep)
            print(json.dumps(line), flush=True)
            if not args.sweep and key in done:
                diff = same_outcome(done[key], line)
                print(f"seed {seed} {system}: " + ("reproduces the recorded line" if not diff else f"differs from the "
                      f"recorded line in {', '.join(diff)}"), flush=True)
            if args.sweep or args.record:
                append_line(args.results, line)
    if args.sweep:
        print_budget_stats(args.results, [args.budget], args.plots)


def print_budget_stats(results: str, budgets: list[str] | None = None, plots: str = PLOTS) -> None:
    """The decision of each budget in ``results`` (markdown) and its two plots under ``benchmarks/plots``."""
    from benchmarks._seed_plots import write_plots
    from benchmarks._seed_stats import markdown_report, read_rows

    rows = read_rows(results)
    for name in budgets or sorted({r["budget"] for r in rows}):
        mine = [r for r in rows if r["budget"] == name]
        if not mine:
            continue
        print(f"\n## {name}: {BUDGETS[name].note if name in BUDGETS else ''}\n")
        print(markdown_report(mine, name))
        print("plots:", ", ".join(write_plots(mine, name, plots)))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 steps, 1 seed, 16 held-out prompts (smoke run)")
    ap.add_argument("--seeds", type=int, nargs="*", default=None, help="default 0 1 2 (--quick: 0)")
    ap.add_argument("--steps", type=int, default=None, help="default 25 (--quick: 2)")
    ap.add_argument("--val", type=int, default=None, help="held-out prompts for the greedy accuracy, default 200 (--quick: 16)")
    ap.add_argument("--systems", nargs="*", default=["trl", "nrl"], choices=["trl", "nrl"])
    ap.add_argument("--same-batch", action="store_true", help="only feed one rollout batch of ours through both "
                    "systems' loss code and compare loss and gradients (seconds; no training)")
    ap.add_argument("--trl-micro-batch", type=int, default=None, help="TRL's per_device_train_batch_size (default: "
                    "ours, policy.train_micro_batch_size); the update is the same whatever the micro-batch")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--keep", default=None, help="keep the runs, logs and TRL specs in this folder")
    ap.add_argument("--budget", choices=sorted(BUDGETS), default=None, help="many seeds on one budget (see "
                    "benchmarks/_vs_trl_seeds.py), results appended to --results")
    ap.add_argument("--sweep", type=int, default=None, help="with --budget: seeds 0..N-1 of each system the results "
                    "file lacks (a killed sweep resumes at the next seed)")
    ap.add_argument("--record", action="store_true", help="with --budget --seeds: append the rerun seeds' lines")
    ap.add_argument("--results", default=RESULTS, help=f"the results file (default {RESULTS})")
    ap.add_argument("--plots", default=PLOTS, help=f"where --stats and --sweep write the plots (default {PLOTS})")
    ap.add_argument("--stats", action="store_true", help="only print each budget's decision from --results and "
                    "write its plots")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of this project's config (the TRL side follows "
                    "the budget keys it reads: batch, tokens, sampling, lr, clip, threads)")
    args = ap.parse_args(argv)
    if args.stats:
        print_budget_stats(args.results, [args.budget] if args.budget else None, args.plots)
        return {}
    if args.budget:
        run_budget(args)
        return {}
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    steps = args.steps or (2 if args.quick else 25)
    val = args.val or (16 if args.quick else 200)
    overrides = [*(QUICK if args.quick else []), *args.overrides]
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} ({os.cpu_count()} CPUs)", flush=True)

    keep = args.keep or tempfile.mkdtemp(prefix="bench-vs-trl-")
    os.makedirs(keep, exist_ok=True)
    quiet_env(prefect_home=os.path.join(keep, "prefect"))
    os.environ.setdefault("RAY_worker_niceness", "0")
    from flows.config import load_config

    python = ensure_trl_venv() if "trl" in args.systems or args.same_batch else ""
    if args.same_batch:
        cfg = load_config(CONFIG, [*overrides, f"grpo.seed={seeds[0]}"])
        check = same_batch(python, cfg, seeds[0], keep)
        print("same batch through both systems' loss code:", json.dumps(check))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(check, fh, indent=1)
        return check
    results: dict[str, Any] = {"seeds": seeds, "steps": steps, "val": val, "config": CONFIG, "overrides": overrides,
                               "runs": {}, "differences": list(DIFFERENCES)}
    for seed in seeds:
        cfg = load_config(CONFIG, [*overrides, f"grpo.seed={seed}", f"grpo.max_num_steps={steps}"])
        spec = build_spec(cfg, seed, steps, val, args.trl_micro_batch)
        if spec["micro_batch_size"] != cfg.policy.train_micro_batch_size and seed == seeds[0]:
            results["differences"].append(
                f"micro-batch: TRL {spec['micro_batch_size']} rows (--trl-micro-batch), ours "
                f"{cfg.policy.train_micro_batch_size}: the same update (a sum over the batch's tokens / their count), "
                "other speed")
        work = os.path.join(keep, f"seed{seed}")
        os.makedirs(work, exist_ok=True)
        runs: dict[str, Any] = {}
        if "trl" in args.systems:
            print(f"seed {seed}: TRL GRPOTrainer ...", flush=True)
            runs["trl"] = run_trl(python, spec, work)
        if "nrl" in args.systems:
            print(f"seed {seed}: nrl grpo ...", flush=True)
            runs["nrl"] = run_ours(CONFIG, overrides, seed, steps, val, work)
            runs["nrl"].pop("curve")
            sent = [[r["text"]] * cfg.grpo.num_generations_per_prompt for r in spec["train"]]
            expected = [[t for group in sent[i:i + cfg.grpo.num_prompts_per_step] for t in group]
                        for i in range(0, len(sent), cfg.grpo.num_prompts_per_step)]
            runs["nrl"]["prompt_order_matches"] = runs["nrl"].pop("prompts_per_step") == expected
        results["runs"][seed] = runs
        if args.json:  # after every seed: a long run killed late keeps what it measured
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=1, default=str)
    load_end = os.getloadavg()
    results["load_average"] = {"start": load_start, "end": load_end}
    print_report(results)
    print(f"load average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}; runs and logs in {keep}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    return results


if __name__ == "__main__":
    main()
