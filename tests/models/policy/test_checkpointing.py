"""Checkpoint files: safetensors + JSON round trips, atomic directory writes, clear errors."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from nrl_tasks.models.policy import PolicyConfig
from nrl_tasks.models.policy.workers import checkpointing as ckpt
from nrl_tasks.models.policy.workers.optim import build_optimizer, build_scheduler
from nrl_tasks.models.policy.workers.rng import capture_rng_state, restore_rng_state


def _trained_optimizer(seed: int, steps: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    cfg = PolicyConfig(model_name="/m", optimizer={"kwargs": {"lr": 0.1}}, scheduler={"name": "cosine", "warmup_steps": 1, "total_steps": 10})
    named = list(model.named_parameters())
    opt = build_optimizer(named, cfg.optimizer)
    sched = build_scheduler(opt, cfg.scheduler)
    for _ in range(steps):
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched, [n for n, _ in named]


def test_optimizer_and_scheduler_round_trip(tmp_path):
    model, opt, sched, names = _trained_optimizer(0, 3)
    ckpt.optimizer_state_to_files(opt, names, sched, str(tmp_path), {"weights_version": 3})
    assert sorted(os.listdir(tmp_path)) == ["optimizer.json", "optimizer.safetensors"]
    fresh_model, fresh_opt, fresh_sched, _ = _trained_optimizer(1, 0)
    doc = ckpt.load_optimizer_state(fresh_opt, names, fresh_sched, str(tmp_path))
    assert doc["weights_version"] == 3
    a, b = opt.state_dict(), fresh_opt.state_dict()
    assert a["param_groups"] == [dict(g, betas=tuple(g["betas"])) for g in b["param_groups"]]
    for idx, state in a["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["state"][idx][key]), (idx, key)
    assert sched.state_dict() == fresh_sched.state_dict()
    # the restored optimizer continues exactly like the original
    fresh_model.load_state_dict(model.state_dict())
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (fresh_model, fresh_opt)):
        m(x).pow(2).sum().backward()
        o.step()
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(p, q)


def test_optimizer_mismatch_names_the_parameter(tmp_path):
    _, opt, sched, names = _trained_optimizer(0, 1)
    ckpt.optimizer_state_to_files(opt, names, sched, str(tmp_path), {})
    _, other, other_sched, _ = _trained_optimizer(0, 0)
    with pytest.raises(ValueError, match=r"differ from the model's at #1 .*'0.bias'.*'renamed'"):
        ckpt.load_optimizer_state(other, [names[0], "renamed", *names[2:]], other_sched, str(tmp_path))
    with pytest.raises(ValueError, match="no optimizer.json"):
        ckpt.load_optimizer_state(other, names, other_sched, str(tmp_path / "missing"))


def test_rng_round_trip(tmp_path):
    torch.manual_seed(5)
    random.seed(6)
    np.random.seed(7)
    tensors, state = capture_rng_state()
    ckpt.write_rng_files(str(tmp_path), 0, tensors, state)
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    restore_rng_state(*ckpt.load_rng_files(str(tmp_path), 0))
    assert torch.equal(torch.rand(3), want[0]) and random.random() == want[1] and np.random.rand() == want[2]
    with pytest.raises(ValueError, match="data-parallel rank 1"):
        ckpt.load_rng_files(str(tmp_path), 1)


def test_write_dir_atomically(tmp_path):
    target = tmp_path / "ckpt"

    def write(tag):
        def fn(tmp):
            with open(os.path.join(tmp, "a.txt"), "w") as fh:
                fh.write(tag)
        return fn

    ckpt.write_dir_atomically(str(target), write("one"))
    ckpt.write_dir_atomically(str(target), write("two"))
    assert (target / "a.txt").read_text() == "two"

    def boom(tmp):
        write("three")(tmp)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.write_dir_atomically(str(target), boom)
    assert (target / "a.txt").read_text() == "two"  # old checkpoint intact
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temp dir left behind


def test_load_hf_weights_errors(tmp_path):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        ckpt.load_hf_weights_into(model, str(tmp_path))
    save_file({"weight": torch.zeros(2, 3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no tensor 'bias'"):
        ckpt.load_hf_weights_into(model, str(tmp_path))
    save_file({"weight": torch.zeros(2, 3), "bias": torch.zeros(5)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'bias'.*shape \[5\]"):
        ckpt.load_hf_weights_into(model, str(tmp_path))
    save_file({"weight": torch.ones(2, 3), "bias": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    assert ckpt.load_hf_weights_into(model, str(tmp_path)) == 2
    assert torch.equal(model.weight, torch.ones(2, 3))
