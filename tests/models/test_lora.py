"""LoRA GRPO on the policy worker (``policy.dtensor_cfg.lora_cfg``, built with ``peft``): only the
adapters train and sit in the optimizer, the reference is the base model, a refit sends only the
adapters (the merged HF weights for vLLM), checkpoints are peft adapters (+ merged HF folders) and resume is
bit-identical. Real torch training on the tiny model in one in-process worker."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn
from nrl_tasks.models.policy import LoRAConfig, PolicyConfig
from nrl_tasks.models.policy.workers.in_process import in_process_worker
from nrl_tasks.models.policy.workers.logprobs import padded_forward_logprobs
from nrl_tasks.models.policy.workers.lora import merged_named_tensors, merged_weights_path, wrap_with_lora
from nrl_tasks.utils.refit import weights_checksum

from .policy.helpers import make_batch

pytest.importorskip("peft")

GBS, WIDTH = 8, 24
LOSS = ClippedPGLossFn({"reference_policy_kl_penalty": 0.05})


def _cfg(model_dir: str, **lora: object) -> PolicyConfig:
    extra = {k: lora.pop(k) for k in ("precision", "sequence_packing", "dynamic_batching") if k in lora}
    return PolicyConfig(
        model_name=model_dir, train_global_batch_size=GBS, train_micro_batch_size=4, max_grad_norm=1.0,
        max_total_sequence_length=64, optimizer={"kwargs": {"lr": 1e-2, "weight_decay": 0.0}},
        dtensor_cfg={"lora_cfg": {"enabled": True, "dim": 8, "alpha": 32, **lora}}, **extra,
    )


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()


def _state(worker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.model.state_dict().items()}


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


def test_config_defaults_errors_and_hash():
    from flows.config import config_hash, load_config
    from tests.fixtures.grpo_runs import TINY_CONFIG

    d = LoRAConfig()
    assert (d.enabled, d.target_modules, d.exclude_modules, d.match_all_linear, d.dim, d.alpha, d.dropout,
            d.lora_A_init, d.save_merged) == (False, [], [], True, 8, 32, 0.0, "xavier", False)
    with pytest.raises(ValueError, match="lora_cfg.lora_A_init"):
        LoRAConfig(lora_A_init="uniform")
    with pytest.raises(ValueError, match="lora_cfg.target_modules"):
        LoRAConfig(enabled=True, target_modules=["q_proj"])  # match_all_linear is on
    with pytest.raises(ValueError, match="lora_cfg.target_modules"):
        LoRAConfig(enabled=True, match_all_linear=False)
    # disabled: the hashes of existing runs and live policies do not change; enabled: they do
    assert config_hash(load_config(TINY_CONFIG)) == "d694865e842f5e20"
    assert config_hash(load_config(TINY_CONFIG, ["policy.dtensor_cfg.lora_cfg.dim=4"])) == "d694865e842f5e20"
    lora_run = load_config("configs/grpo_tiny_lora.yaml")
    assert lora_run.policy.dtensor_cfg.lora_cfg.enabled and lora_run.policy.dtensor_cfg.lora_cfg.dim == 8
    assert config_hash(lora_run) != "d694865e842f5e20"
    off = PolicyConfig(model_name="m")
    assert off.config_hash() == PolicyConfig(model_name="m", dtensor_cfg={"lora_cfg": {"dim": 4}}).config_hash()
    assert off.config_hash() != PolicyConfig(model_name="m", dtensor_cfg={"lora_cfg": {"enabled": True}}).config_hash()


def test_unknown_modules_are_named(tiny_model_dir):
    for key, lora in (("target_modules", {"match_all_linear": False, "target_modules": ["q_proj", "qkv"]}),
                      ("exclude_modules", {"exclude_modules": ["nope"]})):
        cfg = LoRAConfig(enabled=True, **lora)
        with pytest.raises(ValueError, match=rf"policy\.dtensor_cfg\.lora_cfg\.{key}.*\['(qkv|nope)'\]"):
            wrap_with_lora(_hf(tiny_model_dir), cfg)


def test_all_linear_minus_excluded_and_targets(tiny_model_dir):
    model = wrap_with_lora(_hf(tiny_model_dir), LoRAConfig(enabled=True, exclude_modules=["down_proj"]))
    adapted = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A") and "base_layer" not in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"}  # no lm_head, no down_proj
    picked = wrap_with_lora(_hf(tiny_model_dir), LoRAConfig(enabled=True, match_all_linear=False, target_modules=["q_proj"]))
    assert {n.rsplit(".", 1)[-1] for n, m in picked.named_modules() if hasattr(m, "lora_A")} == {"q_proj"}


def test_training_moves_only_adapters_and_reference_is_the_base(tiny_model_dir):
    base = _hf(tiny_model_dir)
    batch = make_batch(GBS * 2, WIDTH, seed=3)
    with in_process_worker(_cfg(tiny_model_dir)) as worker:
        assert worker.reference is None  # no copy of the initial weights with LoRA
        names = worker.param_names
        assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
        in_opt = [p for g in worker.optimizer.param_groups for p in g["params"]]
        assert [id(p) for p in in_opt] == [id(p) for p in worker.params]
        assert {n for n, p in worker.model.named_parameters() if p.requires_grad} == set(names)
        before = _state(worker)
        base_sum = weights_checksum(merged_named_tensors(worker.model, merge=False))
        worker.train(batch, LOSS)
        after = _state(worker)
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        assert changed and all(".lora_" in k for k in changed)
        assert any(".lora_A." in k for k in changed) and any(".lora_B." in k for k in changed)
        assert weights_checksum(merged_named_tensors(worker.model, merge=False)) == base_sum
        assert {k.split(".state.", 1)[-1] for k in _opt_tensor_names(worker)} <= set(names)
        # reference = base model, bit for bit (same function, same threads); live policy differs
        ref = worker.get_reference_policy_logprobs(batch)["reference_logprobs"]
        want = padded_forward_logprobs(base, batch["input_ids"], batch["input_lengths"], 1.0)
        assert torch.equal(ref, want)
        assert not torch.equal(worker.get_logprobs(batch)["logprobs"], ref)


def _opt_tensor_names(worker) -> list[str]:
    return [worker.param_names[i] for i in worker.optimizer.state_dict()["state"]]


def test_adapters_only_refit_info_lists_the_adapters_and_their_layout(tiny_model_dir):
    """With the HF generation backend (or none) a refit announces only ``lora_A``/``lora_B`` of each
    adapted module, with the layout (rank, alpha, modules) in the fingerprint; the checksum is of
    those tensors; a consumer applying another layout fails the check naming both."""
    from nrl_tasks.models.policy.workers.lora import adapter_named_tensors
    from nrl_tasks.utils.refit import RefitInfo, RefitMismatchError

    with in_process_worker(_cfg(tiny_model_dir, match_all_linear=False, target_modules=["q_proj", "v_proj"])) as worker:
        worker.train(make_batch(GBS, WIDTH, seed=4), LOSS)
        info = RefitInfo.from_dict(worker.prepare_refit_info())
        base = worker.model.get_base_model()
        modules = [n for n, m in base.named_modules() if n.endswith(("q_proj", "v_proj")) and hasattr(m, "lora_A")]
        assert info.adapter == {"r": 8, "alpha": 32.0, "modules": modules}
        assert [n for n, _, _ in info.metadata] == [f"{m}.lora_{ab}.weight" for m in modules for ab in "AB"]
        assert worker.weights_checksum() == weights_checksum(adapter_named_tensors(base))
        assert worker.weights_checksum(as_sent=False) != worker.weights_checksum()
        info.check(info.metadata, adapter=dict(info.adapter))
        with pytest.raises(RefitMismatchError, match="r=16"):
            info.check(info.metadata, adapter={**info.adapter, "r": 16})
        with pytest.raises(RefitMismatchError, match="full weights"):
            info.check(info.metadata)


def test_merged_tensors_are_the_hf_weights_of_the_adapted_model(tiny_model_dir):
    """What ``save_merged`` writes: the HF weights of the adapted model, as copies (the live
    weights untouched), bit-identical to peft's in-place merge."""
    from nrl_tasks.models.generation.hf_worker import hf_refit_named_tensors

    ids = make_batch(4, WIDTH, seed=5, rl_keys=False)["input_ids"]
    with in_process_worker(_cfg(tiny_model_dir)) as worker:
        worker.train(make_batch(GBS, WIDTH, seed=4), LOSS)
        live = _state(worker)
        merged = dict(merged_named_tensors(worker.model))
        assert all(torch.equal(v, worker.model.state_dict()[k]) for k, v in live.items())  # untouched
        hf = _hf(tiny_model_dir)
        assert [(n, tuple(t.shape)) for n, t in hf_refit_named_tensors(hf)] == [(n, tuple(t.shape)) for n, t in merged.items()]
        hf.load_state_dict(merged, strict=False)
        worker.model.eval()
        torch.testing.assert_close(_logits(hf, ids), _logits(worker.model, ids), rtol=1e-5, atol=1e-5)
        # the copy equals peft's in-place merge bit for bit; merge + unmerge need not give W back
        twin = copy.deepcopy(worker.model)
        twin.merge_adapter()
        in_place = dict(merged_named_tensors(twin, merge=False))
        assert all(torch.equal(in_place[k], v) for k, v in merged.items())


def test_a_vllm_generation_backend_gets_adapters_only_refits_too(tiny_model_dir):
    """The vLLM backend applies adapters with vLLM's LoRA support, so its refit info is the same
    adapters-only one as the HF backend's (layout, names and checksum)."""
    from nrl_tasks.models.generation.interfaces import GenerationConfig
    from nrl_tasks.utils.refit import RefitInfo

    infos = []
    for backend in ("hf", "vllm"):
        cfg = _cfg(tiny_model_dir).model_copy(update={"generation": GenerationConfig(model_name=tiny_model_dir, backend=backend)})
        with in_process_worker(cfg) as worker:
            worker.train(make_batch(GBS, WIDTH, seed=4), LOSS)
            infos.append((RefitInfo.from_dict(worker.prepare_refit_info()), worker.weights_checksum()))
    (hf_info, hf_sum), (vllm_info, vllm_sum) = infos
    assert vllm_info.adapter is not None and vllm_info.adapter == hf_info.adapter
    assert vllm_info.fingerprint == hf_info.fingerprint and vllm_sum == hf_sum
    assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n, _, _ in vllm_info.metadata)


def test_checkpoint_is_a_peft_adapter_and_a_merged_hf_folder(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = make_batch(4, WIDTH, seed=6, rl_keys=False)["input_ids"]
    weights = str(tmp_path / "weights")
    with in_process_worker(_cfg(tiny_model_dir, save_merged=True)) as worker:
        worker.train(make_batch(GBS, WIDTH, seed=7), LOSS)
        worker.save_checkpoint(weights, str(tmp_path / "optimizer"), None, [worker.get_rng_state()])
        worker.model.eval()
        want = _logits(worker.model, ids)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(weights))
    peft_model = PeftModel.from_pretrained(_hf(tiny_model_dir), weights).eval()
    assert torch.equal(_logits(peft_model, ids), want)
    merged_dir = merged_weights_path(weights)
    assert not os.path.exists(os.path.join(merged_dir, "adapter_config.json"))
    plain = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32, local_files_only=True).eval()
    torch.testing.assert_close(_logits(plain, ids), want, rtol=1e-5, atol=1e-5)


_SAVE_ADAPTER = r"""
import sys
sys.path.insert(0, sys.argv[1])
from tests.models.test_lora import _cfg
from nrl_tasks.models.policy.workers.in_process import in_process_worker
with in_process_worker(_cfg(sys.argv[2], exclude_modules=["down_proj"])) as worker:
    worker.save_checkpoint(sys.argv[3], None, None, [worker.get_rng_state()])
"""


def test_adapter_config_is_the_same_bytes_whatever_the_hash_seed(tiny_model_dir, tmp_path):
    """peft holds ``target_modules`` / ``exclude_modules`` as sets: the checkpoint's
    ``adapter_config.json`` lists them sorted, so a resumed run (another process, another string
    hash seed) writes the same bytes as the uninterrupted one."""
    import json
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    configs = []
    for seed in ("1", "2"):
        weights = str(tmp_path / f"weights-{seed}")
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-c", _SAVE_ADAPTER, repo, tiny_model_dir, weights], env=env, check=True)
        with open(os.path.join(weights, "adapter_config.json"), "rb") as fh:
            configs.append(fh.read())
    assert configs[0] == configs[1]
    data = json.loads(configs[0])
    assert data["target_modules"] == sorted(data["target_modules"]) and len(data["target_modules"]) > 2, data
    assert "down_proj" not in data["target_modules"] and data["exclude_modules"] == ["down_proj"], data


def test_resume_from_an_adapter_checkpoint_is_bit_identical(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, dropout=0.1)  # dropout: the restored RNG matters too
    b1, b2 = make_batch(GBS, WIDTH, seed=8), make_batch(GBS, WIDTH, seed=9)
    w, o = str(tmp_path / "weights"), str(tmp_path / "optimizer")
    with in_process_worker(cfg) as worker:
        worker.train(b1, LOSS)
        worker.save_checkpoint(w, o, None, [worker.get_rng_state()])
        worker.train(b2, LOSS)
        uninterrupted, version, checksum = _state(worker), worker.weights_version, worker.weights_checksum()
    with in_process_worker(cfg) as fresh:
        assert fresh.load_checkpoint(w, o)["weights_version"] == 1
        fresh.train(b2, LOSS)
        resumed = _state(fresh)
        assert fresh.weights_version == version and fresh.weights_checksum() == checksum
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


def test_packing_dynamic_batching_and_bf16_train_with_adapters(tiny_model_dir):
    batch = make_batch(GBS, WIDTH, seed=10)
    packing = {"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 96, "sequence_length_pad_multiple": 4}
    dynamic = {"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 96, "sequence_length_round": 8}
    losses = {}
    modes = (("plain", {}), ("packing", {"sequence_packing": packing}), ("dynamic", {"dynamic_batching": dynamic}),
             ("bf16", {"precision": "bfloat16"}))
    for name, extra in modes:
        cfg = _cfg(tiny_model_dir, **extra)
        with in_process_worker(cfg) as worker:
            shard = batch
            if name == "dynamic":
                shard = batch.shard_by_batch_size(1, batch_size=GBS, dynamic_batching_cfg={
                    "max_tokens_per_microbatch": 64, "sequence_length_round": 8, "input_key": "input_ids",
                    "input_lengths_key": "input_lengths"})[0][0]
            if name == "packing":
                shard = batch.shard_by_batch_size(1, batch_size=GBS, sequence_packing_cfg={
                    "max_tokens_per_microbatch": 64, "input_key": "input_ids", "input_lengths_key": "input_lengths",
                    "algorithm": "modified_first_fit_decreasing", "sequence_length_pad_multiple": 4})[0][0]
            losses[name] = worker.train(shard, LOSS)["global_loss"]
            assert all(p.dtype == torch.float32 for p in worker.params)
            lp = worker.get_logprobs(batch)["logprobs"]
            assert torch.isfinite(lp).all()
    np.testing.assert_allclose(losses["packing"], losses["plain"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses["dynamic"], losses["plain"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses["bf16"], losses["plain"], rtol=5e-2, atol=5e-3)


@pytest.mark.timeout(300)
def test_refit_of_trained_adapters_over_ray(ray_session, tiny_model_dir):
    """A Ray ``Policy`` with LoRA trains one NLL step and refits an ``HfGeneration`` worker through
    the packed broadcast with only the adapter tensors (a small fraction of the full state dict):
    the worker's base weights stay as loaded, its checksum then equals the policy's, its greedy
    outputs equal the policy's own ``generate`` token for token and logprob for logprob, and a
    second train + refit moves the same adapter bytes again."""
    import uuid

    import ray
    from transformers import AutoTokenizer

    from nrl_tasks.algorithms.loss_functions import NLLLossFn
    from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster
    from nrl_tasks.models.generation.hf_generation import HfGeneration
    from nrl_tasks.models.generation.hf_worker import hf_refit_named_tensors
    from nrl_tasks.models.generation.interfaces import GenerationConfig
    from nrl_tasks.models.policy.lm_policy import Policy
    from nrl_tasks.utils.collective import find_free_port, get_node_ip
    from nrl_tasks.utils.refit import RefitInfo
    from tests.models.generation.test_policy_refit import _prompts, _train_batch

    tag = uuid.uuid4().hex[:8]
    namespace = f"nrl-lora-refit-{tag}"
    gen_cfg = GenerationConfig(model_name=tiny_model_dir, max_new_tokens=8, temperature=0.8, num_workers=1,
                               num_cpus_per_worker=0.5, refit_timeout_s=60)
    pcfg = _cfg(tiny_model_dir).model_copy(update={"generation": gen_cfg, "train_global_batch_size": 4,
                                                    "train_micro_batch_size": 2})
    policy_cluster = RayVirtualCluster([1], name=f"lpol-{tag}", num_cpus_per_bundle=1)
    gen_cluster = RayVirtualCluster([1], name=f"lgen-{tag}", num_cpus_per_bundle=0.5)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = Policy(policy_cluster, pcfg, tokenizer, namespace=namespace)
    gen = HfGeneration(gen_cluster, gen_cfg, namespace=namespace)
    full_bytes = sum(t.numel() * t.element_size() for _, t in hf_refit_named_tensors(_hf(tiny_model_dir)))
    base_checksum = gen.weights_checksum()
    assert base_checksum == weights_checksum(hf_refit_named_tensors(_hf(tiny_model_dir)))

    def refit(version: int) -> RefitInfo:
        info = policy.prepare_refit_info()
        gen.prepare_refit_info(info)
        ip, port = get_node_ip(), find_free_port()
        world = 1 + gen.refit_world_size
        ray.get(policy.init_collective(ip, port, world, train_world_size=1)
                + gen.init_collective(ip, port, world, rank_offset=1), timeout=120)
        ray.get(policy.broadcast_weights_for_collective() + gen.update_weights_from_collective(version), timeout=120)
        return RefitInfo.from_dict(info)

    try:
        prompts = _prompts(tokenizer)
        policy.train(_train_batch(gen.generate(prompts, weights_version=0)), NLLLossFn())
        info = refit(1)
        assert info.adapter is not None and info.adapter["r"] == 8 and info.adapter["modules"]
        assert {n.rsplit(".", 2)[-2] for n, _, _ in info.metadata} == {"lora_A", "lora_B"}
        assert 0 < info.total_bytes < 0.25 * full_bytes  # the tiny model's adapters; SmolLM2: see bench_lora
        assert gen.weights_version == 1 and gen.weights_checksum() == policy.weights_checksum()
        greedy_gen = gen.generate(prompts, greedy=True, weights_version=1)
        greedy_pol = policy.generate(prompts, greedy=True)
        assert torch.equal(greedy_gen["output_ids"], greedy_pol["output_ids"])
        assert torch.equal(greedy_gen["logprobs"], greedy_pol["logprobs"])
        out = gen.generate(prompts, weights_version=1)
        rows = out.__class__({"input_ids": out["output_ids"], "input_lengths": out["unpadded_sequence_lengths"]})
        lp = policy.get_logprobs(rows)["logprobs"]
        ref = policy.get_reference_policy_logprobs(rows)["reference_logprobs"]
        mask = out["logprobs"] != 0
        assert mask.any()
        torch.testing.assert_close(lp[mask], out["logprobs"][mask], atol=1e-4, rtol=1e-4)
        assert float((lp - ref)[mask].abs().max()) > 1e-4  # the adapters trained: not the base model
        policy.train(_train_batch(out), NLLLossFn())
        again = refit(2)
        assert again.fingerprint == info.fingerprint and again.total_bytes == info.total_bytes
        assert gen.weights_checksum() == policy.weights_checksum()
    finally:
        gen.shutdown()
        policy.shutdown()
        gen_cluster.shutdown()
        policy_cluster.shutdown()


_KEY = "policy.dtensor_cfg.lora_cfg"


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ([f"{_KEY}.match_all_linear=false", f"{_KEY}.target_modules=[no_such_proj]"],
         f"{_KEY}.target_modules: no module named ['no_such_proj'] in the model"),
        ([f"{_KEY}.exclude_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"],
         f"{_KEY}.exclude_modules ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'] excludes every module"),
        ([f"{_KEY}.match_all_linear=false", f"{_KEY}.target_modules=[q_proj]", f"{_KEY}.exclude_modules=[q_proj]"],
         f"{_KEY}.exclude_modules ['q_proj'] excludes every module of target_modules"),
        ([f"{_KEY}.dim=1e9"], f"{_KEY}.dim: Input should be less than or equal to 65536"),
        ([f"{_KEY}.alpha=1e300"], f"{_KEY}.alpha: Input should be less than or equal to 1048576"),
    ],
)
def test_lora_key_errors_are_refused_before_ray_starts(overrides, needle, tmp_path, monkeypatch, capsys, tiny_model_dir):
    """Unknown target modules, an exclude-all, ``dim=1e9`` (a 256 GB allocation) and
    ``alpha=1e300`` are config errors (exit 2) naming the key, found in preflight on the meta device
    (was: 60-108 s later, after Ray and the actors started, inside ``PolicyWorker.setup``)
    (issue 27, item 6a)."""
    import flows.run.runtime
    from flows.cli import main

    def tripwire(*a, **k):
        raise AssertionError("Ray started despite a bad LoRA config")

    monkeypatch.setattr(flows.run.runtime, "connect_ray", tripwire)
    argv = ["grpo", "--config", "configs/grpo_tiny_lora.yaml", "--storage", str(tmp_path / "runs"),
            f"policy.model_name={tiny_model_dir}", f"policy.tokenizer.name={tiny_model_dir}", *overrides]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("nrl: error:") == 1, err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
