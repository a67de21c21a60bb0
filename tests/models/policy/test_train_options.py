"""Training options on a one-rank worker in this process: bfloat16 autocast with float32
master weights, LR warm-up, gradient clipping, refit dtype."""

from __future__ import annotations

import pytest
import torch

from nrl_tasks.algorithms.loss_functions import NLLLossFn
from nrl_tasks.models.policy import PolicyConfig
from nrl_tasks.models.policy.workers import sharding

from nrl_tasks.models.policy.workers.in_process import in_process_worker

from .helpers import make_batch

LR, CLIP = 1e-3, 1e-3


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    cfg = PolicyConfig(
        model_name=tiny_model_dir,
        train_global_batch_size=8,
        train_micro_batch_size=4,
        precision="bfloat16",
        max_grad_norm=CLIP,
        optimizer={"kwargs": {"lr": LR}},
        scheduler={"name": "constant", "warmup_steps": 4},
        generation={"precision": "bfloat16"},
    )
    with in_process_worker(cfg) as w:
        yield w


def test_bfloat16_autocast_keeps_float32_masters(worker, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    assert all(p.dtype == torch.float32 for p in worker.model.parameters())
    batch = make_batch(4, 16, seed=1, rl_keys=False)
    lp = worker.get_logprobs(batch)["logprobs"]
    assert lp.dtype == torch.float32
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        logits = ref(batch["input_ids"]).logits[:, :-1].float()
    exact = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = torch.arange(16)[None, 1:] < batch["input_lengths"][:, None]
    diff = (lp[:, 1:] - exact).abs()[mask]
    assert 0 < float(diff.max()) < 0.05  # bf16 matmuls: close, but not float32-exact


def test_warmup_and_clipping(worker):
    (shard,) = sharding.shard_for_train(make_batch(8, 16, seed=2), 1, worker.cfg, batch_size=8)
    first = worker.train(shard, NLLLossFn())
    # LambdaLR: lr = LR * (step + 1) / 4 during warm-up; reported after the step's scheduler tick
    assert first["lr"] == [pytest.approx(LR * 2 / 4)]
    assert first["grad_norm"][0] > CLIP  # pre-clip norm is reported ...
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in worker.get_gradients().values()))
    assert float(norm) == pytest.approx(CLIP, rel=1e-3)  # ... and the applied gradient was clipped
    second = worker.train(shard, NLLLossFn())
    assert second["lr"] == [pytest.approx(LR * 3 / 4)]
    assert worker.weights_version == 2


def test_refit_tensors_use_the_generation_precision(worker):
    from nrl_tasks.utils.refit import RefitInfo

    info = RefitInfo.from_dict(worker.prepare_refit_info())
    assert {dtype for _, _, dtype in info.metadata} == {torch.bfloat16}
    assert [name for name, _, _ in info.metadata] == list(worker.model.state_dict().keys())
    assert worker.weights_checksum() != worker.weights_checksum(as_sent=False)
