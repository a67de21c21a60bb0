"""Two-process check of ``benchmarks.gpu_check``: a real broadcast group and a packed refit.

Two processes started with ``torch.multiprocessing`` (spawn) join a group made by
``nrl_tasks.utils.collective.create_broadcast_group``; rank 0 sends a transformer-shaped set with
``packed_broadcast_producer``, rank 1 receives it with ``packed_broadcast_consumer`` and compares
it bit for bit with the same set made from the same seed. ``nccl`` needs both ranks on CUDA (on
one GPU they share the device, which NCCL may refuse: the row then says so); with ``gloo`` in
GPU mode rank 0 sends from CUDA tensors (packed into CPU buffers), as a GPU trainer refitting
over gloo does.
"""

from __future__ import annotations

import queue
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from benchmarks._gpu_check_broadcast import metadata, mismatches, random_tensors, spec_bytes, transformer_spec
from benchmarks._gpu_check_report import Row, gbps, sync
from nrl_tasks.utils.collective import create_broadcast_group, find_free_port
from nrl_tasks.utils.packed_tensor import packed_broadcast_consumer, packed_broadcast_producer

TIMED_ROUNDS = 2
#: How NCCL says it will not put two ranks of one communicator on the same GPU.
NCCL_REFUSALS = ("invalid usage", "duplicate gpu")
SEED = 2


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:240] if lines else ''}"


def _rounds(group: Any, rank: int, params: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """One warm-up and ``TIMED_ROUNDS`` timed packed broadcasts; rank 1 checks the bytes."""
    dest = {n: torch.zeros_like(t) for n, t in params.items()}

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:
        for n, t in batch:
            dest[n].copy_(t)

    times = []
    bad: list[str] = []
    for round_index in range(1 + TIMED_ROUNDS):
        group.barrier()
        start = time.perf_counter()
        if rank == 0:
            packed_broadcast_producer(iter(params.items()), group, 0, lambda item: item[1])
        else:
            packed_broadcast_consumer(iter(metadata(params)), group, 0, load, reuse_buffers=True)
        sync(device)
        times.append(time.perf_counter() - start)
        if rank == 1 and round_index == 0:
            bad = mismatches(params, dest)
    group.barrier()
    return {"seconds": min(times[1:]), "mismatches": bad}


def _member(rank: int, port: int, backend: str, gpu: bool, timeout_s: float, results: Any) -> None:
    """Body of one spawned process; reports ``(rank, dict)`` on ``results``."""
    try:
        torch.set_num_threads(2)
        if gpu:
            torch.cuda.set_device(0)
        device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        with create_broadcast_group("127.0.0.1", port, rank, 2, timeout_s=timeout_s, backend=backend) as group:
            # rank 0 holds the weights where a trainer holds them; rank 1 receives where the wire lands
            params = random_tensors(transformer_spec(gpu), SEED, device if rank == 0 else group.device)
            results.put((rank, _rounds(group, rank, params, device if rank == 0 else group.device)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        results.put((rank, {"error": _first_line(exc)}))


def run_pair(backend: str, gpu: bool, timeout_s: float) -> dict[int, dict[str, Any]]:
    """Both ranks' reports; a rank that died or hung reports ``{"error": ...}``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_member, args=(r, port, backend, gpu, timeout_s, results), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    reports: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s + 60.0  # start-up (imports) plus the group's own deadline
    try:
        while len(reports) < 2 and time.monotonic() < deadline:
            try:
                rank, report = results.get(timeout=1.0)
                reports[rank] = report
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    for rank, p in enumerate(procs):
        reports.setdefault(rank, {"error": f"rank {rank} exited with code {p.exitcode} without a report"})
    return reports


def check_pair(backend: str, gpu: bool, timeout_s: float) -> list[Row]:
    """One row: the packed round trip between two processes over ``backend``.

    On GPU with ``nccl``, NCCL refusing two ranks on one device (``invalid usage`` / ``Duplicate
    GPU``) gives a SKIP row with its reason; every other failure is a FAIL.
    """
    spec = transformer_spec(gpu)
    total = spec_bytes(spec)
    where = f"{backend}, 2 processes" + (", both on cuda:0" if backend == "nccl" else (", cuda->cpu" if gpu else ", cpu"))
    where += f", {total / 1e6:.0f} MB"
    reports = run_pair(backend, gpu, timeout_s)
    errors = [f"rank {r}: {rep['error']}" for r, rep in sorted(reports.items()) if "error" in rep]
    check = f"2-process packed broadcast ({backend})"
    if errors:
        if backend == "nccl" and any(m in e.lower() for e in errors for m in NCCL_REFUSALS):
            return [Row(check, where, "SKIP", "NCCL with two ranks on one GPU did not work: " + "; ".join(errors))]
        return [Row(check, where, "FAIL", "; ".join(errors))]
    bad = reports[1]["mismatches"]
    seconds = max(reports[0]["seconds"], reports[1]["seconds"])
    if bad:
        return [Row(check, where, "FAIL", f"NOT bit-exact: {', '.join(bad[:4])}")]
    worked = "NCCL with two ranks on one GPU worked; " if backend == "nccl" else ""
    return [Row(check, where, "PASS", f"{worked}bit-exact, {gbps(total, seconds):.2f} GB/s (best of {TIMED_ROUNDS})")]
