"""What pydantic's lax mode lets through, checked on the raw config data before validation.

- a boolean where a number goes (``grpo.max_num_steps=true`` read as 1 step);
- ``inf`` / ``nan`` (``gt=0`` accepts ``inf``), also inside free-form dicts (``vllm_cfg.llm_kwargs``);
- absurd sizes (``generation.num_workers=1000``): the sections of ``nrl_tasks`` are not changed
  here, so their maxima live in :data:`MAXIMA`; the sections of :mod:`nrl_tasks.config` carry theirs
  as ``Field(le=...)`` in the field descriptions.

Integers written as integral floats (``data.arithmetic.num_train=1e6``) stay accepted, as
pydantic does; ``1.5`` for an integer stays pydantic's error.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from nrl_tasks.models.generation.interfaces import GenerationConfig, VllmConfig
from nrl_tasks.models.policy import (
    DynamicBatchingConfig,
    OptimizerKwargs,
    PolicyConfig,
    SchedulerConfig,
    SequencePackingConfig,
)

__all__ = [
    "INT64",
    "MAX_DATASET_ROWS",
    "MAX_ITEMS",
    "MAX_PROMPTS",
    "MAX_RETRIES",
    "MAX_ROWS",
    "MAX_SECONDS",
    "MAX_SEQUENCE_TOKENS",
    "MAX_STEPS",
    "MAX_WORKERS",
    "MAXIMA",
    "Bound",
    "check_delays",
    "value_errors",
]

MAX_PROMPTS = 65536
"""Prompts in one GRPO step."""
MAX_DATASET_ROWS = 10**8
"""Rows of a generated dataset or validation sample."""
MAX_RETRIES = 100
"""Retries of a task or storage call."""
MAX_ROWS = 1 << 20
"""Rows in one batch (a step's rollouts, a train or logprob batch): 1,048,576."""
MAX_SEQUENCE_TOKENS = 1 << 20
"""Tokens in one sequence (prompt + generation, ``max_new_tokens``, ``max_model_len``): 1,048,576."""
MAX_MB_TOKENS = 1 << 24
"""Padded tokens in one dynamic-batching / packing micro-batch: 16,777,216."""
MAX_WORKERS = 1024
"""Actors or threads of one kind; the CPUs really there are checked when Ray starts."""
MAX_STEPS = 10**7
"""GRPO steps (a run, a period); optimizer steps of a schedule may be 100x more."""
MAX_SECONDS = 86_400.0
"""Timeouts and retry delays: one day."""
MAX_ITEMS = 1024
"""Items of a list of stop tokens or strings."""
INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class Bound:
    """Inclusive range of a number (``None``: open); for a list, of its items, with at most ``max_items``."""

    lo: float | None = None
    hi: float | None = None
    max_items: int | None = None


_SEED = Bound(*INT64)
_TOKEN_ID = Bound(0, 2**31 - 1)

MAXIMA: dict[type[BaseModel], dict[str, Bound]] = {
    PolicyConfig: {
        "train_global_batch_size": Bound(hi=MAX_ROWS),
        "train_micro_batch_size": Bound(hi=MAX_ROWS),
        "logprob_batch_size": Bound(hi=MAX_ROWS),
        "max_total_sequence_length": Bound(hi=MAX_SEQUENCE_TOKENS),
        "seed": _SEED,
        "num_cpus_per_worker": Bound(hi=MAX_WORKERS),
        "torch_num_threads": Bound(hi=MAX_WORKERS),
        "dist_timeout_s": Bound(hi=MAX_SECONDS),
    },
    OptimizerKwargs: {},  # lr > 0 is the section's own check; finite is checked for every number
    SchedulerConfig: {"warmup_steps": Bound(hi=100 * MAX_STEPS), "total_steps": Bound(hi=100 * MAX_STEPS)},
    DynamicBatchingConfig: {
        "train_mb_tokens": Bound(hi=MAX_MB_TOKENS),
        "logprob_mb_tokens": Bound(hi=MAX_MB_TOKENS),
        "sequence_length_round": Bound(hi=MAX_SEQUENCE_TOKENS),
    },
    SequencePackingConfig: {
        "train_mb_tokens": Bound(hi=MAX_MB_TOKENS),
        "logprob_mb_tokens": Bound(hi=MAX_MB_TOKENS),
        "sequence_length_pad_multiple": Bound(hi=MAX_SEQUENCE_TOKENS),
    },
    GenerationConfig: {
        "max_new_tokens": Bound(hi=MAX_SEQUENCE_TOKENS),
        "top_k": Bound(hi=1 << 24),
        "stop_token_ids": Bound(_TOKEN_ID.lo, _TOKEN_ID.hi, max_items=MAX_ITEMS),
        "stop_strings": Bound(max_items=MAX_ITEMS),
        "pad_token_id": _TOKEN_ID,
        "num_workers": Bound(hi=MAX_WORKERS),
        "seed": Bound(0, 2**31 - 1),  # + 7919 * rank seeds torch; vLLM seeds numpy (< 2**32) with it
        "num_cpus_per_worker": Bound(hi=MAX_WORKERS),
        "torch_num_threads": Bound(hi=MAX_WORKERS),
        "max_batch_size": Bound(hi=MAX_ROWS),
        "refit_timeout_s": Bound(hi=MAX_SECONDS),
    },
    VllmConfig: {
        "tensor_parallel_size": Bound(hi=MAX_WORKERS),
        "max_model_len": Bound(hi=MAX_SEQUENCE_TOKENS),
        "kv_cache_space_gib": Bound(hi=1 << 16),
    },
}
"""Maxima (and a few minima) of fields of the ``nrl_tasks`` sections, by section class."""


def check_delays(value: list[float]) -> list[float]:
    """Retry backoff list: each delay in [0, 1 day] s, at most 50 (Prefect's limit); the last one repeats."""
    bad = [d for d in value if not d >= 0]  # also catches NaN
    if bad:
        raise ValueError(f"retry delays must be >= 0 seconds, got {bad[0]!r}")
    if max(value, default=0) > MAX_SECONDS:
        raise ValueError(f"retry delays must be <= {MAX_SECONDS:.0f} seconds (one day), got {max(value)!r}")
    if len(value) > 50:
        raise ValueError(f"at most 50 retry delays (the last one repeats), got {len(value)}")
    return value


def value_errors(model: type[BaseModel], data: Any) -> dict[str, str]:
    """``{dotted key: message}`` for the booleans-as-numbers, non-finite floats and out-of-range
    numbers of ``data`` (raw config data, before validation), guided by ``model``'s field types.

    Keys pydantic will reject (unknown, wrong type) are left to pydantic.

    >>> from nrl_tasks.config.master import MasterConfig
    >>> value_errors(MasterConfig, {"grpo": {"max_num_steps": True}, "generation": {"num_workers": 4096}})
    {'grpo.max_num_steps': 'must be an integer, not a boolean (got True)', 'generation.num_workers': 'must be <= 1024 (got 4096)'}
    """
    out: dict[str, str] = {}
    _model(model, data, (), out)
    return out


def _model(model: type[BaseModel], data: Any, loc: tuple[Any, ...], out: dict[str, str]) -> None:
    if not isinstance(data, dict):
        return
    bounds = MAXIMA.get(model, {})
    for key, value in data.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is not None:
            _value(field.annotation, value, loc + (key,), out, bounds.get(key))


def _unwrap(ann: Any, value: Any = None) -> Any:
    """``X | None`` -> ``X``, ``Annotated[X, ...]`` -> ``X``; a union of several types -> the model
    whose fields hold every key of a mapping ``value``, else ``Any``."""
    while True:
        origin = get_origin(ann)
        if origin is Annotated:
            ann = get_args(ann)[0]
        elif origin is Union or origin is types.UnionType:
            args = [_unwrap(a) for a in get_args(ann) if a is not type(None)]
            if len(args) > 1 and isinstance(value, dict):
                args = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel) and set(value) <= set(a.model_fields)][:1]
            ann = args[0] if len(args) == 1 else Any
        else:
            return ann


def _value(ann: Any, value: Any, loc: tuple[Any, ...], out: dict[str, str], bound: Bound | None) -> None:
    if value is None:
        return
    ann = _unwrap(ann, value)
    origin = get_origin(ann)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        _model(ann, value, loc, out)
    elif ann is int or ann is float:
        _number(ann, value, loc, out, bound)
    elif origin in (list, tuple, set, frozenset) and isinstance(value, (list, tuple)):
        if bound is not None and bound.max_items is not None and len(value) > bound.max_items:
            out[_dotted(loc)] = f"must have at most {bound.max_items} items (got {len(value)})"
            return
        args = get_args(ann)
        fixed = origin is tuple and args and args[-1] is not Ellipsis
        for i, item in enumerate(value):
            item_ann = (args[i] if i < len(args) else Any) if fixed else (args[0] if args else Any)
            _value(item_ann, item, loc + (i,), out, bound)
    elif origin is dict and isinstance(value, dict):
        args = get_args(ann)
        for k, item in value.items():
            _value(args[1] if len(args) == 2 else Any, item, loc + (k,), out, None)
    elif ann is Any or origin in (list, tuple, dict):
        _finite_anywhere(value, loc, out)
    elif origin is Literal or ann in (str, bool):
        return  # pydantic's job


def _number(ann: type, value: Any, loc: tuple[Any, ...], out: dict[str, str], bound: Bound | None) -> None:
    kind = "an integer" if ann is int else "a number"
    if isinstance(value, bool):
        out[_dotted(loc)] = f"must be {kind}, not a boolean (got {value!r})"
        return
    num: float | int
    if isinstance(value, (int, float)):
        num = value
    elif isinstance(value, str):  # pydantic reads numeric strings ("inf" too) in lax mode
        try:
            num = int(value.strip()) if ann is int else float(value.strip())
        except (ValueError, OverflowError):
            return  # not a number: pydantic's error
    else:
        return
    if isinstance(num, float) and not math.isfinite(num):
        out[_dotted(loc)] = f"must be a finite number (got {value!r})"
        return
    if bound is None:
        return
    if bound.lo is not None and num < bound.lo:
        out[_dotted(loc)] = f"must be >= {_show(bound.lo)} (got {value!r})"
    elif bound.hi is not None and num > bound.hi:
        out[_dotted(loc)] = f"must be <= {_show(bound.hi)} (got {value!r})"


def _finite_anywhere(value: Any, loc: tuple[Any, ...], out: dict[str, str]) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        out[_dotted(loc)] = f"must be a finite number (got {value!r})"
    elif isinstance(value, dict):
        for k, item in value.items():
            _finite_anywhere(item, loc + (k,), out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _finite_anywhere(item, loc + (i,), out)


def _show(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _dotted(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc)
