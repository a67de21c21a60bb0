"""Colocated-generation rows of ``benchmarks.gpu_check``: one ``PolicyWorker`` on one device
samples, trains and samples again on its live weights (what ``generation.colocated.enabled`` runs
in each policy rank), for each precision:

- the samples' generated-token logprobs equal the worker's own ``get_logprobs`` of the same tokens,
  before the step and after it (the step moved the first samples' logprobs, so the second
  sampling ran on the trained weights);
- figure: the device memory peak of the cycle (``torch.cuda.max_memory_allocated``) and what a
  separate HF generation copy of the model adds on the same device.

vLLM's colocated sleep/wake is not built (refused in the config), so it has no row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks import _gpu_check_policy as pol
from benchmarks._gpu_check_report import Row, verdict


def _lp_gap(worker: Any, out: Any, mask: torch.Tensor) -> float:
    """Largest gap between the sampler's logprobs of ``out`` and the worker's ``get_logprobs`` of them."""
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict

    lp = worker.get_logprobs(BatchedDataDict({"input_ids": out["output_ids"], "input_lengths": out["unpadded_sequence_lengths"]}))
    return pol.max_diff(out["logprobs"], lp["logprobs"], mask)


def _separate_copy_mb(case: pol.ModelCase, precision: str) -> float:
    """Device memory an ``HfGenerationWorker`` of the model holds (0 on CPU)."""
    if not torch.cuda.is_available():
        return 0.0
    from nrl_tasks.models.generation.hf_worker import HfGenerationWorker

    threads = torch.get_num_threads()
    before = torch.cuda.memory_allocated()
    try:
        worker = HfGenerationWorker({"model_name": case.path, "precision": precision, "max_new_tokens": case.new_tokens})
        held = (torch.cuda.memory_allocated() - before) / 1e6
        del worker
    finally:
        torch.set_num_threads(threads)
    pol.release_memory()
    return held


def colocated_rows(gpu: bool, tmp: Path, log: Any) -> list[Row]:
    case = pol.build_models(tmp / "colocated-models", gpu)[-1]
    _ref, batch, _reference, data, size = pol.case_inputs(case)
    data["seeds"] = torch.arange(data.size, dtype=torch.int64) + 17
    device = "cuda" if gpu else "cpu"
    rows: list[Row] = []
    for precision in pol.PRECISIONS:
        where = f"{device} {precision}, {size}"
        log(f"colocated sample -> train -> sample, {where}")
        tol = pol.GENERATION_TOL[precision]
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        with pol.policy_worker(pol.policy_config(case, precision, tmp / "profiles")) as worker:
            first = worker.generate(data)
            first_mask = pol.generated_mask(first, data["input_lengths"])
            gap_before = _lp_gap(worker, first, first_mask)
            worker.train(batch, pol.ClippedPGLossFn(pol.GRPO_LOSS))
            moved = _lp_gap(worker, first, first_mask)  # the old samples under the trained weights
            second = worker.generate(data)
            gap_after = _lp_gap(worker, second, pol.generated_mask(second, data["input_lengths"]))
            version = worker.weights_version
            peak_mb = torch.cuda.max_memory_allocated() / 1e6 if gpu else 0.0
            state_mb = worker.state_mb()
        pol.release_memory()
        copy_mb = _separate_copy_mb(case, precision)
        ok = gap_before <= tol and gap_after <= tol and moved > 0 and version == 1
        memory = f"device peak {peak_mb:.0f} MB, a separate generation copy would add {copy_mb:.0f} MB" if gpu else \
            f"policy state {state_mb:.1f} MB (no device memory on CPU)"
        rows.append(Row("colocated sample -> train -> sample (one PolicyWorker)", where, verdict(ok),
                        f"generated-token logprob vs the worker's get_logprobs: {gap_before:.1e} before, {gap_after:.1e} "
                        f"after the step (tol {tol:g}; the step moved them by {moved:.1e}); {memory}"))
    return rows
