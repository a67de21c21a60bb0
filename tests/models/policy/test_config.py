"""PolicyConfig: NeMo-RL keys, validation errors naming the key, LR schedule shape."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from nrl_tasks.models.policy import PolicyConfig, SchedulerConfig


def test_defaults_and_derived_values():
    cfg = PolicyConfig(model_name="/m", generation={"temperature": 0.7, "precision": "bfloat16"})
    assert cfg.tokenizer_path == "/m"
    assert cfg.temperature == 0.7
    assert cfg.refit_dtype == "bfloat16"
    assert cfg.effective_logprob_batch_size == cfg.train_micro_batch_size
    assert PolicyConfig(model_name="/m").temperature == 1.0
    assert PolicyConfig(model_name="/m").refit_dtype == "float32"
    other = PolicyConfig(model_name="/m", optimizer={"kwargs": {"lr": 1e-3}})
    assert cfg.config_hash() != other.config_hash()
    assert "optimizer.kwargs.lr" in PolicyConfig(model_name="/m").diff(other)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"model_name": "/m", "unknown_key": 1}, "unknown_key"),
        ({"model_name": "/m", "precision": "float16"}, "precision"),
        ({"model_name": "/m", "train_micro_batch_size": 8, "train_global_batch_size": 4}, "train_micro_batch_size"),
        ({"model_name": "/m", "dynamic_batching": {"enabled": True}}, "train_mb_tokens"),
        (
            {
                "model_name": "/m",
                "dynamic_batching": {"enabled": True, "train_mb_tokens": 8, "logprob_mb_tokens": 8},
                "sequence_packing": {"enabled": True, "train_mb_tokens": 8, "logprob_mb_tokens": 8},
            },
            "mutually exclusive",
        ),
        ({"model_name": "/m", "dtensor_cfg": {"tensor_parallel_size": 2}}, "tensor_parallel_size"),
        ({"model_name": "/m", "optimizer": {"name": "torch.optim.SGD"}}, "optimizer.name|AdamW"),
        ({"model_name": "/m", "optimizer": {"kwargs": {"betas": [0.9, 1.5]}}}, "betas"),
        ({"model_name": "/m", "scheduler": {"name": "cosine"}}, "total_steps"),
        ({"model_name": "/m", "max_grad_norm": 0}, "max_grad_norm"),
    ],
)
def test_bad_config_names_the_key(kwargs, match):
    with pytest.raises(ValidationError, match=match):
        PolicyConfig(**kwargs)


def test_schedule_factors():
    warm = SchedulerConfig(name="constant", warmup_steps=4)
    assert [warm.factor(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = SchedulerConfig(name="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    assert cos.factor(2) == pytest.approx(1.0)
    assert cos.factor(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos.factor(12) == pytest.approx(0.1) and cos.factor(50) == pytest.approx(0.1)
    lin = SchedulerConfig(name="linear", total_steps=10)
    assert [round(lin.factor(s), 6) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
