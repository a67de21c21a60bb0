"""NeMo-RL's own GRPO, DPO, SFT, RM, distillation and PPO files run 2 steps on the tiny model on CPU with only NeMo-RL's
key paths as overrides: the model, local data in NeMo-RL's dataset keys, the step count and the
cluster size (issue 42, must-show 1), each through `nrl train` in a process of its own; three of
NeMo-RL's recipe files (``defaults:`` chains on those: a two-level GRPO chain, DPO, SFT with LoRA)
the same way."""

from __future__ import annotations

import json
import os

import pytest

from tests.faults.helpers import run_nrl
from tests.flows.test_nemo_rl_configs import BY_KIND, COMMON, CONFIGS, _kind, _local_data

pytestmark = pytest.mark.slow


RECIPES = ["recipes/llm/grpo-deepscaler-1.5b-1n4g-8K.yaml", "recipes/llm/dpo-llama3.2-1b-instruct-1n8g-fsdp2tp1.v2.yaml",
           "recipes/llm/sft-llama3.1-8b-1n8g-fsdp2tp1-lora.yaml"]


@pytest.mark.parametrize("name", ["grpo_math_1B.yaml", "dpo.yaml", "sft.yaml", "rm.yaml", "distillation_math.yaml", "ppo_math_1B.yaml",
                                  *RECIPES])
def test_nemo_rls_file_trains_two_steps_with_only_its_own_key_paths(name, prefect_harness, tmp_path):
    kind = _kind(name)
    overrides = [o for o in COMMON if not o.startswith(("data.train=", "data.validation=", "data.default="))]
    overrides += [o for o in BY_KIND[kind] if not o.startswith("logger.")] + _local_data(kind, tmp_path)
    root = str(tmp_path / "runs")
    overrides.append(f"logger.log_dir={tmp_path / 'logs'}")  # sft.yaml turns TensorBoard on: not into the checkout
    proc = run_nrl(["train", "--config", os.path.join(CONFIGS, name), *overrides, "--storage", root, "--run-id", "nemo"],
                   prefect_harness, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "NeMo-RL keys ignored" in proc.stderr  # one line naming them
    with open(os.path.join(root, "nemo", "metrics.jsonl"), encoding="utf-8") as fh:
        steps = [json.loads(line)["step"] for line in fh if line.strip()]
    assert steps == [1, 2]
    with open(os.path.join(root, "nemo", "config.yaml"), encoding="utf-8") as fh:
        saved = fh.read()
    assert "${" not in saved and "megatron_cfg" not in saved and "checkpoint_dir" not in saved  # resolved and mapped
    final = os.path.join(root, "nemo", "checkpoints", "step_000002")
    assert os.path.isdir(final)
    if "lora" in name:  # the recipe's policy.dtensor_cfg.lora_cfg trained an adapter, not the full model
        assert "adapter_config.json" in os.listdir(os.path.join(final, "weights")), os.listdir(final)
