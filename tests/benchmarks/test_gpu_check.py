"""``python -m benchmarks.gpu_check --cpu`` end to end, where Ray and Prefect cannot be imported.

The GPU image has neither: a ``sitecustomize`` on ``PYTHONPATH`` makes both unimportable in the
check's process and in the processes it spawns, so any import of them on the way fails the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BLOCK_RAY_AND_PREFECT = 'import sys\n\nsys.modules["ray"] = None\nsys.modules["prefect"] = None\n'
TABLE_HEADER = "| check | device/dtype | result | figure |"
EXPECTED_SKIPS: set[str] = {"FSDP2 sharded over 2 GPUs (NCCL)"}  # one process, no second GPU
EXPECTED_CHECKS = {
    "packed round trip, all dtypes",
    "loopback per-tensor",
    "loopback one flat broadcast",
    "2-process packed broadcast (gloo)",
    "StepSchedule (async GRPO schedule, pure)",
    "PolicyWorker.get_logprobs",
    "PolicyWorker.generate (greedy, KV cache)",
    "PolicyWorker.train (GRPO clipped PG, AdamW)",
    "HfGenerationWorker.generate (greedy)",
    "offload_before_refit",
    "offload_after_refit",
    "offload_to_cpu(optimizer=False)",
    "get_logprobs after offloads",
    "start/stop_gpu_profiling",
    "LoRA train (GRPO, rank 8, only adapters move)",
    "LoRA reference logprobs = base model",
    "LoRA adapters-only refit into HfGenerationWorker (no wire)",
    "FSDP2 train (cpu_offload, 1 rank)",
    "FSDP2 gathered checkpoint -> plain rank",
    "FSDP2 sharded over 2 GPUs (NCCL)",
    "colocated sample -> train -> sample (one PolicyWorker)",
}


def _env_without_ray_and_prefect(site: Path) -> dict[str, str]:
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_RAY_AND_PREFECT)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    env.pop("NRL_PLUGINS", None)  # the fault plug-in of the test session is not part of the GPU image
    return env


def _rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    start = lines.index(TABLE_HEADER) + 2  # skip the header and the |---| line
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def test_cpu_mode_passes_without_ray_and_prefect(tmp_path):
    env = _env_without_ray_and_prefect(tmp_path / "site")
    for module in ("ray", "prefect"):  # the blocker really is in effect
        probe = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, cwd=REPO, capture_output=True)
        assert probe.returncode != 0, f"{module} is still importable"

    table_file = tmp_path / "table.md"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--cpu", "--out", str(table_file)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    report = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    assert TABLE_HEADER in proc.stdout, report
    rows = _rows(proc.stdout)
    assert all(len(r) == 4 for r in rows), report
    assert {r[0] for r in rows} >= EXPECTED_CHECKS, report
    for check, where, result, figure in rows:
        expected = "SKIP" if check in EXPECTED_SKIPS else "PASS"
        assert result == expected, f"{check} [{where}]: {result} {figure}\n{report}"
    skips = sum(r[2] == "SKIP" for r in rows)
    assert f"{len(rows) - skips} PASS, 0 FAIL, {skips} SKIP" in proc.stdout, report
    assert TABLE_HEADER in table_file.read_text()
