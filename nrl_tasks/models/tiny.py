"""Tiny Llama-architecture models and a tokenizer made locally, for tests and quick runs.

Nothing is downloaded. The tokenizer is a byte-level BPE (so any text round-trips) with every
digit its own token, trained by ``tokenizers`` on a built-in corpus (arithmetic prompts in the
template of :mod:`nrl_tasks.environments.arithmetic`, ChatML turns, a little English). Its
special tokens mirror SmolLM2's: ``<|im_start|>`` (bos), ``<|im_end|>`` (eos, ends both chat
turns and plain completions), plus ``<|pad|>`` and ``<|endoftext|>``; no token is added
automatically on encode. A ChatML chat template is set, so ``apply_chat_template`` works.

Models are a ``LlamaForCausalLM`` (or a one-label ``LlamaForSequenceClassification`` reward
model) initialised from a seed: the same arguments give bit-identical ``model.safetensors``.
Every file is written to a temporary name in the target folder and renamed into place.

CLI: ``python -m nrl_tasks.models.tiny OUT_DIR [--seed N] [--reward-model]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch

from nrl_tasks.environments.arithmetic import PROMPT_TEMPLATE

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_tiny_model",
    "build_tiny_reward_model",
    "build_tiny_tokenizer",
]

Dtype = Literal["float32", "bfloat16", "float16"]

SPECIAL_TOKENS = {
    "pad_token": "<|pad|>",
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
}
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_VOCAB_SIZE = 512

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A small model learns to add numbers.
What is the answer? The answer is a number. Please answer with a single number.
You are a helpful assistant. Think step by step and give the final answer.
The capital of France is Paris. The sun is a star and the moon goes around the earth.
Reinforcement learning improves a policy by rewarding good answers and discouraging bad ones.
Yes, no, maybe. One, two, three, four, five, six, seven, eight, nine, ten.
Hello! How are you today? I am fine, thank you. Let us solve some arithmetic problems.
Add the two numbers, then write only the result after the word Answer.
The sum of two and three is five. The product of four and six is twenty four.
Subtract the smaller number from the larger one. Multiply, divide, plus, minus, equals.
A language model predicts the next token from the tokens before it.
Training data, evaluation data, checkpoints and metrics are written to storage.
This is a test. That was correct. Those answers were wrong, so the reward was zero.
She reads a book in the morning and writes code in the afternoon.
We can learn from our mistakes when we check each step carefully.
Questions and answers: what, why, where, when, who, which, how many, how much.
"""


def _corpus() -> Iterator[str]:
    """Deterministic training text for the BPE (a few thousand short lines)."""

    yield from _ENGLISH.splitlines()
    for a in range(20):
        for b in range(20):
            for op, result in (("+", a + b), ("-", a - b), ("*", a * b)):
                prompt = PROMPT_TEMPLATE.format(a=a, op=op, b=b)
                yield f"{prompt} {result}"
                yield f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{result}<|im_end|>\n"


def build_tiny_tokenizer(out_dir: str | os.PathLike[str] | None = None):
    """Train the tiny byte-level BPE tokenizer (vocab 512) and wrap it for ``transformers``.

    Returns a ``PreTrainedTokenizerFast``; with ``out_dir`` it is also saved there
    (``tokenizer.json``, ``tokenizer_config.json``, chat template). Deterministic.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [SPECIAL_TOKENS[k] for k in ("unk_token", "bos_token", "eos_token", "pad_token")]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        **SPECIAL_TOKENS,
    )
    if out_dir is not None:
        with _staging(out_dir) as tmp:
            tokenizer.save_pretrained(tmp)
    return tokenizer


def _llama_config(tokenizer, **kwargs):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        attention_bias=False,
        initializer_range=0.02,
        **kwargs,
    )


class _staging:
    """Context manager: a temp dir inside ``out_dir`` whose files are renamed into ``out_dir``."""

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.out_dir = Path(out_dir)

    def __enter__(self) -> str:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix=".tmp-", dir=self.out_dir)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                for name in sorted(os.listdir(self.tmp)):
                    os.replace(os.path.join(self.tmp, name), self.out_dir / name)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _save(model, tokenizer, out_dir: str | os.PathLike[str], dtype: Dtype) -> str:
    model = model.to(getattr(torch, dtype))
    with _staging(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return str(Path(out_dir))


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = False,
    dtype: Dtype = "float32",
) -> str:
    """Save a randomly initialised tiny ``LlamaForCausalLM`` + tokenizer to ``out_dir``.

    The folder loads with ``AutoModelForCausalLM.from_pretrained(out_dir)`` and
    ``AutoTokenizer.from_pretrained(out_dir)`` offline. Same arguments give bit-identical
    weights (the global torch RNG is left untouched). Returns ``out_dir`` as a string.
    Defaults: ~0.1 M parameters, vocab 512.
    """
    from transformers import LlamaForCausalLM

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}) and num_heads by "
            f"num_kv_heads ({num_kv_heads})"
        )
    tokenizer = build_tiny_tokenizer()
    config = _llama_config(
        tokenizer,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return _save(model, tokenizer, out_dir, dtype)


def build_tiny_reward_model(
    out_dir: str | os.PathLike[str],
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    dtype: Dtype = "float32",
) -> str:
    """Save a tiny ``LlamaForSequenceClassification`` (``num_labels=1``) + tokenizer.

    For ``Policy.score``: the score of a sequence is the logit at its last non-pad token
    (``pad_token_id`` is set in the config). Deterministic like :func:`build_tiny_model`.
    """
    from transformers import LlamaForSequenceClassification

    tokenizer = build_tiny_tokenizer()
    config = _llama_config(
        tokenizer,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
    return _save(model, tokenizer, out_dir, dtype)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nrl_tasks.models.tiny", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", help="folder to write the HF model into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reward-model", action="store_true", help="build the sequence-classification reward model")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = parser.parse_args(argv)
    if args.reward_model:
        path = build_tiny_reward_model(
            args.out_dir, args.seed, hidden_size=args.hidden_size, num_layers=args.num_layers, dtype=args.dtype
        )
    else:
        path = build_tiny_model(
            args.out_dir,
            seed=args.seed,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            intermediate_size=2 * args.hidden_size,
            dtype=args.dtype,
        )
    print(path)


if __name__ == "__main__":
    main()
