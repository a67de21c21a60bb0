"""Generation contracts shared by the ``hf`` and ``vllm`` backends.

Conventions (NeMo-RL's):

* Input (:class:`GenerationDatumSpec`): ``input_ids [B, S]`` right-padded, ``input_lengths [B]``,
  optional ``seeds [B]`` (int64, one per request: the same seed gives the same sample) and
  optional ``stop_strings`` (one list of strings, or ``None``, per row; merged with the
  configured ones).
* Output (:class:`GenerationOutputSpec`): ``output_ids [B, S_out]`` holds the prompt, then the
  generated ids, then ``pad_token_id`` up to ``S_out`` (right-padded); ``logprobs [B, S_out]``
  (float32) holds, at the position of each generated token, ``log softmax(logits / temperature)``
  of that token over the whole vocabulary (before top-k / top-p filtering, i.e. the quantity
  ``Policy.get_logprobs`` computes), 0 elsewhere; ``generation_lengths [B]`` (generated tokens,
  stop token included), ``unpadded_sequence_lengths [B]`` (prompt + generated) and
  ``truncated [B]`` (bool: hit ``max_new_tokens`` or the model's context without a stop).
* Weights carry an integer version. A worker is *stale* from the start of a refit until the last
  byte has arrived; ``generate(..., weights_version=v)`` raises :class:`StaleWeightsError` unless
  the worker is not stale and holds version ``v`` (``v=None``: any version, but never stale).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict

from pydantic import Field, field_validator, model_validator

from nrl_tasks.config.base import Section

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from ray import ObjectRef

__all__ = [
    "ColocatedConfig",
    "GenerationConfig",
    "GenerationDatumSpec",
    "GenerationInterface",
    "GenerationOutputSpec",
    "StaleWeightsError",
    "VllmConfig",
]


class StaleWeightsError(RuntimeError):
    """``generate`` was asked for a weights version this worker does not (fully) hold."""


class GenerationDatumSpec(TypedDict):
    """Input batch of ``generate``."""

    input_ids: torch.Tensor  # [B, S] int64, right-padded
    input_lengths: torch.Tensor  # [B] int64
    seeds: NotRequired[torch.Tensor]  # [B] int64
    stop_strings: NotRequired[list[list[str] | None]]


class GenerationOutputSpec(TypedDict):
    """Output batch of ``generate`` (see the module docstring for the layout)."""

    output_ids: torch.Tensor  # [B, S_out] int64
    logprobs: torch.Tensor  # [B, S_out] float32
    generation_lengths: torch.Tensor  # [B] int64
    unpadded_sequence_lengths: torch.Tensor  # [B] int64
    truncated: torch.Tensor  # [B] bool


class ColocatedConfig(Section):
    """NeMo-RL's ``generation.colocated``: ``enabled`` runs generation on the policy's devices (with
    the ``hf`` backend inside the policy workers: :mod:`nrl_tasks.models.generation.colocated`);
    ``resources`` (NeMo-RL: the generation cluster when not colocated) is accepted and unused."""

    enabled: bool = False
    resources: dict[str, Any] | None = None


class VllmConfig(Section):
    """vLLM-specific settings (``vllm`` backend only).

    ``llm_kwargs`` is passed verbatim to ``vllm.LLM`` last, so it can override anything.
    ``kv_cache_space_gib`` sets ``VLLM_CPU_KVCACHE_SPACE`` for the CPU build.
    """

    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    max_model_len: int | None = Field(None, ge=1)
    enforce_eager: bool = True
    kv_cache_space_gib: float = Field(1.0, gt=0.0)
    enable_prefix_caching: bool = False
    llm_kwargs: dict[str, Any] = Field(default_factory=dict)


class GenerationConfig(Section):
    """Generation settings (NeMo-RL key names, plus worker placement knobs).

    ``top_k``: ``None`` or ``-1`` disables it. ``stop_token_ids``: extra stop ids; the
    tokenizer's EOS is always a stop unless ``ignore_eos``. ``pad_token_id``: ``None`` takes the
    tokenizer's pad id (else its EOS). ``max_batch_size``: rows per forward inside one worker
    (``None``: the whole shard at once).
    """

    backend: Literal["hf", "vllm"] = "hf"
    model_name: str | None = None
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    stop_strings: list[str] | None = None
    ignore_eos: bool = False
    pad_token_id: int | None = None
    precision: Literal["float32", "bfloat16", "float16"] = "float32"
    colocated: ColocatedConfig = Field(default_factory=ColocatedConfig)
    vllm_cfg: VllmConfig = Field(default_factory=VllmConfig)
    num_workers: int = Field(1, ge=1)
    seed: int = 0
    num_cpus_per_worker: float = Field(1.0, ge=0.0)
    torch_num_threads: int = Field(1, ge=1)
    max_batch_size: int | None = Field(None, ge=1)
    refit_timeout_s: float = Field(120.0, gt=0.0)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is None or v == -1:
            return None
        if v < 1:
            raise ValueError(f"top_k must be >= 1, -1 or None, got {v}")
        return v

    @field_validator("stop_strings")
    @classmethod
    def _stop_strings(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not s for s in v):
            raise ValueError("stop_strings must not contain empty strings")
        return v

    @model_validator(mode="after")
    def _backend_checks(self) -> GenerationConfig:
        if self.colocated.enabled and self.backend == "vllm":
            raise ValueError(
                "colocated.enabled=true with backend='vllm' is not built (vLLM's sleep mode and colocated refit need a "
                "GPU): use backend='hf', which samples inside the policy workers, or colocated.enabled=false"
            )
        return self


def require_prompts(data: Any) -> int:
    """The batch size of a :class:`GenerationDatumSpec` batch; ``ValueError`` when it lacks
    ``input_ids``/``input_lengths`` or is empty (what every backend's ``generate`` checks first)."""
    for key in ("input_ids", "input_lengths"):
        if key not in data:
            raise ValueError(f"generate: data is missing key {key!r}")
    batch = int(data["input_ids"].shape[0])
    if batch == 0:
        raise ValueError("generate: empty batch")
    return batch


class GenerationInterface(ABC):
    """What the stages call on a generation backend (a group of workers).

    ``shares_policy_weights``: True for colocated generation in the policy's own workers
    (:mod:`nrl_tasks.models.generation.colocated`), whose refit only records a version."""

    shares_policy_weights: bool = False

    @abstractmethod
    def generate(self, data: Any, greedy: bool = False, *, weights_version: int | None = None) -> Any:
        """Generate for ``data`` (:class:`GenerationDatumSpec`) -> :class:`GenerationOutputSpec` batch.

        Raises :class:`StaleWeightsError` if any worker is stale or holds another version than
        ``weights_version`` (when given).
        """

    @abstractmethod
    def prepare_refit_info(self, info_dict: dict[str, Any]) -> None:
        """Check the policy's refit metadata/fingerprint against every worker's own model.

        Raises ``RefitMismatchError`` naming the first differing parameter.
        """

    @abstractmethod
    def init_collective(
        self, ip: str, port: int, world_size: int, *, rank_offset: int
    ) -> list[ObjectRef]:
        """Join the refit broadcast group; worker ``i`` takes rank ``rank_offset + i``."""

    @abstractmethod
    def update_weights_from_collective(self, weights_version: int) -> list[ObjectRef]:
        """Consume one packed broadcast into the weights; the version is set after the last byte."""

    @property
    @abstractmethod
    def weights_version(self) -> int | None:
        """The version every worker holds, or ``None`` if a worker is stale or they disagree."""

    @abstractmethod
    def weights_checksum(self) -> str:
        """Checksum of the weights (``nrl_tasks.utils.refit.weights_checksum``), equal on all workers."""

    @abstractmethod
    def mark_stale(self) -> None:
        """Make every worker refuse ``generate`` until the next complete refit."""

    @abstractmethod
    def shutdown(self) -> None:
        """Kill the workers."""
