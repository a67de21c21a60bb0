#!/usr/bin/env bash
# Build TRL's own venv (.venv-trl) if missing; benchmarks/bench_vs_trl.py runs TRL's GRPOTrainer
# from it in a subprocess (benchmarks/_trl_driver.py). The project never imports TRL.
#
# Why a separate venv: TRL is the peer we measure against, not a dependency; its pins (datasets,
# accelerate, ...) must not move the project's resolution.
#
# torch is installed FIRST and pinned to the CPU build on disk here (an unpinned torch pulls
# several GB of CUDA wheels); transformers and accelerate are the project's own versions so both
# systems run the same model code.
#
# Idempotent: rebuilt only when its stamp (.venv-trl/.installed) is missing or older than this
# script. About 1.5 GB and 3 minutes from the registry.
#
# Env: PY (python to create the venv, default python3), TRL_VENV (default .venv-trl).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PY:-python3}"
VENV="${TRL_VENV:-.venv-trl}"
BIN="$VENV/bin"
STAMP="$VENV/.installed"
TORCH_PIN="torch==2.13.0"
TRL_PINS=("trl==1.16.0" "transformers==5.24.0" "accelerate==1.15.0")

if [ ! -f "$STAMP" ] || [ "$0" -nt "$STAMP" ]; then
    echo "[trl_venv] building $VENV (${TRL_PINS[*]}, $TORCH_PIN)"
    test -x "$BIN/python" || "$PY" -m venv "$VENV"
    "$BIN/pip" install -q --disable-pip-version-check "$TORCH_PIN"
    "$BIN/pip" install -q --disable-pip-version-check "$TORCH_PIN" "${TRL_PINS[@]}"
    "$BIN/pip" check
    "$BIN/python" -c "import torch, transformers, trl; print('[trl_venv] torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
    touch "$STAMP"
fi
