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
