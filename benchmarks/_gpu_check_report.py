"""Rows, timing and the markdown table of ``benchmarks.gpu_check``."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch

Result = Literal["PASS", "FAIL", "SKIP"]
RESULTS: tuple[Result, ...] = ("PASS", "FAIL", "SKIP")


@dataclass(frozen=True)
class Row:
    """One line of the table: what was checked, where, the verdict and the measured figure."""

    check: str
    where: str
    result: Result
    figure: str


def verdict(ok: bool) -> Result:
    return "PASS" if ok else "FAIL"


def guarded(check: str, where: str, fn: Callable[[], list[Row]]) -> list[Row]:
    """``fn()``'s rows, or one FAIL row naming the exception (a broken check never stops the others)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        last = traceback.extract_tb(exc.__traceback__)[-1]
        where_raised = f"{last.filename.rsplit('/', 1)[-1]}:{last.lineno}"
        return [Row(check, where, "FAIL", f"{type(exc).__name__}: {_one_line(exc)} ({where_raised})")]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], object]) -> float:
    """Wall seconds of ``fn()``, with the device's queued work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def best_time(device: torch.device, fn: Callable[[], object], repeats: int) -> float:
    return min(timed(device, fn) for _ in range(repeats))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(rows: Iterable[Row]) -> str:
    """The markdown table and the final count line."""
    rows = list(rows)
    lines = ["| check | device/dtype | result | figure |", "|---|---|---|---|"]
    lines += [f"| {_cell(r.check)} | {_cell(r.where)} | {r.result} | {_cell(r.figure)} |" for r in rows]
    counts = {name: sum(r.result == name for r in rows) for name in RESULTS}
    lines += ["", f"{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP"]
    return "\n".join(lines)


def failed(rows: Iterable[Row]) -> bool:
    return any(r.result == "FAIL" for r in rows)
