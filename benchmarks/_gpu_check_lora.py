"""LoRA checks of ``benchmarks.gpu_check``: a LoRA ``PolicyWorker`` and its adapters-only refit, without Ray.

One in-process ``PolicyWorker`` per model and precision with ``dtensor_cfg.lora_cfg`` (rank 8,
alpha 32, all linear modules; lr 1e-2 so one step visibly moves the adapters), on the same
models and batches as the policy rows. Three rows each:

* LoRA train: two GRPO steps (the policy rows' clipped PG + KL loss). PASS when the checksum of
  the base weights (every state-dict tensor without a ``lora_`` part) is unchanged bit for bit,
  the adapter checksum changed, the optimizer's groups and state hold exactly the adapter
  parameters, and loss and grad norm are finite. Figure: trainable / total parameters, tokens/s.
* reference = base: ``get_reference_policy_logprobs`` (adapters disabled) vs the CPU fp32 base
  model: max abs diff <= 1e-4 (fp32) / 5e-2 (bf16), and the live (trained) policy differs.
* adapters-only refit, no wire: an ``HfGenerationWorker`` on the same folder and precision takes
  the worker's ``prepare_refit_info()`` (it injects the layout's LoRA layers), then the adapter
  tensors are copied into its ``_refit_named_tensors()`` by name, cast to the generation dtype
  (what the packed consumer does; the wire is the packed-broadcast rows' job). PASS when the
  checksums agree, the refit bytes are < 25% of the full model's, and greedy ``generate`` equals
  the policy's ``generate(greedy=True)``: fp32 every row token for token and logprobs within
  1e-5. bf16 (generation worker in bf16 weights, policy ``generate`` on fp32 master weights):
  rows equal token for token are reported, not required (on random-init models the top logits
  are near-tied, a bf16 rounding flips one and the row diverges from there); PASS when the
  generated-token logprobs are within 1.5e-1 (the ``HfGenerationWorker`` bf16 tolerance) of the
  policy's own fp32-master forward of the same tokens (teacher-forced).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import _gpu_check_policy as pol
from benchmarks._gpu_check_report import Row, guarded, timed, verdict
from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.models.policy import PolicyConfig
from nrl_tasks.models.policy.workers.train_worker import PolicyWorker

LORA = {"enabled": True, "dim": 8, "alpha": 32}
LORA_LR = 1e-2
REFIT_FRACTION = 0.25  # adapters-only refit bytes / full model bytes must stay below
GREEDY_LOGPROB_TOL_FP32 = 1e-5
#: bf16 generation weights vs fp32 master: the tolerance of the HfGenerationWorker bf16 row.
BF16_FORCED_TOL = pol.HF_GENERATION_TOL["bfloat16"]


def lora_config(case: pol.ModelCase, precision: str, profiler_dir: Path) -> PolicyConfig:
    """The policy rows' config with LoRA on, and generation in ``precision`` (the refit dtype)."""
    data = pol.policy_config(case, precision, profiler_dir).model_dump(mode="json")
    data["dtensor_cfg"]["lora_cfg"] = dict(LORA)
    data["optimizer"]["kwargs"] = {**data["optimizer"]["kwargs"], "lr": LORA_LR, "weight_decay": 0.0}
    data["generation"] = {**data["generation"], "model_name": case.path, "precision": precision}
    return PolicyConfig.model_validate(data)


def _is_adapter(name: str) -> bool:
    return any(part.startswith("lora_") for part in name.split("."))


def _checksums(worker: PolicyWorker) -> tuple[str, str, int]:
    """Checksums of the base tensors and of the adapter tensors of the live model; base count."""
    from nrl_tasks.utils.refit import weights_checksum

    state = list(worker.model.state_dict().items())
    base = [(n, t) for n, t in state if not _is_adapter(n)]
    adapters = [(n, t) for n, t in state if _is_adapter(n)]
    return weights_checksum(base), weights_checksum(adapters), len(base)


def check_lora_train(worker: PolicyWorker, batch: BatchedDataDict, where: str) -> Row:
    loss_fn = ClippedPGLossFn(pol.GRPO_LOSS)
    base0, adapters0, n_base = _checksums(worker)
    results: list[Any] = []
    seconds = min(timed(worker.device, lambda: results.append(worker.train(batch, loss_fn))) for _ in range(2))
    base1, adapters1, _ = _checksums(worker)
    named = list(worker.model.named_parameters())
    names = {id(p): n for n, p in named}
    assert worker.optimizer is not None
    in_groups = [names.get(id(p), "?") for g in worker.optimizer.param_groups for p in g["params"]]
    in_state = [names.get(id(p), "?") for p in worker.optimizer.state]
    trainable = {n for n, p in named if p.requires_grad}
    adapter_names = {n for n, _ in named if _is_adapter(n)}
    opt_ok = bool(in_groups) and set(in_groups) == set(in_state) == trainable == adapter_names
    finite = all(np.isfinite(r["global_loss"]).all() and np.isfinite(r["grad_norm"]).all() for r in results)
    ok = base0 == base1 and adapters0 != adapters1 and opt_ok and bool(finite)
    n_train = sum(p.numel() for n, p in named if n in adapter_names)
    total = sum(p.numel() for _, p in named)
    tokens = int(batch["input_lengths"].sum())
    return Row("LoRA train (GRPO, rank 8, only adapters move)", where, verdict(ok),
               f"base ({n_base} tensors) {'bit-identical' if base0 == base1 else 'CHANGED'}, adapters "
               f"{'changed' if adapters0 != adapters1 else 'UNCHANGED'}; optimizer: {len(in_groups)} tensors, "
               f"{'adapters only' if opt_ok else 'NOT adapters only'}; loss {results[0]['global_loss'][0]:.5f}; "
               f"trainable {n_train:,} / {total:,} params ({100 * n_train / total:.2f}%); {tokens / seconds:,.0f} tok/s")


def check_reference(worker: PolicyWorker, batch: BatchedDataDict, reference: torch.Tensor, where: str) -> Row:
    tol = pol.LOGPROB_TOL[worker.cfg.precision]
    ref = worker.get_reference_policy_logprobs(batch)["reference_logprobs"]
    live = worker.get_logprobs(batch)["logprobs"]
    mask = reference != 0
    diff, moved = pol.max_diff(ref, reference, mask), pol.max_diff(live, ref, mask)
    ok = diff <= tol and moved > 0 and bool(torch.isfinite(ref).all())
    return Row("LoRA reference logprobs = base model", where, verdict(ok),
               f"reference vs CPU fp32 base: max abs diff {diff:.2e} (tol {tol:g}); trained policy vs reference "
               f"{moved:.2e} (must be > 0)")


def check_refit(worker: PolicyWorker, data: BatchedDataDict, where: str) -> Row:
    from nrl_tasks.models.generation.hf_worker import HfGenerationWorker
    from nrl_tasks.models.policy.workers.lora import adapter_named_tensors
    from nrl_tasks.utils.refit import RefitInfo

    precision = worker.cfg.precision
    assert worker.cfg.generation is not None
    gen_cfg = {**worker.cfg.generation.model_dump(), "torch_num_threads": min(8, os.cpu_count() or 1)}
    threads = torch.get_num_threads()
    try:
        gen = HfGenerationWorker(gen_cfg)
        full = sum(t.numel() * t.element_size() for _, t in gen._refit_named_tensors())
        info_dict = worker.prepare_refit_info()
        assert info_dict is not None, "rank 0 returned no refit info"
        info = RefitInfo.from_dict(info_dict)
        gen.prepare_refit_info(info_dict)  # injects the layout's LoRA layers (B = 0)
        targets = dict(gen._refit_named_tensors())
        sent = list(adapter_named_tensors(worker.model.get_base_model()))
        if [n for n, _ in sent] != [n for n, _, _ in info.metadata] or set(targets) != {n for n, _ in sent}:
            raise RuntimeError(f"adapter names disagree: sent {[n for n, _ in sent][:2]}, "
                               f"announced {[n for n, _, _ in info.metadata][:2]}, held {list(targets)[:2]}")
        with torch.no_grad():
            for name, tensor in sent:
                targets[name].copy_(tensor.to(gen.dtype))
        gen.set_weights_version(1)
        same_sum = gen.weights_checksum() == worker.weights_checksum()
        out_gen = gen.generate(dict(data), greedy=True, weights_version=1)
    finally:
        torch.set_num_threads(threads)  # the generation worker sets its own thread count
    out_pol = worker.generate(data, greedy=True)
    fraction = info.total_bytes / full
    if out_gen["output_ids"].shape == out_pol["output_ids"].shape:
        rows_eq = (out_gen["output_ids"] == out_pol["output_ids"]).all(dim=1)
        rows_eq &= out_gen["unpadded_sequence_lengths"] == out_pol["unpadded_sequence_lengths"]
    else:
        rows_eq = torch.zeros(out_gen["output_ids"].shape[0], dtype=torch.bool)
    mask = pol.generated_mask(out_gen, data["input_lengths"]) & rows_eq.unsqueeze(1)
    diff = pol.max_diff(out_gen["logprobs"], out_pol["logprobs"], mask)
    if precision == "float32":
        greedy_ok = bool(rows_eq.all()) and diff <= GREEDY_LOGPROB_TOL_FP32
        rule = f"all rows token for token, logprob diff {diff:.1e} (tol {GREEDY_LOGPROB_TOL_FP32:g})"
    else:  # near-tied argmaxes flip under bf16 weights and a row then diverges: compare teacher-forced
        forced = _policy_fp32_logprobs(worker, out_gen)
        gen_mask = pol.generated_mask(out_gen, data["input_lengths"])
        forced_diff = pol.max_diff(out_gen["logprobs"], forced, gen_mask)
        greedy_ok = forced_diff <= BF16_FORCED_TOL
        rule = (f"bf16 weights vs the policy's fp32-master forward of the same tokens: logprob max abs diff "
                f"{forced_diff:.2e} (tol {BF16_FORCED_TOL:g}); logprob diff on the equal rows {diff:.2e}")
    ok = same_sum and 0 < fraction < REFIT_FRACTION and greedy_ok
    return Row("LoRA adapters-only refit into HfGenerationWorker (no wire)", where, verdict(ok),
               f"checksum {'equal' if same_sum else 'DIFFERS'}; {len(info.metadata)} adapter tensors, "
               f"{info.total_bytes / 1e6:.3f} MB = {100 * fraction:.2f}% of the full {full / 1e6:.2f} MB "
               f"(< {REFIT_FRACTION:.0%}); greedy: {int(rows_eq.sum())}/{len(rows_eq)} rows equal; {rule}")


@torch.no_grad()
def _policy_fp32_logprobs(worker: PolicyWorker, out: dict[str, torch.Tensor]) -> torch.Tensor:
    """The policy's logprobs of ``out``'s sequences on its fp32 master weights (what its
    ``generate`` runs on), without autocast."""
    from nrl_tasks.models.policy.workers.logprobs import padded_forward_logprobs

    worker.model.eval()
    ids, lengths = out["output_ids"].to(worker.device), out["unpadded_sequence_lengths"].to(worker.device)
    return padded_forward_logprobs(worker.model, ids, lengths).float().cpu()


def case_rows(case: pol.ModelCase, gpu: bool, tmp: Path, log: Callable[[str], None]) -> list[Row]:
    """Both precisions of one model: train, reference and refit rows on one LoRA worker each."""
    _, batch, reference, data, size = pol.case_inputs(case)
    rows: list[Row] = []
    for precision in pol.PRECISIONS:
        where = f"{'cuda' if gpu else 'cpu'} {precision}, {size}"
        log(f"LoRA PolicyWorker and adapters-only refit, {where}")
        cfg = lora_config(case, precision, tmp / "profiles")

        def worker_rows() -> list[Row]:
            with pol.policy_worker(cfg) as worker:
                checks: list[tuple[str, Callable[[], list[Row]]]] = [
                    ("LoRA train", lambda: [check_lora_train(worker, batch, where)]),
                    ("LoRA reference logprobs", lambda: [check_reference(worker, batch, reference, where)]),
                    ("LoRA adapters-only refit", lambda: [check_refit(worker, data, where)]),
                ]
                return [row for name, fn in checks for row in guarded(name, where, fn)]

        rows += guarded("LoRA PolicyWorker set-up", where, worker_rows)
        pol.release_memory()
    return rows


def lora_rows(gpu: bool, device: torch.device, tmp: Path, log: Callable[[str], None]) -> list[Row]:
    """The LoRA rows on the policy rows' models (built again under ``tmp``); SKIP without peft."""
    try:
        import peft  # noqa: F401
    except ImportError as exc:
        return [Row("LoRA", device.type, "SKIP", f"peft is not importable ({exc}): install the peft wheel")]
    rows: list[Row] = []
    for case in pol.build_models(tmp / "lora-models", gpu):
        rows += case_rows(case, gpu, tmp, log)
        pol.release_memory()
    return rows
