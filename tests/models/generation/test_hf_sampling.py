"""The shared decode loop against Hugging Face's own generate and a teacher-forced forward."""

from __future__ import annotations

import pytest
import torch

from nrl_tasks.models.generation.hf_sampling import filter_top_k_top_p, generate_batch

from ._tiny_lm import encode_batch, make_lm, teacher_forced_logprobs

PROMPTS = ["the quick", "12 + 7 =", "hello world, hello", "a"]


@pytest.fixture(scope="module")
def lm():
    return make_lm(seed=0)


@pytest.fixture(scope="module")
def batch(lm):
    return encode_batch(lm[1], PROMPTS)


def _gen_tokens(out: dict, lengths: torch.Tensor, i: int) -> list[int]:
    n, g = int(lengths[i]), int(out["generation_lengths"][i])
    return out["output_ids"][i, n : n + g].tolist()


def test_greedy_equals_hf_generate(lm, batch):
    model, tok = lm
    ids, lengths = batch
    out = generate_batch(model, tok, ids, lengths, max_new_tokens=12, greedy=True)

    for i in range(len(PROMPTS)):
        prompt = ids[i : i + 1, : int(lengths[i])]
        ref = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )[0, prompt.shape[1] :].tolist()
        assert _gen_tokens(out, lengths, i) == ref, f"row {i}"
    # a batched, left-padded HF generate agrees too
    width = int(lengths.max())
    left = torch.full((len(PROMPTS), width), tok.pad_token_id)
    mask = torch.zeros_like(left)
    for i in range(len(PROMPTS)):
        n = int(lengths[i])
        left[i, width - n :] = ids[i, :n]
        mask[i, width - n :] = 1
    ref_b = model.generate(
        input_ids=left, attention_mask=mask, do_sample=False, max_new_tokens=12,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )[:, width:]
    for i in range(len(PROMPTS)):
        assert _gen_tokens(out, lengths, i) == ref_b[i, : int(out["generation_lengths"][i])].tolist()


def test_output_format_invariants(lm, batch):
    model, tok = lm
    ids, lengths = batch
    out = generate_batch(
        model, tok, ids, lengths, max_new_tokens=9, temperature=0.8, top_k=30, top_p=0.95,
        seeds=torch.arange(len(PROMPTS)) + 100,
    )
    gl = out["generation_lengths"]
    assert out["output_ids"].shape == (len(PROMPTS), ids.shape[1] + int(gl.max()))
    assert out["logprobs"].shape == out["output_ids"].shape and out["logprobs"].dtype == torch.float32
    assert torch.equal(out["unpadded_sequence_lengths"], lengths + gl)
    assert out["truncated"].dtype == torch.bool
    for i in range(len(PROMPTS)):
        n, g = int(lengths[i]), int(gl[i])
        assert torch.equal(out["output_ids"][i, :n], ids[i, :n])
        assert (out["output_ids"][i, n + g :] == tok.pad_token_id).all()
        assert (out["logprobs"][i, :n] == 0).all() and (out["logprobs"][i, n + g :] == 0).all()
        assert (out["logprobs"][i, n : n + g] < 0).all()
        assert 1 <= g <= 9
        assert bool(out["truncated"][i]) == (g == 9 and out["output_ids"][i, n + g - 1] != tok.eos_token_id)


@pytest.mark.parametrize("greedy", [False, True])
def test_logprobs_equal_teacher_forced_forward(lm, batch, greedy):
    model, tok = lm
    ids, lengths = batch
    temperature = 0.7
    out = generate_batch(
        model, tok, ids, lengths, max_new_tokens=10, temperature=temperature, top_k=40, top_p=0.9,
        seeds=torch.tensor([1, 2, 3, 4]), greedy=greedy,
    )
    assert torch.equal(out["unpadded_sequence_lengths"] - out["generation_lengths"], lengths)
    expected = teacher_forced_logprobs(model, out, temperature)
    torch.testing.assert_close(out["logprobs"], expected, atol=1e-4, rtol=1e-4)


def test_seeds_reproducible_and_batch_independent(lm, batch):
    model, tok = lm
    ids, lengths = batch
    kw = dict(max_new_tokens=10, temperature=1.0, ignore_eos=True)
    seeds = torch.tensor([11, 22, 33, 44])
    a = generate_batch(model, tok, ids, lengths, seeds=seeds, **kw)
    b = generate_batch(model, tok, ids, lengths, seeds=seeds, **kw)
    assert torch.equal(a["output_ids"], b["output_ids"])
    # row 2 alone, and in a batch of other rows in another order, samples the same tokens
    alone = generate_batch(model, tok, ids[2:3, : int(lengths[2])], lengths[2:3], seeds=seeds[2:3], **kw)
    assert _gen_tokens(alone, lengths[2:3], 0) == _gen_tokens(a, lengths, 2)
    order = torch.tensor([3, 2, 0])
    mixed = generate_batch(model, tok, ids[order], lengths[order], seeds=seeds[order], **kw)
    assert _gen_tokens(mixed, lengths[order], 1) == _gen_tokens(a, lengths, 2)
    # other seeds give other samples
    c = generate_batch(model, tok, ids, lengths, seeds=seeds + 1000, **kw)
    assert not torch.equal(a["output_ids"], c["output_ids"])


def test_repeated_prompts_share_a_prefill_and_sample_as_alone(lm, batch):
    """A GRPO-like batch (each prompt 3 times, groups interleaved): one prefill per distinct prompt,
    and every row samples what it samples alone with its seed, with teacher-forced logprobs."""
    model, tok = lm
    ids, lengths = batch
    order = torch.tensor([0, 1, 0, 2, 1, 0, 2, 1, 2])
    seeds = torch.arange(100, 100 + len(order))
    kw = dict(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    prefill_rows: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, args, kwargs: prefill_rows.append(kwargs["input_ids"].shape[0]) if kwargs["input_ids"].shape[1] > 1 else None,
        with_kwargs=True,
    )
    try:
        out = generate_batch(model, tok, ids[order], lengths[order], seeds=seeds, **kw)
    finally:
        hook.remove()
    assert prefill_rows == [3]  # three distinct prompts, each run once
    for j, i in enumerate(order.tolist()):
        alone = generate_batch(model, tok, ids[i : i + 1, : int(lengths[i])], lengths[i : i + 1], seeds=seeds[j : j + 1], **kw)
        assert _gen_tokens(out, lengths[order], j) == _gen_tokens(alone, lengths[i : i + 1], 0), f"row {j}"
    torch.testing.assert_close(out["logprobs"], teacher_forced_logprobs(model, out, 1.0), atol=1e-4, rtol=1e-4)


def test_stop_token_ids_and_truncated(lm, batch):
    model, tok = lm
    ids, lengths = batch
    ref = generate_batch(model, tok, ids, lengths, max_new_tokens=12, greedy=True, ignore_eos=True)
    assert ref["truncated"].all() and (ref["generation_lengths"] == 12).all()
    row0 = _gen_tokens(ref, lengths, 0)
    k = next(j for j in range(2, 12) if row0[j] not in row0[:j])
    stop_id = row0[k]
    out = generate_batch(
        model, tok, ids, lengths, max_new_tokens=12, greedy=True, ignore_eos=True, stop_token_ids=[stop_id]
    )
    for i in range(len(PROMPTS)):
        full = _gen_tokens(ref, lengths, i)
        expect = full[: full.index(stop_id) + 1] if stop_id in full else full
        assert _gen_tokens(out, lengths, i) == expect
        assert bool(out["truncated"][i]) == (stop_id not in full)
    assert int(out["generation_lengths"][0]) == k + 1


def test_stop_strings_per_row_and_global(lm, batch):
    model, tok = lm
    ids, lengths = batch
    ref = generate_batch(model, tok, ids, lengths, max_new_tokens=12, greedy=True, ignore_eos=True)
    row0 = _gen_tokens(ref, lengths, 0)
    # a printable piece of row 0's text, first completed by token k
    texts = [tok.decode(row0[: j + 1]) for j in range(12)]
    stop, k = None, None
    for j in range(1, 12):
        piece = tok.decode([row0[j]])
        if piece.strip() and piece.isprintable() and piece not in texts[j - 1]:
            stop, k = piece, j
            break
    assert stop is not None, "tiny model produced no printable token"
    per_row = [[stop], None, None, None]
    out = generate_batch(model, tok, ids, lengths, max_new_tokens=12, greedy=True, ignore_eos=True, stop_strings=per_row)
    assert _gen_tokens(out, lengths, 0) == row0[: k + 1]
    assert not out["truncated"][0]
    for i in range(1, len(PROMPTS)):
        assert _gen_tokens(out, lengths, i) == _gen_tokens(ref, lengths, i) and out["truncated"][i]
    glob = generate_batch(model, tok, ids, lengths, max_new_tokens=12, greedy=True, ignore_eos=True, stop_strings=[stop])
    assert _gen_tokens(glob, lengths, 0) == row0[: k + 1]
    for i in range(len(PROMPTS)):
        full_text = tok.decode(_gen_tokens(ref, lengths, i))
        assert bool(glob["truncated"][i]) == (stop not in full_text)


def test_eos_stops_unless_ignored(lm, batch):
    model, tok = lm
    ids, lengths = batch
    ref = generate_batch(model, tok, ids, lengths, max_new_tokens=12, greedy=True, ignore_eos=True)
    first = _gen_tokens(ref, lengths, 1)[4]
    # pretend that token is EOS: the loop must stop on it by default and not with ignore_eos
    out = generate_batch(model, first, ids, lengths, max_new_tokens=12, greedy=True, pad_token_id=tok.pad_token_id,
                         stop_token_ids=None)
    # an int tokenizer_or_pad_id is only a pad id: EOS comes from the model config here
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert torch.equal(out["generation_lengths"], generate_batch(
        model, tok, ids, lengths, max_new_tokens=12, greedy=True)["generation_lengths"])
    model.generation_config.eos_token_id = first
    try:
        stopped = generate_batch(model, tok.pad_token_id, ids, lengths, max_new_tokens=12, greedy=True)
        ignored = generate_batch(model, tok.pad_token_id, ids, lengths, max_new_tokens=12, greedy=True, ignore_eos=True)
    finally:
        model.generation_config.eos_token_id = tok.eos_token_id
    assert int(stopped["generation_lengths"][1]) <= 5 and not stopped["truncated"][1]
    assert int(ignored["generation_lengths"][1]) == 12 and ignored["truncated"][1]


def test_chunked_equals_unchunked(lm, batch):
    model, tok = lm
    ids, lengths = batch
    whole = generate_batch(model, tok, ids, lengths, max_new_tokens=8, greedy=True)
    chunked = generate_batch(model, tok, ids, lengths, max_new_tokens=8, greedy=True, max_batch_size=3)
    for k in whole:
        torch.testing.assert_close(whole[k], chunked[k], atol=1e-5, rtol=0)


def test_filter_top_k_top_p():
    scores = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.isinf(filter_top_k_top_p(scores, 2, 1.0)[0, 2:]).all()
    kept = ~torch.isinf(filter_top_k_top_p(scores, None, 0.8))
    assert kept.tolist() == [[True, True, True, False, False]]  # 0.5 + 0.2 < 0.8 <= 0.85
    assert (~torch.isinf(filter_top_k_top_p(scores, None, 0.01))).sum() == 1


def test_bad_inputs_name_the_problem(lm, batch):
    model, tok = lm
    ids, lengths = batch
    with pytest.raises(ValueError, match="input_lengths"):
        generate_batch(model, tok, ids, lengths[:2], max_new_tokens=2)
    with pytest.raises(ValueError, match="input_lengths"):
        generate_batch(model, tok, ids, torch.zeros_like(lengths), max_new_tokens=2)
    with pytest.raises(ValueError, match="seeds"):
        generate_batch(model, tok, ids, lengths, max_new_tokens=2, seeds=torch.tensor([1]))
    with pytest.raises(ValueError, match="temperature"):
        generate_batch(model, tok, ids, lengths, max_new_tokens=2, temperature=0.0)
    with pytest.raises(ValueError, match="stop_strings"):
        generate_batch(model, tok, ids, lengths, max_new_tokens=2, stop_strings=[["x"]])
    with pytest.raises(ValueError, match="tokenizer"):
        generate_batch(model, 0, ids, lengths, max_new_tokens=2, stop_strings=["x"])
    with pytest.raises(ValueError, match="context"):
        generate_batch(model, tok, torch.ones((1, 128), dtype=torch.long), torch.tensor([128]), max_new_tokens=2)
