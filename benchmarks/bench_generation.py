"""Benchmark the ``hf`` generation backend: the KV-cache decode loop and a worker refit.

Run from the repo root: ``python -m benchmarks.bench_generation [--quick]``.

Model: a tiny Llama from :mod:`nrl_tasks.models.tiny` (``--quick``: hidden 64, 2 layers; else
hidden 256, 4 layers, ~3 M parameters), fp32, one torch thread. Workload: ``batch`` prompts of
the arithmetic template (different lengths, so left padding matters), ``new`` tokens each with
EOS ignored (every row decodes the full length). Compares, as generated tokens per second:

* Hugging Face ``model.generate`` (left-padded batch, its own KV cache): the baseline;
* :func:`~nrl_tasks.models.generation.hf_sampling.generate_batch` greedy, sampled with one
  shared generator, and sampled with per-row seeds (one ``torch.Generator`` per row);
* the same with ragged stops (a frequent token as stop id: rows finish at different steps).

Then one refit of an in-process :class:`HfGenerationWorker` over a 2-rank gloo group (the
producer in a thread), against ``load_state_dict`` of the same tensors (copy-only floor).
Prints a markdown table at the end.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from benchmarks._common import best_of, quiet_env


def make_prompts(tokenizer, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    from nrl_tasks.environments.arithmetic import make_arithmetic_prompts

    lead = ["", "Please answer. ", "Think step by step and give the final answer. "]
    rows = [tokenizer.encode(lead[i % 3] + p["prompt"]) for i, p in enumerate(make_arithmetic_prompts(batch, seed=0))]
    width = max(map(len, rows))
    ids = torch.full((batch, width), tokenizer.pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    return ids, torch.tensor([len(r) for r in rows])


def hf_generate(model, tokenizer, ids, lengths, new: int, sample: bool) -> int:
    width = int(lengths.max())
    left = torch.full((ids.shape[0], width), tokenizer.pad_token_id)
    mask = torch.zeros_like(left)
    for i, n in enumerate(lengths.tolist()):
        left[i, width - n :] = ids[i, :n]
        mask[i, width - n :] = 1
    kw = dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0) if sample else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(input_ids=left, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             pad_token_id=tokenizer.pad_token_id, **kw)
    return int((out.shape[1] - width) * ids.shape[0])


def bench_refit(model_dir: str, repeats: int) -> dict[str, float]:
    from nrl_tasks.models.generation.hf_worker import HfGenerationWorker, hf_refit_named_tensors
    from nrl_tasks.utils.collective import create_broadcast_group, find_free_port
    from nrl_tasks.utils.packed_tensor import packed_broadcast_producer
    from nrl_tasks.utils.refit import RefitInfo

    worker = HfGenerationWorker({"model_name": model_dir})
    named = [(n, t.clone()) for n, t in hf_refit_named_tensors(worker.model)]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    size = 4 * 1024 * 1024
    worker.prepare_refit_info(RefitInfo.build(named, size, 1).to_dict())
    best = float("inf")
    for version in range(1, repeats + 1):
        port = find_free_port()
        box: dict[str, object] = {}
        joiner = threading.Thread(
            target=lambda box=box, port=port: box.setdefault("g", create_broadcast_group("127.0.0.1", port, 0, 2))
        )
        joiner.start()
        worker.init_collective("127.0.0.1", port, 2, 1)
        joiner.join()
        group = box["g"]
        sender = threading.Thread(
            target=packed_broadcast_producer, args=(iter(named), group, 0, lambda item: item[1]),
            kwargs={"buffer_size_bytes": size},
        )
        t0 = time.perf_counter()
        sender.start()
        worker.update_weights_from_collective(version)
        sender.join()
        best = min(best, time.perf_counter() - t0)
        group.close()
        worker.teardown_collective()
    state = dict(named)
    copy_s, _ = best_of(lambda: worker.model.load_state_dict(state, strict=False), repeats)
    return {"bytes": nbytes, "refit_s": best, "copy_s": copy_s}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, small batch (< 60 s)")
    args = parser.parse_args(argv)
    quiet_env()
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nrl_tasks.models.generation.hf_sampling import generate_batch
    from nrl_tasks.models.tiny import build_tiny_model

    if args.quick:
        batch, new, repeats, shape = 16, 32, 2, dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                                     intermediate_size=128)
    else:
        batch, new, repeats, shape = 32, 64, 3, dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                                                     intermediate_size=1024)
    tmp = tempfile.mkdtemp(prefix="bench-gen-")
    model_dir = build_tiny_model(tmp, seed=0, **shape)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids, lengths = make_prompts(tok, batch)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f} M params; batch {batch} x {new} new tokens; prompts {lengths.min()}-{lengths.max()} tokens")

    # a frequent token as stop id gives ragged stops
    probe = generate_batch(model, tok, ids, lengths, max_new_tokens=new, greedy=False, ignore_eos=True,
                           seeds=torch.arange(batch))
    gen_tokens = torch.cat([probe["output_ids"][i, int(lengths[i]):] for i in range(batch)])
    frequent = int(torch.mode(gen_tokens[gen_tokens != tok.pad_token_id]).values)

    seeds = torch.arange(batch) + 1
    shared = torch.Generator().manual_seed(0)
    cases: list[tuple[str, Callable[[], int]]] = [
        ("HF generate, greedy (baseline)", lambda: hf_generate(model, tok, ids, lengths, new, False)),
        ("HF generate, sampled (baseline)", lambda: hf_generate(model, tok, ids, lengths, new, True)),
        ("generate_batch, greedy", lambda: int(generate_batch(
            model, tok, ids, lengths, max_new_tokens=new, greedy=True, ignore_eos=True)["generation_lengths"].sum())),
        ("generate_batch, sampled, shared generator", lambda: int(generate_batch(
            model, tok, ids, lengths, max_new_tokens=new, ignore_eos=True, generator=shared)["generation_lengths"].sum())),
        ("generate_batch, sampled, per-row seeds", lambda: int(generate_batch(
            model, tok, ids, lengths, max_new_tokens=new, ignore_eos=True, seeds=seeds)["generation_lengths"].sum())),
        ("generate_batch, per-row seeds, ragged stops", lambda: int(generate_batch(
            model, tok, ids, lengths, max_new_tokens=new, ignore_eos=True, seeds=seeds,
            stop_token_ids=[frequent])["generation_lengths"].sum())),
    ]
    rows = []
    for name, fn in cases:
        fn()  # warm-up
        secs, tokens = best_of(fn, repeats)
        rows.append((name, int(tokens), secs, int(tokens) / secs))
        print(f"{name}: {int(tokens)} tokens in {secs:.3f} s = {int(tokens) / secs:,.0f} tok/s", flush=True)
    base = {"greedy": rows[0][3], "sampled": rows[1][3]}

    refit = bench_refit(model_dir, repeats)
    print(f"refit: {refit['bytes'] / 1e6:.2f} MB in {refit['refit_s'] * 1e3:.1f} ms; load_state_dict {refit['copy_s'] * 1e3:.1f} ms")

    print("\n| workload | tokens | seconds | tokens/s | vs HF generate |")
    print("|---|---:|---:|---:|---:|")
    for name, tokens, secs, tps in rows:
        ref = base["greedy"] if "greedy" in name else base["sampled"]
        print(f"| {name} | {tokens} | {secs:.3f} | {tps:,.0f} | {tps / ref:.2f}x |")
    print("\n| refit (in-process worker, gloo, 2 ranks) | MB | ms | MB/s | vs load_state_dict |")
    print("|---|---:|---:|---:|---:|")
    mb = refit["bytes"] / 1e6
    print(f"| packed broadcast + copy into model | {mb:.2f} | {refit['refit_s'] * 1e3:.1f} | "
          f"{mb / refit['refit_s']:,.0f} | {refit['copy_s'] / refit['refit_s']:.2f}x |")


if __name__ == "__main__":
    main()
