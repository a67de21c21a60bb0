"""Policy checks of ``benchmarks.gpu_check``: ``PolicyWorker`` and ``HfGenerationWorker`` without Ray.

Each worker is instantiated directly in this process as a single rank (its default process
group has one member: NCCL on GPU, gloo on CPU). References are CPU float32: the same
``padded_forward_logprobs`` the worker uses, on a CPU copy of the model. ``bfloat16`` means
what the config means: float32 master weights under autocast for ``PolicyWorker`` (its
``generate`` runs without autocast, so on the master weights), bf16 weights for the generation
worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._gpu_check_report import Row, timed, verdict
from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.models.policy import PolicyConfig
from nrl_tasks.models.policy.workers.logprobs import padded_forward_logprobs
from nrl_tasks.models.policy.workers.in_process import in_process_worker
from nrl_tasks.models.policy.workers.train_worker import PolicyWorker

#: Max abs logprob difference to the CPU float32 reference: full forward / KV-cache generation.
LOGPROB_TOL = {"float32": 1e-4, "bfloat16": 5e-2}
GENERATION_TOL = {"float32": 1e-3, "bfloat16": 5e-2}
#: Generation worker in bf16 *weights* (not autocast): rounding of every weight and activation.
HF_GENERATION_TOL = {"float32": 1e-3, "bfloat16": 1.5e-1}
#: Abs difference of the first GRPO train loss (clipped PG + KL) to the one on CPU reference logprobs.
LOSS_TOL = {"float32": 1e-4, "bfloat16": 5e-2}
PRECISIONS = ("float32", "bfloat16")
GRPO_LOSS = {"reference_policy_kl_penalty": 0.05}
VOCAB_LOW = 3  # token ids below are special (pad, bos, eos)


@dataclass(frozen=True)
class ModelCase:
    """A locally built model folder and the batch sizes to check it with."""

    name: str
    path: str
    rows: int
    width: int
    gen_rows: int
    new_tokens: int


def build_models(out: Path, gpu: bool) -> list[ModelCase]:
    """The tiny kit model; on GPU also a ~100M-parameter Llama (random init, tiny tokenizer)."""
    from nrl_tasks.models.tiny import build_tiny_model

    tiny = build_tiny_model(out / "tiny", seed=0)
    cases = [ModelCase("tiny", tiny, rows=16 if gpu else 8, width=64 if gpu else 32, gen_rows=8 if gpu else 4,
                       new_tokens=32 if gpu else 8)]
    if gpu:
        big = build_tiny_model(out / "llama-100m", seed=0, hidden_size=768, num_layers=16, num_heads=12,
                               num_kv_heads=4, intermediate_size=2048, max_position_embeddings=1024)
        cases.append(ModelCase("llama-100m", big, rows=16, width=128, gen_rows=8, new_tokens=32))
    return cases


def make_batch(case: ModelCase, vocab: int, seed: int = 0) -> BatchedDataDict:
    """Right-padded ``input_ids`` of varied lengths with their masks (prompt: first 4 tokens)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(case.width // 2, case.width + 1, (case.rows,), generator=g)
    positions = torch.arange(case.width).unsqueeze(0)
    valid = positions < lengths.unsqueeze(1)
    ids = torch.where(valid, torch.randint(VOCAB_LOW, vocab, (case.rows, case.width), generator=g), 0)
    return BatchedDataDict({
        "input_ids": ids, "input_lengths": lengths,
        "token_mask": (valid & (positions >= 4)).float(), "sample_mask": torch.ones(case.rows),
    })


def add_grpo_inputs(batch: BatchedDataDict, reference: torch.Tensor, seed: int = 0) -> None:
    """On-policy GRPO loss inputs: previous and generation logprobs are the reference ones."""
    g = torch.Generator().manual_seed(seed)
    rows, width = batch["input_ids"].shape
    batch["advantages"] = torch.randn(rows, generator=g).unsqueeze(1).expand(rows, width).contiguous()
    batch["prev_logprobs"] = reference.clone()
    batch["generation_logprobs"] = reference.clone()
    batch["reference_policy_logprobs"] = reference + 0.05 * (reference != 0)


class CpuReference:
    """CPU float32 copy of a model folder; logprobs in the worker's layout."""

    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
        self.vocab = int(self.model.config.vocab_size)

    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @torch.no_grad()
    def logprobs(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return padded_forward_logprobs(self.model, ids, lengths).float()


def grpo_loss(batch: BatchedDataDict, logprobs: torch.Tensor) -> float:
    """The clipped-PG loss of the whole batch at ``logprobs`` (global token and sequence counts)."""
    token_mask, sample_mask = batch["token_mask"], batch["sample_mask"]
    toks = (token_mask[:, 1:] * sample_mask.unsqueeze(1)).sum()
    loss, _ = ClippedPGLossFn(GRPO_LOSS)(logprobs[:, 1:], batch, sample_mask.sum(), toks)
    return float(loss)


def policy_config(case: ModelCase, precision: str, profiler_dir: Path) -> PolicyConfig:
    return PolicyConfig(
        model_name=case.path, precision=precision, train_global_batch_size=case.rows,
        train_micro_batch_size=max(1, case.rows // 2), max_total_sequence_length=case.width + case.new_tokens,
        optimizer={"kwargs": {"lr": 1e-4}}, torch_num_threads=min(8, os.cpu_count() or 1),
        generation={"max_new_tokens": case.new_tokens, "ignore_eos": True, "pad_token_id": 0},
        profiler_dir=str(profiler_dir),
    )


def policy_worker(cfg: PolicyConfig) -> contextlib.AbstractContextManager[PolicyWorker]:
    """A set-up one-rank ``PolicyWorker``; process-wide torch settings it changes are restored."""
    return in_process_worker(cfg)


def release_memory() -> None:
    """Collect the last worker's cycles and return cached CUDA blocks (call once it is unreferenced)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a.float() - b.float()).abs() * mask).max()) if bool(mask.any()) else 0.0


def generated_mask(out: BatchedDataDict | dict[str, torch.Tensor], prompt_lengths: torch.Tensor) -> torch.Tensor:
    width = out["output_ids"].shape[1]
    positions = torch.arange(width).unsqueeze(0)
    return (positions >= prompt_lengths.unsqueeze(1)) & (positions < out["unpadded_sequence_lengths"].unsqueeze(1))


# ---------------------------------------------------------------------------------------------
# The checks


def check_logprobs(worker: PolicyWorker, batch: BatchedDataDict, reference: torch.Tensor, where: str) -> Row:
    precision = worker.cfg.precision
    lp = worker.get_logprobs(batch)["logprobs"]  # warm-up and the compared result
    seconds = timed(worker.device, lambda: worker.get_logprobs(batch))
    diff = max_diff(lp, reference, reference != 0)
    tokens = int(batch["input_lengths"].sum())
    ok = diff <= LOGPROB_TOL[precision] and bool(torch.isfinite(lp).all())
    return Row("PolicyWorker.get_logprobs", where, verdict(ok),
               f"max abs diff {diff:.2e} (tol {LOGPROB_TOL[precision]:g}) vs CPU fp32; {tokens / seconds:,.0f} tok/s")


def prompts(batch: BatchedDataDict, case: ModelCase) -> BatchedDataDict:
    lengths = batch["input_lengths"][: case.gen_rows].clamp(max=case.width // 2)
    return BatchedDataDict({"input_ids": batch["input_ids"][: case.gen_rows, : case.width // 2].clone(),
                            "input_lengths": lengths})


def case_inputs(case: ModelCase) -> tuple[CpuReference, BatchedDataDict, torch.Tensor, BatchedDataDict, str]:
    """What every check of one model uses: its CPU fp32 reference, a GRPO batch with inputs from
    that reference, the reference logprobs, the prompts and a size label such as ``tiny (0.1M)``."""
    ref = CpuReference(case.path)
    batch = make_batch(case, ref.vocab)
    reference = ref.logprobs(batch["input_ids"], batch["input_lengths"])
    add_grpo_inputs(batch, reference)
    return ref, batch, reference, prompts(batch, case), f"{case.name} ({ref.parameters() / 1e6:.1f}M)"


def _generation_row(check: str, where: str, out: Any, data: BatchedDataDict, ref: CpuReference, tol: float,
                    seconds: float, new_tokens: int) -> Row:
    expect = torch.full_like(out["generation_lengths"], new_tokens)
    mask = generated_mask(out, data["input_lengths"])
    diff = max_diff(out["logprobs"], ref.logprobs(out["output_ids"], out["unpadded_sequence_lengths"]), mask)
    ok = torch.equal(out["generation_lengths"], expect) and diff <= tol
    rate = int(out["generation_lengths"].sum()) / seconds
    return Row(check, where, verdict(ok),
               f"{rate:,.0f} new tok/s; generated-token logprob max abs diff {diff:.2e} (tol {tol:g}) vs CPU fp32 forward")


def check_generate(worker: PolicyWorker, data: BatchedDataDict, ref: CpuReference, case: ModelCase, where: str) -> Row:
    worker.generate(data, greedy=True)  # warm-up
    holder: dict[str, Any] = {}
    seconds = timed(worker.device, lambda: holder.update(out=worker.generate(data, greedy=True)))
    tol = GENERATION_TOL[worker.cfg.precision]
    row = _generation_row("PolicyWorker.generate (greedy, KV cache)", where, holder["out"], data, ref, tol, seconds,
                          case.new_tokens)
    if worker.cfg.precision == "float32":
        return row
    return dataclasses.replace(row, figure=f"no autocast in generate: runs the fp32 master weights; {row.figure}")


def check_train(worker: PolicyWorker, batch: BatchedDataDict, reference: torch.Tensor, where: str) -> Row:
    precision = worker.cfg.precision
    loss_fn = ClippedPGLossFn(GRPO_LOSS)
    version = worker.weights_version
    holder: dict[str, Any] = {}
    seconds = timed(worker.device, lambda: holder.update(first=worker.train(batch, loss_fn)))  # the checked step
    seconds = min(seconds, timed(worker.device, lambda: worker.train(batch, loss_fn)))
    result = holder["first"]
    expected = grpo_loss(batch, reference)
    diff = abs(result["global_loss"][0] - expected)
    finite = all(np.isfinite(result["grad_norm"])) and np.isfinite(result["global_loss"][0])
    ok = bool(finite) and diff <= LOSS_TOL[precision] and worker.weights_version == version + 2
    tokens = int(batch["input_lengths"].sum())
    return Row("PolicyWorker.train (GRPO clipped PG, AdamW)", where, verdict(ok),
               f"loss {result['global_loss'][0]:.5f} vs CPU {expected:.5f} (diff {diff:.1e}, tol {LOSS_TOL[precision]:g}), "
               f"grad norm {result['grad_norm'][0]:.3g}; {tokens / seconds:,.0f} tok/s")


def check_hf_generation(case: ModelCase, precision: str, data: BatchedDataDict, ref: CpuReference, where: str) -> Row:
    """Greedy generation of an ``HfGenerationWorker`` holding the weights in ``precision``."""
    from nrl_tasks.models.generation.hf_worker import HfGenerationWorker

    cfg = {"model_name": case.path, "precision": precision, "max_new_tokens": case.new_tokens, "ignore_eos": True,
           "torch_num_threads": min(8, os.cpu_count() or 1)}
    threads = torch.get_num_threads()
    try:
        worker = HfGenerationWorker(cfg)
        worker.generate(dict(data), greedy=True)  # warm-up
        holder: dict[str, Any] = {}
        seconds = timed(worker.device, lambda: holder.update(out=worker.generate(dict(data), greedy=True)))
    finally:
        torch.set_num_threads(threads)  # the worker sets its own thread count
    return _generation_row("HfGenerationWorker.generate (greedy)", where, holder["out"], data, ref,
                           HF_GENERATION_TOL[precision], seconds, case.new_tokens)
