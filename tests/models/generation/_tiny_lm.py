"""A small in-memory Llama + BPE tokenizer for the generation tests (no download, ~1 s), and
the helpers those tests share (loading a folder, encoding prompts, teacher-forced logprobs).

Independent of ``nrl_tasks.models.tiny`` so the decode-loop tests do not depend on it; the
Ray tests prefer the shared ``tiny_model_dir`` fixture and fall back to :func:`save_lm`. Also
imported by the vLLM tests in ``.venv-vllm``: torch at import, transformers/tokenizers lazily.
"""

from __future__ import annotations

import torch

TEXT = (
    "the quick brown fox jumps over the lazy dog. 12 + 7 = 19. 3 * 4 = 12. "
    "answer: 42. question: what is 5 + 5? answer: 10. hello world, hello ray. "
) * 4


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=160,
        special_tokens=["<pad>", "<eos>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_lm(seed: int = 0, dtype: torch.dtype = torch.float32):
    """Return ``(model, tokenizer)``: a 2-layer Llama (head_dim 32) with peaked (non-uniform) logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,  # head_dim 32: the smallest vLLM-CPU attention supports
        max_position_embeddings=128,
        initializer_range=0.2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    return model, tokenizer


def save_lm(out_dir: str, seed: int = 0) -> str:
    """Save :func:`make_lm`'s model and tokenizer as an HF folder; returns ``out_dir``."""
    model, tokenizer = make_lm(seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def encode_batch(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids [B, S]`` and ``input_lengths [B]``."""
    rows = [tokenizer.encode(t) for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    return ids, torch.tensor([len(r) for r in rows])


def load_lm(model_dir: str):
    """Return ``(model, tokenizer)`` from an HF folder: the causal LM in fp32, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def copy_into(model, named: list[tuple[str, torch.Tensor]]) -> None:
    """Copy refit tensors ``named`` (``(name, tensor)`` in ``model.parameters()`` order, e.g.
    perturbed ``hf_refit_named_tensors(model)``) into ``model``, so it matches what was sent."""
    with torch.no_grad():
        for (_, new), p in zip(named, model.parameters()):
            p.copy_(new)


def teacher_forced_logprobs(model, out: dict, temperature: float) -> torch.Tensor:
    """What ``out["logprobs"]`` should be: one forward over ``out["output_ids"]`` ``[B, L]``.

    Every generated token's log-probability (nats) under ``log_softmax(logits / temperature)``
    at its position, 0 on prompt and padding positions; shape and dtype of ``out["logprobs"]``.
    Prompt length of row ``i`` = ``unpadded_sequence_lengths[i] - generation_lengths[i]``.
    """
    full = out["output_ids"]
    mask = torch.zeros_like(full)
    for i, n in enumerate(out["unpadded_sequence_lengths"].tolist()):
        mask[i, :n] = 1
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=mask).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, full[:, 1:].unsqueeze(2)).squeeze(2)
    expected = torch.zeros_like(out["logprobs"])
    prompt_lens = out["unpadded_sequence_lengths"] - out["generation_lengths"]
    for i in range(full.shape[0]):
        n, g = int(prompt_lens[i]), int(out["generation_lengths"][i])
        expected[i, n : n + g] = lp[i, n - 1 : n + g - 1]
    return expected
