"""Shared bits of the scale-out tests: a clean environment for subprocesses and a runner that
shows the output tail when a command fails."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Mapping, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
NRL = os.path.join(BIN, "nrl")
TINY_CONFIG = os.path.join(REPO, "configs", "grpo_tiny.yaml")


def clean_env(tmp: str, **extra: str) -> dict[str, str]:
    """The test session's environment for a subprocess, with its own Prefect home and no
    inherited Ray/Prefect endpoints."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "PREFECT_API_", "AWS_"))}
    env.update(
        PREFECT_HOME=os.path.join(tmp, "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        PREFECT_LOGGING_LEVEL="INFO",
        RAY_USAGE_STATS_ENABLED="0",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def run(cmd: Sequence[str], env: Mapping[str, str], timeout: float, cwd: str = REPO) -> str:
    """Run ``cmd``; return stdout+stderr; fail with the output's tail on a non-zero exit."""
    proc = subprocess.run(
        list(cmd), env=dict(env), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc.stdout


def read_env_file(path: str) -> dict[str, str]:
    """``export K=V`` lines of a shell env file as a dict."""
    out = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if line.startswith("export ") and "=" in line:
                k, v = line[len("export ") :].split("=", 1)
                out[k] = v
    return out


def run_tracked(cmd: Sequence[str], env: Mapping[str, str], timeout: float, log_path: str, cwd: str = REPO) -> tuple[int, str]:
    """Run ``cmd`` with its output in ``log_path``; return ``(returncode, output)``.

    Every process it starts is tracked while it runs; whatever of them outlives it (a process
    killed by SIGKILL leaves its Prefect ephemeral server behind, for instance) is stopped by
    PID afterwards. Raises ``subprocess.TimeoutExpired`` (after cleaning up) past ``timeout``.
    """
    import time

    import psutil

    seen: set[psutil.Process] = set()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            list(cmd), env=dict(env), cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    root = psutil.Process(proc.pid)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            try:
                seen.update(root.children(recursive=True))
            except psutil.Error:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise subprocess.TimeoutExpired(list(cmd), timeout)
            time.sleep(0.5)
    finally:
        left = [p for p in seen if p.is_running()]
        for p in left:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(left, timeout=20)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
    with open(log_path, errors="replace") as fh:
        return proc.returncode, fh.read()
