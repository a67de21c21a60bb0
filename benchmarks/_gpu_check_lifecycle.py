"""Offload and profiling checks of ``benchmarks.gpu_check`` on a set-up, trained ``PolicyWorker``.

GPU: each ``offload_*`` call must move what its docstring says, seen in
``torch.cuda.memory_allocated`` (at least 90% of the moved tensors' bytes freed) and in the
devices of the parameters and optimizer state; the next compute call brings them back and gives
the same logprobs as before the offload (max abs diff <= 1e-6). CPU: they are no-ops by design;
the check calls them and sees weights stay on CPU and gradients freed.
Profiling: ``start_gpu_profiling`` / ``stop_gpu_profiling`` around a ``get_logprobs`` must write a
non-empty Chrome trace with CPU ops (and CUDA kernels on GPU).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from benchmarks._gpu_check_report import Row, verdict
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.models.policy.workers.train_worker import PolicyWorker

MOVED_FRACTION = 0.9
SAME_AFTER_RELOAD_TOL = 1e-6
MiB = 2**20


def _param_bytes(worker: PolicyWorker) -> int:
    return sum(p.numel() * p.element_size() for p in worker.model.parameters())


def _optimizer_tensors(worker: PolicyWorker) -> list[torch.Tensor]:
    assert worker.optimizer is not None
    return [v for state in worker.optimizer.state.values() for k, v in state.items()
            if isinstance(v, torch.Tensor) and k != "step"]


def _on(tensors: list[torch.Tensor], kind: str) -> bool:
    return all(t.device.type == kind for t in tensors)


def _weights_on(worker: PolicyWorker, kind: str) -> bool:
    return _on(list(worker.model.parameters()), kind)


def _moved(worker: PolicyWorker, call: Callable[[], None]) -> tuple[int, int]:
    """``(allocated before, allocated after)`` ``call()`` on the worker's device."""
    torch.cuda.synchronize(worker.device)
    before = torch.cuda.memory_allocated(worker.device)
    call()
    torch.cuda.synchronize(worker.device)
    return before, torch.cuda.memory_allocated(worker.device)


def _gpu_offload_rows(worker: PolicyWorker, where: str) -> list[Row]:
    opt_bytes = sum(t.numel() * t.element_size() for t in _optimizer_tensors(worker))
    weights = _param_bytes(worker)
    rows = []

    before, after = _moved(worker, worker.offload_before_refit)
    ok = _on(_optimizer_tensors(worker), "cpu") and _weights_on(worker, "cuda") and before - after >= MOVED_FRACTION * opt_bytes
    rows.append(Row("offload_before_refit", where, verdict(ok),
                    f"allocated {before / MiB:,.0f} -> {after / MiB:,.0f} MiB (optimizer state {opt_bytes / MiB:,.0f} MiB "
                    f"to CPU, weights stay)"))

    before, after = _moved(worker, worker.offload_after_refit)
    ok = _weights_on(worker, "cpu") and before - after >= MOVED_FRACTION * weights
    rows.append(Row("offload_after_refit", where, verdict(ok),
                    f"allocated {before / MiB:,.0f} -> {after / MiB:,.0f} MiB (weights {weights / MiB:,.0f} MiB to CPU)"))

    before, after = _moved(worker, worker.prepare_for_training)
    back = _weights_on(worker, "cuda") and _on(_optimizer_tensors(worker), "cuda")
    ok = back and after - before >= MOVED_FRACTION * (weights + opt_bytes)
    rows.append(Row("prepare_for_training (back from offload)", where, verdict(ok),
                    f"allocated {before / MiB:,.0f} -> {after / MiB:,.0f} MiB"))

    before, after = _moved(worker, lambda: worker.offload_to_cpu(optimizer=False))
    ok = _weights_on(worker, "cpu") and _on(_optimizer_tensors(worker), "cuda") and before - after >= MOVED_FRACTION * weights
    rows.append(Row("offload_to_cpu(optimizer=False)", where, verdict(ok),
                    f"allocated {before / MiB:,.0f} -> {after / MiB:,.0f} MiB (weights to CPU, optimizer stays)"))
    return rows


def _cpu_offload_rows(worker: PolicyWorker, where: str) -> list[Row]:
    rows = []
    for name, call in (
        ("offload_before_refit", worker.offload_before_refit),
        ("offload_after_refit", worker.offload_after_refit),
        ("offload_to_cpu(optimizer=False)", lambda: worker.offload_to_cpu(optimizer=False)),
    ):
        call()
        grads_freed = all(p.grad is None for p in worker.model.parameters())
        ok = _weights_on(worker, "cpu") and _on(_optimizer_tensors(worker), "cpu") and grads_freed
        rows.append(Row(name, where, verdict(ok), "no-op by design on a CPU worker: weights stay on CPU, gradients freed"))
    return rows


def check_offload(worker: PolicyWorker, batch: BatchedDataDict, where: str) -> list[Row]:
    """Offload rows, then one row checking the weights came back intact."""
    if worker.optimizer is None or not worker.optimizer.state:
        raise RuntimeError("check_offload needs a worker that trained (optimizer state exists)")
    before = worker.get_logprobs(batch)["logprobs"]
    rows = _gpu_offload_rows(worker, where) if worker.device.type == "cuda" else _cpu_offload_rows(worker, where)
    after = worker.get_logprobs(batch)["logprobs"]  # moves everything back first
    diff = float((after - before).abs().max())
    on_device = _weights_on(worker, worker.device.type)
    rows.append(Row("get_logprobs after offloads", where, verdict(on_device and diff <= SAME_AFTER_RELOAD_TOL),
                    f"weights back on {worker.device.type}; max abs diff to before {diff:.1e} (tol {SAME_AFTER_RELOAD_TOL:g})"))
    return rows


def check_profiling(worker: PolicyWorker, batch: BatchedDataDict, where: str) -> list[Row]:
    """One row: a trace file exists, is non-empty JSON with CPU ops (and CUDA kernels on GPU)."""
    worker.start_gpu_profiling()
    worker.get_logprobs(batch)
    path = worker.stop_gpu_profiling()
    if path is None or not os.path.isfile(path):
        return [Row("start/stop_gpu_profiling", where, "FAIL", f"no trace file written (got {path!r})")]
    size = os.path.getsize(path)
    with open(path) as fh:
        events = json.load(fh).get("traceEvents", []) if size else []
    cats = [str(e.get("cat", "")).lower() for e in events]
    cpu_ops = sum(c == "cpu_op" for c in cats)
    kernels = sum(c == "kernel" for c in cats)
    ok = size > 0 and cpu_ops > 0 and (kernels > 0 or worker.device.type != "cuda")
    gpu_part = f", {kernels} CUDA kernels" if worker.device.type == "cuda" else ""
    return [Row("start/stop_gpu_profiling", where, verdict(ok),
                f"trace {os.path.basename(path)}: {size / 1024:,.0f} KiB, {cpu_ops} CPU ops{gpu_part}")]
