"""FSDP2 rows of ``benchmarks.gpu_check``: the policy's torch-FSDP2 code on this device, in process.

One process holds one rank, and one rank is wrapped with FSDP2 only with
``dtensor_cfg.cpu_offload=true`` (FSDP2's ``CPUOffloadPolicy``: on a GPU the state lives in CPU
memory and each layer is copied to the device for its forward and backward). For each precision:

- ``FSDP2 train (cpu_offload, 1 rank)``: two GRPO steps of the wrapped worker against the plain
  one-rank worker on the same batch (losses equal to the precision's tolerance; the wrapped
  worker's state bytes reported);
- ``FSDP2 gathered checkpoint -> plain rank``: the wrapped worker's checkpoint (weights and AdamW
  state gathered through ``torch.distributed.checkpoint.state_dict``) loaded into a plain worker:
  the weights checksum equal bit for bit, and a third step's loss equal to the wrapped worker's.

Sharding across two GPUs (NCCL) needs two processes of two devices: a SKIP row with the reason
(the Ray-based 2-rank tests cover it over gloo on CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks import _gpu_check_policy as pol
from benchmarks._gpu_check_report import Row, verdict

#: Abs difference of a GRPO loss between the wrapped and the plain worker.
TRAIN_TOL = {"float32": 1e-5, "bfloat16": 5e-2}


def _steps(worker: Any, batch: Any, n: int) -> list[float]:
    loss_fn = pol.ClippedPGLossFn(pol.GRPO_LOSS)
    return [float(worker.train(batch, loss_fn)["global_loss"][0]) for _ in range(n)]


def fsdp_rows(gpu: bool, tmp: Path, log: Any) -> list[Row]:
    case = pol.build_models(tmp / "fsdp-models", gpu)[-1]
    ref, batch, reference, _data, size = pol.case_inputs(case)
    pol.add_grpo_inputs(batch, reference)
    device = "cuda" if gpu else "cpu"
    rows: list[Row] = []
    for precision in pol.PRECISIONS:
        where = f"{device} {precision}, {size}"
        log(f"FSDP2 (cpu_offload, 1 rank), {where}")
        plain_cfg = pol.policy_config(case, precision, tmp / "profiles")
        offload = plain_cfg.dtensor_cfg.model_copy(update={"cpu_offload": True})
        wrapped_cfg = plain_cfg.model_copy(update={"dtensor_cfg": offload})
        with pol.policy_worker(plain_cfg) as plain:
            expected = _steps(plain, batch, 3)
        pol.release_memory()
        ckpt = tmp / f"fsdp-{precision}"
        with pol.policy_worker(wrapped_cfg) as wrapped:
            mode = wrapped.status()["parallel"]
            got = _steps(wrapped, batch, 2)
            state_mb = wrapped.state_mb()
            wrapped.save_checkpoint(str(ckpt / "w"), str(ckpt / "o"), None, [wrapped.get_rng_state()])
            checksum = wrapped.weights_checksum(as_sent=False)
            third = _steps(wrapped, batch, 1)[0]
        pol.release_memory()
        diff = max(abs(a - b) for a, b in zip(got, expected[:2]))
        rows.append(Row("FSDP2 train (cpu_offload, 1 rank)", where, verdict(mode != "single" and diff <= TRAIN_TOL[precision]),
                        f"{mode}; losses {got[0]:.5f}, {got[1]:.5f}; max |diff| to the plain rank {diff:.1e} "
                        f"(tol {TRAIN_TOL[precision]:g}); state {state_mb:.1f} MB"))
        with pol.policy_worker(plain_cfg) as plain:
            plain.load_checkpoint(str(ckpt / "w"), str(ckpt / "o"))
            same = plain.weights_checksum(as_sent=False) == checksum
            resumed = _steps(plain, batch, 1)[0]
        pol.release_memory()
        step_diff = abs(resumed - third)
        rows.append(Row("FSDP2 gathered checkpoint -> plain rank", where,
                        verdict(same and step_diff <= TRAIN_TOL[precision]),
                        f"weights checksum {'equal' if same else 'DIFFERENT'}; next-step loss |diff| {step_diff:.1e}"))
    gpus = torch.cuda.device_count() if gpu else 0
    rows.append(Row("FSDP2 sharded over 2 GPUs (NCCL)", device, "SKIP",
                    f"needs 2 processes on 2 GPUs; {gpus} visible here; covered over gloo by tests/models/policy/test_fsdp.py"))
    return rows
