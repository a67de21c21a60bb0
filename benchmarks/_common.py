"""Shared set-up of the ``bench_*`` benchmarks: a quiet, offline environment and best-of timing."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any


def quiet_env(prefect_home: str | None = None) -> None:
    """Default the environment to quiet and offline; call before Prefect, Ray or HF are imported.

    The ``nrl`` CLI's defaults (no Prefect analytics, no Ray usage stats, no tokenizer
    threads, HF hub offline, patient ephemeral Prefect server) plus Prefect logs at WARNING
    and Ray token auth off. ``prefect_home``: where Prefect keeps its state (e.g. a temp dir).
    Only unset variables are changed.
    """
    from flows.cli import _quiet_env

    if prefect_home is not None:
        os.environ.setdefault("PREFECT_HOME", prefect_home)
    _quiet_env()
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def best_of(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """``(fastest wall seconds of repeats calls of fn, the last call's result)``."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def smollm2_available() -> bool:
    """Whether ``builtin:smollm2`` resolves (the offline SmolLM2-135M package, ``make smollm2``)."""
    from nrl_tasks.models.builtin import resolve_model_path

    try:
        resolve_model_path("builtin:smollm2")  # converted once from the offline package
        return True
    except Exception:  # noqa: BLE001 - the package is optional: reported, not fatal
        return False


def val_accuracy(root: str, run_id: str, step: int) -> float | None:
    """The held-out accuracy recorded by the validation at ``step`` of a run (``None``: none committed)."""
    import storage

    uri = os.path.join(root, run_id, "steps", f"step_{step:06d}", "val")
    if not storage.is_committed(uri):
        return None
    return storage.read_manifest(uri).meta.get("val_accuracy")


#: SmolLM2-135M's architecture (its HF config), for the random-weight stand-in.
SMOLLM2_SHAPES = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def build_stand_in(out_dir: str, seed: int = 0) -> str:
    """A random-weight ``LlamaForCausalLM`` of SmolLM2-135M's shapes + the tiny tokenizer, saved to ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from nrl_tasks.models.tiny import build_tiny_tokenizer

    hf_logging.disable_progress_bar()  # no "Writing model shards" bars in the benchmark's output
    tok = build_tiny_tokenizer()
    config = LlamaConfig(**SMOLLM2_SHAPES, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def peak_rss_mb(pid: int) -> dict[str, float]:
    """``{"peak": VmHWM, "now": VmRSS}`` of process ``pid`` in MB (10^6 bytes)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out["peak" if key == "VmHWM" else "now"] = int(value.split()[0]) * 1024 / 1e6
    return out
