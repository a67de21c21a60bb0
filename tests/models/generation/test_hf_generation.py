"""HfGeneration: Ray actors generating in NeMo-RL's format and receiving packed refits over gloo.

The producer side of the refits here is the test process itself (``packed_broadcast_producer``
over a real stateless gloo group), standing in for the Policy; ``test_policy_refit.py`` runs
the same sequence from a real ``Policy``.
"""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from nrl_tasks.models.generation.hf_generation import HfGeneration, contiguous_bounds
from nrl_tasks.models.generation.hf_sampling import generate_batch
from nrl_tasks.models.generation.hf_worker import hf_refit_named_tensors
from nrl_tasks.models.generation.interfaces import GenerationConfig, StaleWeightsError

from ._tiny_lm import copy_into, encode_batch, load_lm

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["What is 3 + 4?", "Hello!", "The answer is", "One, two, three", "7 * 8 =", "Yes"]
BUFFER = 16 * 1024  # small packed buffers: the tiny model travels in several broadcasts


@pytest.fixture(scope="module")
def local_model(tiny_model_dir):
    return load_lm(tiny_model_dir)


@pytest.fixture(scope="module")
def batch(local_model):
    ids, lengths = encode_batch(local_model[1], PROMPTS)
    return {"input_ids": ids, "input_lengths": lengths, "seeds": torch.arange(len(PROMPTS)) * 7 + 1}


@pytest.fixture(scope="module")
def cfg(tiny_model_dir) -> GenerationConfig:
    return GenerationConfig(model_name=tiny_model_dir, max_new_tokens=8, temperature=0.9, top_k=50, num_workers=2,
                            num_cpus_per_worker=0.5, refit_timeout_s=20)


@pytest.fixture(scope="module")
def gen(ray_session, cfg):
    from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster

    tag = uuid.uuid4().hex[:8]
    cluster = RayVirtualCluster([2], name=f"gen-{tag}", num_cpus_per_bundle=0.5)
    group = HfGeneration(cluster, cfg, namespace=f"nrl-gen-{tag}")
    yield group
    group.shutdown()
    cluster.shutdown()


def _local(model, tok, batch, cfg, greedy):
    return generate_batch(model, tok, batch["input_ids"], batch["input_lengths"], max_new_tokens=cfg.max_new_tokens,
                          temperature=cfg.temperature, top_k=cfg.top_k, seeds=batch["seeds"], greedy=greedy)


def _perturbed_params(model, scale: float, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, (t + scale * torch.randn(t.shape, generator=g)).contiguous()) for n, t in hf_refit_named_tensors(model)]


def _refit(gen, named, version: int, *, timeout_s: float = 20.0, stop_after: int | None = None):
    """Run the refit sequence with this process as producer (rank 0); returns the worker refs."""
    import ray

    from nrl_tasks.utils.collective import create_broadcast_group, find_free_port
    from nrl_tasks.utils.packed_tensor import packed_broadcast_producer
    from nrl_tasks.utils.refit import RefitInfo

    gen.prepare_refit_info(RefitInfo.build(named, BUFFER, version).to_dict())
    port = find_free_port()
    world = 1 + gen.world_size
    refs = gen.init_collective("127.0.0.1", port, world, rank_offset=1, timeout_s=timeout_s)
    group = create_broadcast_group("127.0.0.1", port, 0, world, timeout_s=timeout_s)
    ray.get(refs)
    refs = gen.update_weights_from_collective(version)
    try:
        sent = named if stop_after is None else named[:stop_after]
        packed_broadcast_producer(iter(sent), group, 0, lambda item: item[1], buffer_size_bytes=BUFFER)
    finally:
        group.close()
    return refs


def test_contiguous_bounds():
    assert contiguous_bounds(6, 2) == [(0, 3), (3, 6)]
    assert contiguous_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert contiguous_bounds(2, 4) == [(0, 1), (1, 2)]


def test_generate_sharded_equals_local_decode_loop(gen, local_model, batch, cfg):
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict

    model, tok = local_model
    for greedy in (True, False):
        out = gen.generate(BatchedDataDict(batch), greedy=greedy)
        ref = _local(model, tok, batch, cfg, greedy)
        assert isinstance(out, BatchedDataDict)
        # per-row seeds make sampling independent of how rows were sharded over the workers
        for i in range(len(PROMPTS)):
            n = int(ref["unpadded_sequence_lengths"][i])
            assert out["output_ids"][i, :n].tolist() == ref["output_ids"][i, :n].tolist(), (greedy, i)
            assert (out["output_ids"][i, n:] == tok.pad_token_id).all()
            torch.testing.assert_close(out["logprobs"][i, :n], ref["logprobs"][i, :n], atol=1e-5, rtol=0)
        for k in ("generation_lengths", "unpadded_sequence_lengths", "truncated"):
            assert torch.equal(out[k], ref[k]), k
    # fewer rows than workers
    one = {k: v[:1] for k, v in batch.items()}
    assert gen.generate(one, greedy=True)["output_ids"].shape[0] == 1


def test_per_row_stop_strings_reach_their_rows(gen, local_model, batch, cfg):
    model, tok = local_model
    ref = _local(model, tok, batch, cfg, True)
    i = 4  # a row of the second worker's shard
    n = int(batch["input_lengths"][i])
    text = tok.decode(ref["output_ids"][i, n + 1 : n + 3].tolist())
    assert text.strip(), "greedy continuation decodes to whitespace only"
    stops = [None] * len(PROMPTS)
    stops[i] = [text]
    out = gen.generate(dict(batch, stop_strings=stops), greedy=True)
    local = generate_batch(model, tok, batch["input_ids"], batch["input_lengths"], max_new_tokens=cfg.max_new_tokens,
                           greedy=True, stop_strings=stops)
    assert int(out["generation_lengths"][i]) <= 3 and not out["truncated"][i]
    for k in ("generation_lengths", "truncated"):
        assert torch.equal(out[k], local[k]), k
    others = [j for j in range(len(PROMPTS)) if j != i]
    assert torch.equal(out["generation_lengths"][others], ref["generation_lengths"][others])


def test_merge_stop_strings():
    from nrl_tasks.models.generation.hf_worker import merge_stop_strings

    assert merge_stop_strings(None, None, 2) is None
    assert merge_stop_strings(["\n"], None, 2) == [["\n"], ["\n"]]
    assert merge_stop_strings(["\n"], [None, ["x", "\n"]], 2) == [["\n"], ["\n", "x"]]
    with pytest.raises(ValueError, match="3 entries for a batch of 2"):
        merge_stop_strings(None, [None, None, None], 2)


def test_stale_version_refused_and_mark_stale(gen, batch, local_model):
    assert gen.weights_version == 0
    with pytest.raises(StaleWeightsError, match="holds weights version 0, asked for version 5"):
        gen.generate(batch, greedy=True, weights_version=5)
    gen.generate(batch, greedy=True, weights_version=0)
    gen.mark_stale()
    try:
        assert gen.weights_version is None
        with pytest.raises(StaleWeightsError, match="stale"):
            gen.generate(batch, greedy=True)
    finally:
        gen.set_weights_version(0)
    # set_weights_version does not clear staleness: only a complete refit does
    assert all(s["stale"] for s in gen.weights_state())
    _restore_fresh(gen, local_model)  # a complete refit (of the original weights) clears it


def _restore_fresh(gen, local_model):
    import ray

    ray.get(_refit(gen, hf_refit_named_tensors(local_model[0]), 0), timeout=60)
    assert gen.weights_version == 0


def test_refit_mismatch_names_the_parameter(gen, local_model):
    from nrl_tasks.utils.refit import RefitInfo, RefitMismatchError

    named = hf_refit_named_tensors(local_model[0])
    bad_shape = [(n, t[:-1] if n.endswith("layers.1.mlp.up_proj.weight") else t) for n, t in named]
    with pytest.raises(RefitMismatchError, match="model.layers.1.mlp.up_proj.weight"):
        gen.prepare_refit_info(RefitInfo.build(bad_shape, BUFFER, 1).to_dict())
    bad_dtype = [(n, t.to(torch.bfloat16) if n == "model.norm.weight" else t) for n, t in named]
    with pytest.raises(RefitMismatchError, match="model.norm.weight.*dtype"):
        gen.prepare_refit_info(RefitInfo.build(bad_dtype, BUFFER, 1).to_dict())
    with pytest.raises(RefitMismatchError, match="missing"):
        gen.prepare_refit_info(RefitInfo.build(named[:-1], BUFFER, 1).to_dict())


def test_failed_refit_stays_stale_then_retry_succeeds(gen, local_model, batch, cfg):
    import ray

    model, tok = local_model
    named = _perturbed_params(model, 0.05, seed=1)
    refs = _refit(gen, named, 1, timeout_s=3.0, stop_after=len(named) // 2)
    with pytest.raises(Exception) as info:
        ray.get(refs, timeout=60)
    assert "broadcast" in str(info.value).lower() or "timeout" in str(info.value).lower()
    assert all(s["stale"] for s in gen.weights_state()) and gen.weights_version is None
    with pytest.raises(StaleWeightsError):
        gen.generate(batch, greedy=True)
    with pytest.raises(StaleWeightsError):
        gen.generate(batch, greedy=True, weights_version=1)

    # retry: the workers closed their broken group; tear down anyway (idempotent) and redo it all
    gen.teardown_collective()
    stats = ray.get(_refit(gen, named, 1), timeout=60)
    assert [s["weights_version"] for s in stats] == [1, 1] and stats[0]["tensors"] == len(named)
    assert gen.weights_version == 1

    from nrl_tasks.utils.refit import weights_checksum

    assert gen.weights_checksum() == weights_checksum(named)
    copy_into(model, named)  # the local copy now matches what was broadcast
    out = gen.generate(batch, greedy=True, weights_version=1)
    ref = _local(model, tok, batch, cfg, True)
    assert torch.equal(out["output_ids"], ref["output_ids"])
    with pytest.raises(StaleWeightsError):
        gen.generate(batch, greedy=True, weights_version=0)


def test_generate_waits_for_refit_in_progress(gen, local_model, batch):
    """A generate issued during a refit runs after it (actors are sequential) on the new version."""
    import ray

    model = local_model[0]
    named = _perturbed_params(model, 0.0, seed=2)
    results: dict[str, object] = {}

    def call_generate():
        try:
            results["out"] = gen.generate(batch, greedy=True, weights_version=2)
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion below
            results["err"] = exc

    refs = _refit_async_start(gen, named, 2)
    t = threading.Thread(target=call_generate)
    t.start()
    refs_done = refs["finish"]()
    ray.get(refs_done, timeout=60)
    t.join(60)
    assert "err" not in results, results.get("err")
    assert results["out"]["output_ids"].shape[0] == len(PROMPTS)


def _refit_async_start(gen, named, version):
    """Start a refit whose producer sends only when ``finish()`` is called."""
    import ray

    from nrl_tasks.utils.collective import create_broadcast_group, find_free_port
    from nrl_tasks.utils.packed_tensor import packed_broadcast_producer
    from nrl_tasks.utils.refit import RefitInfo

    gen.prepare_refit_info(RefitInfo.build(named, BUFFER, version).to_dict())
    port = find_free_port()
    world = 1 + gen.world_size
    refs = gen.init_collective("127.0.0.1", port, world, rank_offset=1)
    group = create_broadcast_group("127.0.0.1", port, 0, world)
    ray.get(refs)
    update_refs = gen.update_weights_from_collective(version)

    def finish():
        try:
            packed_broadcast_producer(iter(named), group, 0, lambda item: item[1], buffer_size_bytes=BUFFER)
        finally:
            group.close()
        return update_refs

    return {"finish": finish}


def test_attach_by_name(gen, batch):
    other = HfGeneration.attach(name_prefix="generation", namespace=gen.worker_group.namespace)
    assert other.world_size == 2
    assert other.weights_version == gen.weights_version
    a = gen.generate(batch, greedy=True)
    b = other.generate(batch, greedy=True)
    assert torch.equal(a["output_ids"], b["output_ids"])
    with pytest.raises(LookupError, match="generation-0"):
        HfGeneration.attach(name_prefix="generation", namespace="nrl-no-such-run")


def test_config_validation(tiny_model_dir):
    with pytest.raises(ValueError, match="temperature"):
        GenerationConfig(temperature=0)
    with pytest.raises(ValueError, match="top_k"):
        GenerationConfig(top_k=0)
    assert GenerationConfig(top_k=-1).top_k is None
    with pytest.raises(ValueError, match="backend"):
        GenerationConfig(backend="sglang")
    with pytest.raises(ValueError, match="extra"):
        GenerationConfig(max_tokens=3)
