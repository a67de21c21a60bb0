#!/usr/bin/env bash
# Build the separate MLflow server venv (.venv-mlflow) if missing; the tracker tests start
# `mlflow server` from it (tests/flows/test_trackers.py builds it on first use).
#
# Why a separate venv: the full `mlflow` package (the server: Flask, SQLAlchemy stores, the UI)
# pins pyarrow<26 (mlflow 3.17.x; 3.18.0 needs an mlflow-skinny 3.18.0 that the registry lacks),
# while we need pyarrow>=26. The main venv has only the `mlflow-skinny` client (see shared/STACK.md).
#
# Idempotent: rebuilt only when its stamp (.venv-mlflow/.installed) is missing or older than this
# script. About 200 MB, well under two minutes from the registry.
#
# Env: PY (python to create the venv, default python3), MLFLOW_VENV (default .venv-mlflow).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PY:-python3}"
VENV="${MLFLOW_VENV:-.venv-mlflow}"
BIN="$VENV/bin"
STAMP="$VENV/.installed"
MLFLOW_PIN="mlflow==3.17.2"

if [ ! -f "$STAMP" ] || [ "$0" -nt "$STAMP" ]; then
    echo "[mlflow_venv] building $VENV ($MLFLOW_PIN)"
    test -x "$BIN/python" || "$PY" -m venv "$VENV"
    "$BIN/pip" install -q --disable-pip-version-check "$MLFLOW_PIN"
    "$BIN/mlflow" --version
    touch "$STAMP"
fi
