"""GPU readiness: one prepared run over every CUDA path, with figures, in a few minutes.

Run: ``python -m benchmarks.gpu_check [--cpu] [--out FILE]`` (``make gpu-check``) from the repo
root. Needs torch, transformers, safetensors and pydantic (and peft for the LoRA rows); Ray and
Prefect are never imported.
Without ``--cpu`` it needs CUDA and exits 2 when there is none; ``--cpu`` runs the same checks
on CPU tensors and gloo in under a minute. Prints one markdown table (check | device/dtype |
result | figure) and a PASS/FAIL/SKIP count; exits 1 when a check failed.

What it checks (GPU sizes; ``--cpu`` sizes in brackets):

* packed broadcast (``nrl_tasks.utils.packed_tensor``) through an in-process loopback group:
  bit-exact round trip of 12 dtypes (float32/bf16/fp16/fp64/complex64/int64/32/16/8/uint8/bool/
  float8) in scalars, misaligning odd sizes, transposed views, empty and oversized tensors, over
  five consumer modes, with the CUDA side streams; also CUDA tensors onto a CPU wire. GB/s of
  packed vs per-tensor vs one flat broadcast for a ~1 GB [~5 MB] Llama-shaped bf16 set.
* a real 2-process group (``create_broadcast_group``, ``torch.multiprocessing`` spawn): gloo, and
  on GPU NCCL with both ranks on the one device (a SKIP row with NCCL's reason if it refuses):
  bit-exact packed round trip and GB/s.
* ``PolicyWorker`` without Ray (one rank, in this process) on the tiny kit model and a ~100M
  random-init Llama [tiny only], in float32 and bfloat16: ``get_logprobs`` (max abs diff to CPU
  fp32 <= 1e-4 fp32, <= 5e-2 bf16), greedy ``generate`` (generated-token logprobs vs a CPU fp32
  forward <= 1e-3 fp32, <= 5e-2 bf16), a GRPO ``train`` step (loss vs the loss at the CPU fp32
  logprobs <= 1e-4 fp32, <= 5e-2 bf16), tokens/s; ``HfGenerationWorker`` greedy generation in
  bf16 weights (<= 1.5e-1) and fp32 (<= 1e-3).
* ``offload_before_refit`` / ``offload_after_refit`` / ``offload_to_cpu`` moving memory
  (``torch.cuda.memory_allocated``; no-ops by design on CPU) and ``start/stop_gpu_profiling``
  writing a non-empty trace.
* the step schedule (``nrl_tasks.stages.schedule``, pure).
* FSDP2 (``dtensor_cfg``; ``_gpu_check_fsdp``) on the largest model, fp32 and bf16: one rank
  wrapped through ``cpu_offload`` trains like the plain rank, and its gathered checkpoint loads
  into a plain rank bit for bit; sharding over 2 GPUs is a SKIP row (needs two processes).
* colocated generation (``_gpu_check_colocated``), fp32 and bf16: one ``PolicyWorker`` samples,
  trains and samples again on its live weights (logprobs of its samples = its ``get_logprobs``
  before and after the step); device memory peak vs a separate generation copy.
* LoRA (``dtensor_cfg.lora_cfg``, rank 8; needs peft, else one SKIP row) on the same models, fp32
  and bf16: a GRPO ``train`` step moves only the adapters (base-weight checksum bit-identical,
  optimizer holds only adapter params, finite loss; trainable/total params, tokens/s);
  ``get_reference_policy_logprobs`` equals the CPU fp32 base model (<= 1e-4 fp32, <= 5e-2 bf16);
  an adapters-only refit copied into an in-process ``HfGenerationWorker`` (no wire): equal
  checksums, refit bytes < 25% of the model's, greedy ``generate`` vs the policy's (fp32: every
  token equal, logprobs <= 1e-5; bf16 weights: generated-token logprobs <= 1.5e-1 of the policy's
  fp32 forward of the same tokens, rows equal token for token reported).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import _gpu_check_colocated as colocated
from benchmarks import _gpu_check_fsdp as fsdp
from benchmarks import _gpu_check_lifecycle as life
from benchmarks import _gpu_check_lora as lora
from benchmarks import _gpu_check_policy as pol
from benchmarks._gpu_check_broadcast import check_dtypes, check_throughput
from benchmarks._gpu_check_group import check_pair
from benchmarks._gpu_check_report import Row, failed, guarded, render, verdict
from nrl_tasks.stages.schedule import StepSchedule
from nrl_tasks.utils.packed_tensor import get_target_packed_tensor_size

EXIT_NO_CUDA = 2
LOOPBACK_REPEATS = {True: 5, False: 10}  # best of: a ~5 MB CPU round trip takes milliseconds


def _log(message: str, start: float) -> None:
    print(f"[gpu_check {time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)


def header(gpu: bool) -> str:
    """One line: mode, torch/CUDA versions, device."""
    if gpu:
        props = torch.cuda.get_device_properties(0)
        device = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"
    else:
        device = f"CPU ({os.cpu_count()} cores), --cpu mode"
    return f"gpu_check: torch {torch.__version__}, Python {platform.python_version()}, {device}"


def schedule_rows() -> list[Row]:
    """The step schedule: every step generated once on its version after that version's refit,
    trained once, in order (sync, age 1 and 2)."""
    results = []
    for age in (None, 1, 2):
        schedule = StepSchedule(6, age)
        held, trained, generated, ok = 0, 0, set(), True
        for event in schedule.events():
            if event.kind == "generate":
                ok &= event.version == held == schedule.generation_version(event.step)
                generated.add(event.step)
            elif event.kind == "train":
                ok &= event.step == trained + 1 and event.step in generated
                trained = event.step
            else:
                ok &= event.version <= trained
                held = event.version
        results.append(ok and trained == 6 and generated == set(range(1, 7)))
    return [Row("StepSchedule (async GRPO schedule, pure)", "any", verdict(all(results)),
                "6 steps, sync / age 1 / age 2: one valid order each; async stage tasks need Prefect (not run)")]


def lora_rows(gpu: bool, device: torch.device, tmp: Path, log: Callable[[str], None]) -> list[Row]:
    """LoRA ``PolicyWorker`` train / reference / adapters-only refit rows (``_gpu_check_lora``)."""
    return lora.lora_rows(gpu, device, tmp, log)


def broadcast_rows(gpu: bool, device: torch.device) -> list[Row]:
    rows = guarded("packed round trip, all dtypes", device.type, lambda: check_dtypes(device, device))
    if gpu:
        cpu = torch.device("cpu")
        rows += guarded("packed round trip, all dtypes", "cuda->cpu", lambda: check_dtypes(device, cpu))
    targets = [get_target_packed_tensor_size(), (64 if gpu else 1) * 2**20]
    rows += guarded("loopback throughput", device.type,
                    lambda: check_throughput(device, gpu, targets, LOOPBACK_REPEATS[gpu]))
    return rows


def group_rows(gpu: bool) -> list[Row]:
    rows = guarded("2-process packed broadcast (gloo)", "gloo", lambda: check_pair("gloo", gpu, 60.0 if gpu else 30.0))
    if gpu:
        rows += guarded("2-process packed broadcast (nccl)", "nccl", lambda: check_pair("nccl", gpu, 60.0))
    return rows


def case_rows(case: pol.ModelCase, gpu: bool, tmp: Path, log: Callable[[str], None], lifecycle: bool) -> list[Row]:
    """Both precisions of one model: policy worker checks (and, with ``lifecycle``, offload and
    profiling on the trained fp32 worker), then the generation worker."""
    ref, batch, reference, data, size = pol.case_inputs(case)
    device = "cuda" if gpu else "cpu"
    rows: list[Row] = []
    for precision in pol.PRECISIONS:
        where = f"{device} {precision}, {size}"
        log(f"PolicyWorker and HfGenerationWorker, {where}")
        cfg = pol.policy_config(case, precision, tmp / "profiles")

        def worker_rows() -> list[Row]:
            with pol.policy_worker(cfg) as worker:
                checks: list[tuple[str, Callable[[], list[Row]]]] = [
                    ("PolicyWorker.get_logprobs", lambda: [pol.check_logprobs(worker, batch, reference, where)]),
                    ("PolicyWorker.generate", lambda: [pol.check_generate(worker, data, ref, case, where)]),
                    ("PolicyWorker.train", lambda: [pol.check_train(worker, batch, reference, where)]),
                ]
                if lifecycle and precision == "float32":  # on the trained worker: optimizer state exists
                    checks.append(("offload_*", lambda: life.check_offload(worker, batch, where)))
                    checks.append(("start/stop_gpu_profiling", lambda: life.check_profiling(worker, batch, where)))
                return [row for name, fn in checks for row in guarded(name, where, fn)]

        rows += guarded("PolicyWorker set-up", where, worker_rows)
        pol.release_memory()
        rows += guarded("HfGenerationWorker.generate (greedy)", where,
                        lambda: [pol.check_hf_generation(case, precision, data, ref, where)])
        pol.release_memory()
    return rows


def policy_rows(gpu: bool, tmp: Path, log: Callable[[str], None]) -> list[Row]:
    cases = pol.build_models(tmp / "models", gpu)
    rows: list[Row] = []
    for index, case in enumerate(cases):
        rows += case_rows(case, gpu, tmp, log, lifecycle=index == len(cases) - 1)  # lifecycle on the largest
        pol.release_memory()
    return rows


def run_checks(gpu: bool, tmp: Path) -> list[Row]:
    start = time.perf_counter()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")

    def log(message: str) -> None:
        _log(message, start)

    log("packed broadcast, loopback")
    rows = broadcast_rows(gpu, device)
    pol.release_memory()
    log("2-process groups")
    rows += group_rows(gpu)
    rows += guarded("StepSchedule", "any", schedule_rows)
    rows += guarded("PolicyWorker", device.type, lambda: policy_rows(gpu, tmp, log))
    rows += guarded("LoRA", device.type, lambda: lora_rows(gpu, device, tmp, log))
    rows += guarded("FSDP2", device.type, lambda: fsdp.fsdp_rows(gpu, tmp, log))
    rows += guarded("colocated", device.type, lambda: colocated.colocated_rows(gpu, tmp, log))
    log("done")
    return rows


def _quiet_offline_env() -> None:
    """Offline and quiet defaults; deterministic cuBLAS (the workers ask for deterministic kernels)."""
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                       ("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")):
        os.environ.setdefault(key, value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run every check on CPU tensors and gloo (no GPU needed)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) to this file")
    args = parser.parse_args(argv)
    gpu = not args.cpu
    if gpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False, torch "
              f"{torch.__version__}); run on a GPU machine, or pass --cpu for the CPU run", file=sys.stderr)
        return EXIT_NO_CUDA
    _quiet_offline_env()
    title = header(gpu)
    print(title, file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="nrl-gpu-check-") as tmp:
        rows = run_checks(gpu, Path(tmp))
    table = render(rows)
    print(f"{title}\n\n{table}", flush=True)
    if args.out is not None:
        args.out.write_text(f"{title}\n\n{table}\n")
    return 1 if failed(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
