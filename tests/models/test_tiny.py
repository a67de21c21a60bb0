"""The tiny-model kit: offline save/load, determinism, tokenizer round trips, a real train step."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from nrl_tasks.environments.arithmetic import make_arithmetic_prompts
from nrl_tasks.models.tiny import build_tiny_model, build_tiny_tokenizer


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tokenizer_round_trips_and_splits_digits():
    tok = build_tiny_tokenizer()
    for text in ["What is 12+7? Answer: 19", "héllo wörld ✓ 😀", "<|im_start|>user\nhi<|im_end|>\n"]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok("123")["input_ids"]) == ["1", "2", "3"]
    assert tok("<|im_end|>")["input_ids"] == [tok.eos_token_id]  # specials are single tokens
    assert len({tok.pad_token_id, tok.eos_token_id, tok.bos_token_id}) == 3
    assert tok("hi")["input_ids"][0] != tok.bos_token_id  # nothing added automatically


def test_tokenizer_is_deterministic_and_has_a_chat_template(tmp_path):
    a, b = build_tiny_tokenizer(tmp_path / "a"), build_tiny_tokenizer(tmp_path / "b")
    assert a.get_vocab() == b.get_vocab()
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
    text = a.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer:"}], tokenize=False,
                                 add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2+2? Answer:<|im_end|>\n<|im_start|>assistant\n"


def test_model_folder_loads_offline_and_is_bit_identical_per_seed(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    ref = Path(tiny_model_dir) / "model.safetensors"
    assert _sha(Path(again) / "model.safetensors") == _sha(ref)
    assert _sha(Path(other) / "model.safetensors") != _sha(ref)
    assert not [n for n in os.listdir(again) if n.startswith(".tmp")]  # staging dir cleaned up

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "llama" and model.dtype == torch.float32
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    assert sum(p.numel() for p in model.parameters()) < 500_000
    assert tok.chat_template is not None


def test_bf16_and_shape_options(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "bf16", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                            intermediate_size=64, tie_word_embeddings=True, dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert model.dtype == torch.bfloat16
    assert model.config.num_hidden_layers == 1 and model.config.tie_word_embeddings
    with pytest.raises(ValueError, match="divisible"):
        build_tiny_model(tmp_path / "bad", hidden_size=30, num_heads=4)


def test_train_step_64x64_learns_and_generates(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = [p["prompt"] + " " + p["answer"] + tok.eos_token for p in make_arithmetic_prompts(64, seed=0)]
    batch = tok(texts, padding="max_length", max_length=64, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(3):
        out = model(**batch, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0]
    prompt = tok(["What is 1+2? Answer:"], return_tensors="pt")
    gen = model.generate(**prompt, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] <= prompt["input_ids"].shape[1] + 4


def test_reward_model_scores_one_value_per_sequence(tiny_reward_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_reward_model_dir)
    batch = tok(["What is 1+1? Answer: 2", "hi"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, 1) and torch.isfinite(logits).all()
    # right padding must not change the score of the short sequence
    with torch.no_grad():
        alone = model(**tok(["hi"], return_tensors="pt")).logits
    torch.testing.assert_close(logits[1], alone[0], atol=1e-5, rtol=1e-5)


def test_cli_writes_a_model(tmp_path, capsys):
    from nrl_tasks.models import tiny

    out = tmp_path / "cli"
    tiny.main([str(out), "--seed", "3"])
    assert capsys.readouterr().out.strip() == str(out)
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    tiny.main([str(tmp_path / "rm"), "--reward-model"])
    assert "LlamaForSequenceClassification" in (tmp_path / "rm" / "config.json").read_text()
