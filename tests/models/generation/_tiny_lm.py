"""A small in-memory Llama + BPE tokenizer for the generation tests (no download, ~1 s).

Independent of ``nrl_tasks.models.tiny`` so the decode-loop tests do not depend on it; the
Ray tests prefer the shared ``tiny_model_dir`` fixture and fall back to :func:`save_lm`.
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
