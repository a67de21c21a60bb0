"""The fate of every NeMo-RL config key this project's schema does not take by the same name.

A key of NeMo-RL's config files is either

- **honoured**: the schema (:mod:`nrl_tasks.config`) takes it by the same name with the same meaning;
  a rule below may also honour a key *as off*: NeMo-RL's value that turns its feature off is what
  happens here anyway (``grpo.val_start_at: -1``), and any other value is refused;
- **mapped**: a different mechanism here has the same effect (the rule says which); the value
  moves to the key named (``grpo.adv_estimator.normalize_rewards`` -> ``grpo.normalize_rewards``),
  is converted in place (``checkpointing.metric_name: val:accuracy`` -> ``val_accuracy``) or is
  taken over by the run's layout (``checkpointing.checkpoint_dir``: a run's checkpoints are
  ``<storage>/<run-id>/checkpoints``);
- **ignored** with one warning line naming the keys, only where the key cannot change what is
  computed (GPU kernels, ports, progress bars, memory offloading);
- **refused** with an error naming the key and why (``policy.megatron_cfg.enabled: true``).

:func:`translate` applies the rules to a resolved config's data before validation; a key without
a rule that the schema does not take is reported by validation as an unknown key. The table of
every key of NeMo-RL's example files and its fate is ``docs/nemo_rl_keys.md``, written by
``python -m flows.config.nemo_rl FILE...`` from these rules (a test keeps it current).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal, Mapping, get_args

from pydantic import BaseModel

from flows.config.compose import compose_file, resolve_interpolations
from flows.config.nemo_rl_data import KEY_FATES, map_datasets
from nrl_tasks.config.base import flatten
from nrl_tasks.config.bounds import MAX_STEPS
from nrl_tasks.config.master import MasterConfig

__all__ = ["RULES", "Fate", "Rule", "Translation", "fate_lines", "leaf_keys", "rule_for", "translate"]

Fate = Literal["honoured", "mapped", "ignored", "refused"]


@dataclass(frozen=True)
class Off:
    """Values with which a key is honoured as its feature turned off (what happens here anyway)."""

    test: Callable[[Any], bool]
    text: str

    def __call__(self, value: Any) -> bool:
        try:
            return bool(self.test(value))
        except (TypeError, ValueError):
            return False


def off_is(*values: Any) -> Off:
    return Off(lambda v: any(v == x and type(v) is type(x) or (v is None and x is None) for x in values),
               " or ".join("null" if x is None else repr(x).lower() if isinstance(x, bool) else repr(x) for x in values))


OFF_NULL = off_is(None)
OFF_FALSE = off_is(False)
OFF_EMPTY = Off(lambda v: v in (None, {}, []), "null or empty")
OFF_DISABLED = Off(lambda v: v is None or (isinstance(v, Mapping) and v.get("enabled") is False), "enabled: false (or null)")
OFF_ALL_FALSE = Off(lambda v: v is None or (isinstance(v, Mapping) and not any(x for x in v.values() if x is not None)),
                    "every flag false, token_ids null")


@dataclass(frozen=True)
class Rule:
    """The fate of one NeMo-RL key (a leaf or a whole section) when its value is not ``off``."""

    key: str
    fate: Fate
    why: str
    off: Off | None = None
    to: str | None = None  # mapped: the key here that takes the value
    convert: Callable[[Any], Any] | None = None  # mapped: the value here, from NeMo-RL's
    moot_if: tuple[str, Any] | None = None  # honoured too when this key of the same section has this value


#: the most validation batches one validation reads here (``SupervisedValidation.val_batches``' bound)
_ALL_VAL_BATCHES = 10_000


def _unlimited(bound: int) -> Callable[[Any], Any]:
    """NeMo-RL's ``-1`` (no limit) as ``bound``; any other value as it is.

    >>> _unlimited(7)(-1), _unlimited(7)(3)
    (7, 3)
    """
    return lambda v: bound if v == -1 else v


def _metric_name(value: Any) -> Any:
    """NeMo-RL's ``val:<name>`` / ``train:<name>`` (``val:validation-<set>_loss`` for a named
    validation set) as a column of this project's metrics lines.

    >>> [_metric_name(v) for v in ("val:accuracy", "val:val_loss", "val:validation-default_loss", "train:loss", "val_accuracy")]
    ['val_accuracy', 'val_loss', 'val_loss', 'loss', 'val_accuracy']
    """
    if not isinstance(value, str) or ":" not in value:
        return value
    split, _, name = value.partition(":")
    if split == "train":
        return name
    if name.startswith("validation-") and "_" in name:
        name = name.split("_", 1)[1]
    return name if name.startswith("val_") else f"val_{name}"


_GPU_ENV = ("PYTORCH_CUDA_", "CUDA_", "NCCL_", "NVTE_", "TORCH_NCCL_")
_HUB_DATA = ("a local ResponseDataset / BinaryPreferenceDataset file is `data.dataset: file`, `data.train_path` and the "
             "row keys (flows/config/nemo_rl_data.py); a hub dataset is refused with the override that works")
_ALGORITHMS_HERE = "the algorithms here are grpo (with its loss menu: DAPO, CISPO, GSPO, ...), dpo, sft, rm, distill and ppo"

RULES: tuple[Rule, ...] = (
    # ---- NeMo-RL's algorithms not built here yet (issue 43)
    # ---- grpo
    Rule("grpo.val_start_at", "refused", "delayed periodic validation is not implemented", off_is(-1, None)),
    Rule("grpo.val_num_generations_per_prompt", "refused",
         "validation scores one greedy response per prompt here (`nrl eval --num-samples K` gives pass@k)", off_is(1)),
    Rule("grpo.seq_logprob_error_threshold", "refused", "the sequence logprob-error filter is not implemented", OFF_NULL),
    Rule("grpo.invalid_tool_call_advantage", "refused", "tool-call advantages are not implemented", OFF_NULL),
    Rule("grpo.malformed_thinking_advantage", "refused", "<think>-tag advantages are not implemented", OFF_NULL),
    *(Rule(f"{s}.reward_shaping.stop_properly_penalty_coef", "refused", "the stop-properly penalty is not implemented",
           OFF_NULL) for s in ("grpo", "ppo")),
    Rule("grpo.adv_estimator.normalize_rewards", "mapped", "the advantage's normalisation is `grpo.normalize_rewards`",
         to="grpo.normalize_rewards"),
    Rule("grpo.adv_estimator.use_leave_one_out_baseline", "mapped",
         "the leave-one-out baseline is `grpo.use_leave_one_out_baseline`", to="grpo.use_leave_one_out_baseline"),
    Rule("grpo.async_grpo.max_generation_failures", "refused",
         "a failed generation is retried (`grpo.stage_retries`) and never dropped here", off_is(0)),
    Rule("grpo.async_grpo.recompute_kv_cache_after_weight_updates", "refused",
         "in-flight weight updates keep no KV cache to recompute here", OFF_FALSE),
    Rule("reward_penalties", "refused", "NeMo-Gym's reward penalties are not implemented", OFF_ALL_FALSE),
    Rule("on_policy_distillation", "refused", "multi-teacher on-policy distillation is not implemented", OFF_NULL),
    Rule("data_plane", "mapped", "stage outputs pass between stages as Arrow datasets on the run's storage "
         "(the data plane here, always on)"),
    # ---- dpo, sft, rm
    *(Rule(f"{s}.max_num_steps", "mapped", f"-1 (no limit: `{s}.max_num_epochs` ends the run) is {MAX_STEPS}, the "
           "most steps a run takes here", convert=_unlimited(MAX_STEPS)) for s in ("dpo", "sft", "rm")),
    *(Rule(f"{s}.val_batches", "mapped", f"-1 (every held-out batch) is {_ALL_VAL_BATCHES}, the most batches a "
           "validation reads here", convert=_unlimited(_ALL_VAL_BATCHES)) for s in ("dpo", "sft", "rm")),
    Rule("sft.only_unmask_final", "refused", "the loss covers every assistant turn here", OFF_FALSE),
    # ---- policy
    Rule("policy.activation_checkpointing_enabled", "mapped", "`policy.dtensor_cfg.activation_checkpointing` "
         "(NeMo-RL's older key; recomputed activations, the same numbers)", to="policy.dtensor_cfg.activation_checkpointing"),
    Rule("policy.tokenizer.chat_template_kwargs", "refused", "chat-template keyword arguments are not passed", OFF_NULL),
    Rule("policy.tokenizer.use_fastokens", "ignored", "a faster tokenizer of the same tokens"),
    Rule("policy.hf_config_overrides", "refused", "model-config overrides are not applied", OFF_EMPTY),
    Rule("policy.generation_batch_size", "ignored", "the HF decode batch: every row samples with its own generator"),
    Rule("policy.logprob_chunk_size", "ignored", "memory only: logprobs are the same"),
    Rule("policy.offload_optimizer_for_logprob", "ignored", "GPU memory offloading"),
    Rule("policy.make_sequence_length_divisible_by", "ignored", "padding for tensor parallelism; padded positions are masked"),
    Rule("policy.megatron_cfg", "refused", "Megatron-Core training is not available here: use `policy.dtensor_cfg`",
         OFF_DISABLED),
    Rule("policy.draft", "refused", "draft (speculative) models are not implemented", OFF_DISABLED),
    Rule("policy.optimizer.kwargs.fused", "ignored", "a fused optimizer kernel"),
    Rule("policy.dtensor_cfg._v2", "ignored", "NeMo-RL's worker implementation version"),
    Rule("policy.dtensor_cfg.automodel_kwargs", "refused", "NeMo Automodel is not used: models load with transformers",
         OFF_EMPTY),
    Rule("policy.dtensor_cfg.env_vars", "refused", "worker environment variables are not set from the config",
         Off(lambda v: not v or all(str(k).startswith(_GPU_ENV) for k in v), "null, empty or only CUDA/NCCL variables")),
    Rule("policy.dtensor_cfg.clear_cache_every_n_steps", "ignored", "a GPU cache flush"),
    Rule("policy.dtensor_cfg.dp_replicate_size", "refused", "HSDP replication is not implemented", off_is(1, None)),
    Rule("policy.dtensor_cfg.lora_cfg.dropout_position", "refused",
         "peft applies LoRA dropout to the layer's input (NeMo-RL's `pre`)", off_is("pre"), moot_if=("dropout", 0.0)),
    Rule("policy.dtensor_cfg.lora_cfg.use_triton", "ignored", "a LoRA kernel choice"),
    Rule("policy.sequence_packing.microbatch_order", "refused", "packed micro-batches run in the packer's order",
         off_is("packer")),
    Rule("policy.sequence_packing.sequence_length_round", "ignored", "padding of packed rows; padded positions are masked"),
    # ---- policy.generation
    Rule("policy.generation.val_temperature", "mapped", "validation is greedy here (val_accuracy); "
         "`nrl eval --num-samples K` samples at the training temperature"),
    Rule("policy.generation.val_top_p", "mapped", "validation is greedy here"),
    Rule("policy.generation.val_top_k", "mapped", "validation is greedy here"),
    Rule("policy.generation.port_range_low", "ignored", "server ports"),
    Rule("policy.generation.port_range_high", "ignored", "server ports"),
    Rule("policy.generation.refit_transport", "mapped", "weights reach the generation workers by packed-tensor broadcasts"),
    Rule("policy.generation.refit_cfg", "mapped", "weights reach the generation workers by packed-tensor broadcasts"),
    Rule("policy.generation.real_quant_export_cpu_offload", "ignored", "a refit memory placement"),
    Rule("policy.generation.mcore_generation_config", "ignored", "read by the Megatron generation backend only, not here"),
    Rule("policy.generation.vllm_kwargs", "mapped", "vLLM's engine arguments are `policy.generation.vllm_cfg.llm_kwargs`",
         to="policy.generation.vllm_cfg.llm_kwargs"),
    Rule("policy.generation.vllm_cfg.async_engine", "refused", "vLLM's async engine is not used", OFF_FALSE),
    Rule("policy.generation.vllm_cfg.precision", "mapped", "generation runs at `policy.precision`", to="policy.precision"),
    Rule("policy.generation.vllm_cfg.kv_cache_dtype", "refused", "the KV cache has the model's dtype", off_is("auto")),
    Rule("policy.generation.vllm_cfg.logprobs_mode", "refused",
         "generation logprobs are of the sampled (temperature-scaled) distribution", off_is("processed_logprobs")),
    Rule("policy.generation.vllm_cfg.pipeline_parallel_size", "refused", "vLLM pipeline parallelism is not implemented",
         off_is(1)),
    Rule("policy.generation.vllm_cfg.expert_parallel_size", "refused", "vLLM expert parallelism is not implemented", off_is(1)),
    Rule("policy.generation.vllm_cfg.use_tqdm", "ignored", "progress bars"),
    Rule("policy.generation.vllm_cfg.distributed_executor_backend", "ignored", "how vLLM starts its executors"),
    Rule("policy.generation.vllm_cfg.use_deep_gemm", "ignored", "a GPU kernel choice"),
    Rule("policy.generation.vllm_cfg.num_last_layers_in_bf16", "refused", "mixed-precision layers are not implemented",
         off_is(0)),
    Rule("policy.generation.vllm_cfg.num_first_layers_in_bf16", "refused", "mixed-precision layers are not implemented",
         off_is(0)),
    Rule("policy.generation.vllm_cfg.enable_vllm_metrics_logger", "ignored", "vLLM's own metrics"),
    Rule("policy.generation.vllm_cfg.vllm_metrics_logger_interval", "ignored", "vLLM's own metrics"),
    Rule("policy.generation.vllm_cfg.http_refit_api_key_env_var", "ignored", "an HTTP refit transport, not used"),
    Rule("policy.generation.vllm_cfg.http_refit_server_port", "ignored", "an HTTP refit transport, not used"),
    Rule("policy.generation.vllm_cfg.zmq_refit_server_port", "ignored", "a ZeroMQ refit transport, not used"),
    Rule("policy.generation.vllm_cfg.reset_encoder_cache_after_weight_update", "ignored", "multimodal encoders only"),
    # ---- data, env
    Rule("data.train", "mapped", _HUB_DATA),
    Rule("data.validation", "refused", "a validation file without `data.train` (give both, or `data.val_path`)", OFF_NULL),
    Rule("data.default", "mapped", "the keys `data.train` and `data.validation` lack"),
    Rule("data.num_workers", "ignored", "data-loader processes"),
    Rule("data.use_multiple_dataloader", "refused", "several data loaders are not implemented", OFF_FALSE),
    Rule("data.add_bos", "mapped", "a row starts as the tokenizer's chat template starts it"),
    Rule("data.add_eos", "refused", "every demonstration ends with EOS here", off_is(True)),
    Rule("data.add_generation_prompt", "mapped", "the assistant turn follows the prompt in the chat template's own form"),
    Rule("env.math", "refused", "only NeMo-RL's default `math_verify_impl: hf_math_verify` is here (math-verify, "
         "nrl_tasks.environments.math_verify, the reward of `data.default.env_name: math`); its verifier workers "
         "(`num_workers`) are not needed: the score stage verifies in the flow process",
         Off(lambda v: v is None or (isinstance(v, Mapping) and v.get("math_verify_impl", "hf_math_verify") == "hf_math_verify"),
             "math_verify_impl: hf_math_verify")),
    # ---- checkpointing, cluster, logger
    Rule("checkpointing.checkpoint_dir", "mapped", "a run's checkpoints are `<storage>/<run-id>/checkpoints` (`--storage`)"),
    Rule("checkpointing.metric_name", "mapped", "NeMo-RL's `val:<name>` is the metrics column `val_<name>`",
         convert=_metric_name),
    Rule("checkpointing.checkpoint_must_save_by", "ignored", "a wall-clock deadline for saving: checkpoints are the same"),
    Rule("checkpointing.model_save_format", "refused", "checkpoints are safetensors", off_is("safetensors", None)),
    Rule("checkpointing.save_consolidated", "mapped", "a checkpoint's `weights` folder is a whole Hugging Face model"),
    Rule("cluster.master_port_range_low", "ignored", "rendezvous ports"),
    Rule("cluster.master_port_range_high", "ignored", "rendezvous ports"),
    Rule("cluster.segment_size", "ignored", "NVLink topology"),
    Rule("logger.num_val_samples_to_print", "ignored", "console output (`logger.num_rollouts_to_show` shows rollouts)"),
    Rule("logger.monitor_gpus", "ignored", "GPU monitoring"),
    Rule("logger.gpu_monitoring", "ignored", "GPU monitoring"),
    Rule("logger.swanlab_enabled", "refused", "SwanLab is not supported (TensorBoard, MLflow and W&B are)", OFF_FALSE),
    Rule("logger.swanlab", "ignored", "read only with `logger.swanlab_enabled`"),
    Rule("logger.tensorboard", "mapped", "TensorBoard files go to `<logger.log_dir>/<run-id>/tensorboard`"),
    Rule("logger.log_dir", "mapped", "NeMo-RL's `<log_dir>/exp_<n>` a run is `<log_dir>/<run-id>` here (`tensorboard/`, "
         "`wandb/`; MLflow's store `<log_dir>/mlflow`), a relative path from the working directory as in NeMo-RL; the "
         "run's own record (metrics.jsonl, status, summary, checkpoints) is `<storage>/<run-id>`", convert=lambda v: v),
    Rule("logger.wandb.log_nemo_gym_full_result_tables", "ignored", "NeMo-Gym payload tables"),
)



def _for_section(rule: Rule, section: str) -> Rule:
    """A ``policy.*`` rule for the same key of another whole policy config in NeMo-RL's files:
    distillation's ``teacher``, PPO's ``value``."""
    swap = lambda key: None if key is None else section + key[len("policy"):] if key.startswith("policy") else key  # noqa: E731
    return dataclasses.replace(rule, key=swap(rule.key), to=swap(rule.to))


RULES = (*RULES, *(_for_section(r, s) for s in ("teacher", "value") for r in RULES if r.key.startswith("policy.")))

_BY_KEY = {r.key: r for r in RULES}


def rule_for(key: str) -> Rule | None:
    """The rule of dotted ``key`` or of the nearest section above it."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        if (rule := _BY_KEY.get(".".join(parts[:n]))) is not None:
            return rule
    return None


@dataclass
class Translation:
    """A config's data with the rules applied, and what became of each NeMo-RL key."""

    data: dict[str, Any]
    fates: dict[str, list[tuple[str, str]]] = field(default_factory=lambda: {f: [] for f in ("mapped", "ignored", "refused")})
    errors: list[str] = field(default_factory=list)

    def notice(self) -> str | None:
        """One line naming the keys ignored, or ``None``."""
        keys = [k for k, _ in self.fates["ignored"]]
        if not keys:
            return None
        return (f"NeMo-RL keys ignored ({len(keys)}; they cannot change what is computed here, "
                f"docs/nemo_rl_keys.md): {', '.join(keys)}")


def _get(data: Mapping[str, Any], key: str) -> tuple[bool, Any]:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _pop(data: dict[str, Any], key: str) -> None:
    *parents, last = key.split(".")
    node = data
    for part in parents:
        node = node[part]
    del node[last]


def _put(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _in_disabled_section(data: Mapping[str, Any], key: str) -> bool:
    """Whether a section above ``key`` has ``enabled: false`` (its keys cannot change anything)."""
    parts = key.split(".")
    return any(_get(data, ".".join(parts[:n] + ["enabled"])) == (True, False) for n in range(1, len(parts)))


def _moot(data: Mapping[str, Any], rule: Rule) -> bool:
    if rule.moot_if is None:
        return False
    sibling, value = rule.moot_if
    return _get(data, rule.key.rsplit(".", 1)[0] + "." + sibling) == (True, value)


def translate(data: Mapping[str, Any]) -> Translation:
    """``data`` (a resolved config) with every rule applied: keys honoured as off and ignored keys
    removed, mapped keys moved or converted, refused keys listed in ``errors`` (``key: why``)."""
    out = Translation(copy.deepcopy(dict(data)))
    out.fates["mapped"] += map_datasets(out.data, _get(out.data, "env.reward_fn")[1], out.errors)
    for rule in RULES:
        present, value = _get(out.data, rule.key)
        if not present:
            continue
        if rule.convert is not None:
            converted = rule.convert(value)
            _put(out.data, rule.key, converted)
            if converted != value:
                out.fates["mapped"].append((rule.key, rule.why))
            continue
        _pop(out.data, rule.key)
        if (rule.off is not None and rule.off(value)) or _in_disabled_section(data, rule.key) or _moot(data, rule):
            continue  # honoured: NeMo-RL's value turns the feature off (or its section is off), as here
        if rule.fate == "refused":
            out.errors.append(f"{rule.key}: {rule.why} (got {value!r:.80}; honoured when {rule.off.text if rule.off else 'absent'})")
        elif rule.fate == "mapped" and rule.to is not None:
            have, current = _get(out.data, rule.to)
            if have and current != value:
                out.errors.append(f"{rule.key}: {value!r:.60} disagrees with {rule.to} ({current!r:.60}); {rule.why}")
            else:
                _put(out.data, rule.to, value)
            out.fates["mapped"].append((rule.key, rule.why))
        else:
            out.fates[rule.fate].append((rule.key, rule.why))
    return out


def leaf_keys(data: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Every dotted key of ``data`` down to its leaves (an empty mapping is a leaf)."""
    yield from flatten(data, prefix)


def fate_of(key: str, schema_keys: set[str]) -> tuple[str, str]:
    """(fate, note) of one leaf ``key`` of a NeMo-RL file: its rule's, or honoured when the
    schema takes it, or ``unknown``."""
    if key.startswith(("data.train.", "data.validation.", "data.default.")):
        return KEY_FATES.get(key.rsplit(".", 1)[-1], ("refused", "not read here"))
    rule = rule_for(key)
    if rule is None:
        return ("honoured", "") if key in schema_keys or any(key.startswith(s + ".") for s in schema_keys) else ("unknown", "")
    if rule.off is not None:
        moot = f" (or {rule.moot_if[0]} is {rule.moot_if[1]!r})" if rule.moot_if else ""
        return f"honoured when {rule.off.text}{moot}, else {rule.fate}", rule.why
    return rule.fate, rule.why


def schema_keys() -> set[str]:
    """Dotted keys the config schema takes (free-form mappings such as ``kwargs`` as one key)."""
    found: set[str] = set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            key = f"{prefix}{name}"
            found.add(key)
            for tp in _models_in(info.annotation):
                walk(tp, key + ".")

    walk(MasterConfig, "")
    return found


def _models_in(annotation: Any) -> list[type]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _models_in(a)]


def fate_lines(data: Mapping[str, Any], *, shown: int = 40) -> list[str]:
    """What became of ``data``'s keys (a config resolved with its overrides): one count line by fate,
    then the mapped and ignored keys with how or why (``nrl check``; at most ``shown`` a fate)."""
    out = translate(data)
    leaves = list(leaf_keys(data))
    moved = {k for fate in ("mapped", "ignored", "refused") for k, _ in out.fates[fate]}
    honoured = sum(1 for k in leaves if not any(k == m or k.startswith(m + ".") for m in moved))
    counts = {"honoured": honoured, **{f: len(out.fates[f]) for f in ("mapped", "ignored", "refused")}}
    lines = ["keys by fate (docs/nemo_rl_keys.md): " + ", ".join(f"{n} {f}" for f, n in counts.items())]
    for fate in ("mapped", "ignored"):
        items = out.fates[fate]
        for key, why in items[:shown]:
            lines.append(f"  {fate}: {key}: {why}")
        if len(items) > shown:
            lines.append(f"  {fate}: ... and {len(items) - shown} more")
    return lines


def key_table(files: Mapping[str, Mapping[str, Any]]) -> str:
    """The Markdown table of every leaf key of ``files`` (name -> resolved data) and its fate."""
    known = schema_keys()
    rows: dict[str, tuple[str, str, list[str]]] = {}
    for name, data in files.items():
        for key in leaf_keys(data):
            fate, note = fate_of(key, known)
            rows.setdefault(key, (fate, note, []))[2].append(name)
    lines = ["| key | fate | how / why | in |", "|---|---|---|---|"]
    for key in sorted(rows):
        fate, note, names = rows[key]
        lines.append(f"| `{key}` | {fate} | {note.replace('|', '/')} | {', '.join(names)} |")
    return "\n".join(lines) + "\n"


def _main(paths: list[str]) -> int:
    files = {os.path.basename(p): resolve_interpolations(compose_file(p), repr(p)) for p in paths}
    print("# NeMo-RL config keys and their fate here\n")
    print("Every key of NeMo-RL's example files in `tests/data/nemo_rl_configs/` (defaults resolved). Written by "
          "`python -m flows.config.nemo_rl tests/data/nemo_rl_configs/*.yaml tests/data/nemo_rl_configs/recipes/llm/*.yaml` "
          "from the rules in "
          "`flows/config/nemo_rl.py` (a test checks it is current). *honoured*: same key, same meaning "
          "(with a condition: honoured for the values named, refused for others); *mapped*: another mechanism "
          "here with the same effect; *ignored*: cannot change what is computed, named in one warning line; "
          "*refused*: an error naming the key.\n")
    print(key_table(files), end="")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
