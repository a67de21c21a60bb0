"""Benchmark the Ray-hosted ``Policy``: logprobs, training and generation throughput, refit time.

Run from the repo root: ``python -m benchmarks.bench_policy [--quick]``.

Model: a tiny Llama from :mod:`nrl_tasks.models.tiny` (``--quick``: hidden 64, 2 layers,
~0.1 M parameters; else hidden 256, 4 layers, ~3.3 M), fp32, one torch thread per worker.
Workload: ``rows`` right-padded sequences of random tokens, lengths between ``width / 2`` and
``width``. Figures are tokens per second (valid tokens for logprobs/train, generated tokens for
generate), best of ``repeats`` timed calls after one warm-up.

Baseline: the same computation in this process without Ray (``padded_forward_logprobs`` over
the same micro-batches; forward+backward+AdamW for train; ``generate_batch`` for generate), so
``vs local`` shows the Ray dispatch/serialisation overhead (DP=1) and the data-parallel gain
(DP=2, two workers on two cores). Refit: a DP=1 policy streams its weights into one ``hf``
generation worker (``HfGeneration``): the full sequence (refit info + fingerprint check, group
creation, packed broadcast) and a broadcast over an existing group.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid

import torch

from benchmarks._common import best_of, quiet_env


def make_batch(rows: int, width: int, vocab: int, seed: int = 0):
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=g)
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    valid = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    ids = torch.where(valid, ids, torch.zeros_like(ids))
    return BatchedDataDict(
        {"input_ids": ids, "input_lengths": lengths, "token_mask": valid.float(), "sample_mask": torch.ones(rows)}
    )


def local_baselines(model_dir: str, batch, mbs: int, new_tokens: int, repeats: int) -> dict[str, float]:
    """Tokens/s of the same work in this process, one thread, no Ray."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nrl_tasks.algorithms.loss_functions import NLLLossFn
    from nrl_tasks.models.generation.hf_sampling import generate_batch
    from nrl_tasks.models.policy.workers.logprobs import padded_forward_logprobs

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(model_dir)
        ids, lengths = batch["input_ids"], batch["input_lengths"]
        tokens = float(lengths.sum())

        @torch.no_grad()
        def logprobs():
            model.eval()
            for s in range(0, ids.shape[0], mbs):
                padded_forward_logprobs(model, ids[s : s + mbs], lengths[s : s + mbs])

        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        loss_fn = NLLLossFn()
        n_valid = batch["token_mask"][:, 1:].sum()

        def train():
            model.train()
            opt.zero_grad()
            for s in range(0, ids.shape[0], mbs):
                mb = batch.slice(s, min(s + mbs, ids.shape[0]))
                lp = padded_forward_logprobs(model, mb["input_ids"], mb["input_lengths"])
                loss, _ = loss_fn(lp[:, 1:], mb, torch.tensor(float(ids.shape[0])), n_valid)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        prompts = ids[:, : ids.shape[1] // 2]
        prompt_lengths = torch.minimum(lengths, torch.tensor(prompts.shape[1]))

        def generate():
            out = generate_batch(model, tok, prompts, prompt_lengths, max_new_tokens=new_tokens, ignore_eos=True,
                                 seeds=torch.arange(prompts.shape[0]))
            return float(out["generation_lengths"].sum())

        logprobs()
        t_lp, _ = best_of(logprobs, repeats)
        train()
        t_tr, _ = best_of(train, repeats)
        generate()
        t_gen, n_gen = best_of(generate, repeats)
        return {"get_logprobs": tokens / t_lp, "train": tokens / t_tr, "generate": n_gen / t_gen}
    finally:
        torch.set_num_threads(threads)


def policy_figures(policy, batch, repeats: int) -> dict[str, float]:
    from nrl_tasks.algorithms.loss_functions import NLLLossFn
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict

    tokens = float(batch["input_lengths"].sum())
    policy.get_logprobs(batch)
    t_lp, _ = best_of(lambda: policy.get_logprobs(batch), repeats)
    loss_fn = NLLLossFn()
    policy.train(batch, loss_fn)
    t_tr, _ = best_of(lambda: policy.train(batch, loss_fn), repeats)
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    prompts = ids[:, : ids.shape[1] // 2].contiguous()
    gen_in = BatchedDataDict(
        {
            "input_ids": prompts,
            "input_lengths": torch.minimum(lengths, torch.tensor(prompts.shape[1])),
            "seeds": torch.arange(prompts.shape[0]),
        }
    )
    policy.generate(gen_in)
    t_gen, out = best_of(lambda: policy.generate(gen_in), repeats)
    n_gen = float(out["generation_lengths"].sum())
    return {"get_logprobs": tokens / t_lp, "train": tokens / t_tr, "generate": n_gen / t_gen}


def refit_figures(policy, cluster_name: str, model_dir: str, gen_cfg: dict, repeats: int) -> dict[str, float] | str:
    """Seconds of a full refit (info, group, broadcast) and of a broadcast over a live group."""
    try:
        from nrl_tasks.models.generation.hf_generation import HfGeneration
    except ImportError as exc:  # the generation helper's module
        return f"skipped: nrl_tasks.models.generation.hf_generation not importable ({exc})"
    import ray

    from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster
    from nrl_tasks.utils.collective import find_free_port, get_node_ip
    from nrl_tasks.utils.refit import RefitInfo

    cluster = RayVirtualCluster([1], name=cluster_name, num_cpus_per_bundle=0.5)
    gen = HfGeneration(cluster, {**gen_cfg, "model_name": model_dir, "num_cpus_per_worker": 0.5},
                       namespace=policy.namespace, name_prefix=f"generation-{uuid.uuid4().hex[:4]}")
    try:
        def full() -> None:
            info = policy.prepare_refit_info()
            gen.prepare_refit_info(info)
            ip, port = get_node_ip(), find_free_port()
            ray.get(policy.init_collective(ip, port, 1 + gen.world_size, train_world_size=1)
                    + gen.init_collective(ip, port, 1 + gen.world_size, rank_offset=1))
            ray.get(policy.broadcast_weights_for_collective()
                    + gen.update_weights_from_collective(policy.weights_version))

        def stream() -> None:
            ray.get(policy.broadcast_weights_for_collective()
                    + gen.update_weights_from_collective(policy.weights_version))

        full()
        assert gen.weights_checksum() == policy.weights_checksum(), "refit did not deliver identical weights"
        times_full = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            full()
            times_full.append(time.perf_counter() - t0)
        t_stream, _ = best_of(stream, repeats)
        nbytes = RefitInfo.from_dict(policy.prepare_refit_info()).total_bytes
        return {"full_s": min(times_full), "full_median_s": statistics.median(times_full), "stream_s": t_stream,
                "bytes": float(nbytes)}
    finally:
        gen.shutdown()
        cluster.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, < ~60 s")
    args = parser.parse_args(argv)
    quiet_env()
    if args.quick:
        size = dict(hidden_size=64, num_layers=2, intermediate_size=128)
        rows, width, mbs, new, repeats = 32, 64, 8, 16, 2
    else:
        size = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512)
        rows, width, mbs, new, repeats = 64, 128, 8, 32, 3

    import ray
    from transformers import AutoTokenizer

    from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster, init_ray
    from nrl_tasks.models.policy import PolicyConfig
    from nrl_tasks.models.policy.lm_policy import Policy
    from nrl_tasks.models.tiny import build_tiny_model

    t_start = time.perf_counter()
    work = tempfile.mkdtemp(prefix="bench-policy-")
    model_dir = build_tiny_model(os.path.join(work, "model"), seed=0, max_position_embeddings=max(256, 2 * width), **size)
    tok = AutoTokenizer.from_pretrained(model_dir)
    n_params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    batch = make_batch(rows, width, vocab=len(tok))
    print(f"model: {n_params / 1e6:.2f} M params; batch {rows} x {width} (valid tokens {int(batch['input_lengths'].sum())}), "
          f"mbs {mbs}, {new} new tokens per row, best of {repeats}")
    local = local_baselines(model_dir, batch, mbs, new, repeats)
    print("local (no Ray, 1 thread): " + ", ".join(f"{k} {v:,.0f} tok/s" for k, v in local.items()))

    init_ray(num_cpus=8, temp_dir=tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    gen_cfg = {"max_new_tokens": new, "ignore_eos": True, "temperature": 1.0}
    results: dict[int, dict[str, float]] = {}
    refit: dict[str, float] | str = "not run"
    namespace = f"nrl-bench-{uuid.uuid4().hex[:6]}"
    try:
        for dp in (1, 2):
            cfg = PolicyConfig(
                model_name=model_dir, train_global_batch_size=rows, train_micro_batch_size=mbs, logprob_batch_size=mbs,
                max_total_sequence_length=width, generation=gen_cfg, num_cpus_per_worker=1.0,
            )
            cluster = RayVirtualCluster([dp], name=f"bench-dp{dp}-{uuid.uuid4().hex[:4]}", num_cpus_per_bundle=1.0)
            t0 = time.perf_counter()
            policy = Policy(cluster, cfg, tok, name_prefix=f"bench-dp{dp}", namespace=namespace)
            print(f"DP={dp}: policy up in {time.perf_counter() - t0:.1f} s")
            try:
                results[dp] = policy_figures(policy, batch, repeats)
                print(f"DP={dp}: " + ", ".join(f"{k} {v:,.0f} tok/s" for k, v in results[dp].items()))
                if dp == 1:
                    refit = refit_figures(policy, f"bench-gen-{uuid.uuid4().hex[:4]}", model_dir, gen_cfg, repeats)
                    print(f"refit: {refit}")
            finally:
                policy.shutdown()
                cluster.shutdown()
    finally:
        ray.shutdown()

    print()
    print("| operation | local tok/s (baseline) | DP=1 tok/s | DP=1 vs local | DP=2 tok/s | DP=2 vs local | DP=2 / DP=1 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for op in ("get_logprobs", "train", "generate"):
        one, two = results[1][op], results[2][op]
        print(f"| {op} | {local[op]:,.0f} | {one:,.0f} | {one / local[op]:.2f}x | {two:,.0f} | {two / local[op]:.2f}x | {two / one:.2f}x |")
    if isinstance(refit, dict):
        mb = refit["bytes"] / 1e6
        print(f"| refit to 1 hf worker, full (info + group + broadcast), {mb:.2f} MB | | {refit['full_s'] * 1e3:.0f} ms "
              f"(median {refit['full_median_s'] * 1e3:.0f} ms) | | | | |")
        print(f"| refit, broadcast over a live group, {mb:.2f} MB | | {refit['stream_s'] * 1e3:.1f} ms "
              f"({mb / refit['stream_s']:.0f} MB/s) | | | | |")
    else:
        print(f"| refit | {refit} | | | | | |")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
