"""NeMo-RL's ``max_num_epochs``, written once for every recipe: a run ends after the fewer of
``<section>.max_num_steps`` and ``max_num_epochs`` passes over its train split, a pass being
``rows // per_step`` steps (NeMo-RL's ``max_num_epochs * len(dataloader)``, the dataloader
dropping a last partial batch). ``per_step`` is ``grpo.num_prompts_per_step`` for GRPO and
``policy.train_global_batch_size`` for DPO and SFT.

The train split's row count is read once per (loader, data config, seed, storage options): the
budget is asked for often (every step's plan, the summary, the resume plan)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from nrl_tasks.config.master import MasterConfig

__all__ = ["RowLoader", "epoch_problems", "epoch_steps", "train_row_count"]

#: ``load(data_cfg, split, seed, storage_options)`` -> the split's rows (e.g.
#: :func:`nrl_tasks.stages.data.load_prompt_records`)
RowLoader = Callable[[Any, str, int, "dict[str, Any] | None"], list]

_DataConfig = type(MasterConfig.model_fields["data"].get_default(call_default_factory=True))


def train_row_count(load: RowLoader, cfg: MasterConfig, seed: int) -> int:
    """Rows of ``cfg``'s train split as ``load`` reads them (drawn with ``seed``)."""
    opts = cfg.storage.storage_options or None
    return _count(load, cfg.data.model_dump_json(), seed, json.dumps(opts, sort_keys=True) if opts else "")


@functools.lru_cache(maxsize=32)
def _count(load: RowLoader, data_json: str, seed: int, opts_json: str) -> int:
    return len(load(_DataConfig.model_validate_json(data_json), "train", seed, json.loads(opts_json) if opts_json else None))


def epoch_steps(max_num_steps: int, max_num_epochs: int | None, rows: Callable[[], int], per_step: int) -> int:
    """The run's length: ``max_num_steps``, or fewer with ``max_num_epochs`` (``rows()`` is read
    only then).

    >>> epoch_steps(100, None, lambda: 1 / 0, 4), epoch_steps(100, 2, lambda: 11, 4), epoch_steps(5, 2, lambda: 11, 4)
    (100, 4, 4)
    """
    if max_num_epochs is None:
        return max_num_steps
    return min(max_num_steps, max_num_epochs * (rows() // per_step))


def epoch_problems(section: str, max_num_epochs: int | None, rows: Callable[[], int], per_step: int, per_step_key: str,
                   unit: str) -> list[str]:
    """``max_num_epochs`` with too few train rows for one step (an unreadable file: none here, the
    data check names it).

    >>> epoch_problems("grpo", 1, lambda: 3, 4, "grpo.num_prompts_per_step", "prompts")
    ["grpo.max_num_epochs=1: the train split's 3 prompts make no step of grpo.num_prompts_per_step=4 (NeMo-RL drops a last partial batch)"]
    """
    if max_num_epochs is None:
        return []
    try:
        n = rows()
    except (OSError, ValueError):
        return []
    if n < per_step:
        return [f"{section}.max_num_epochs={max_num_epochs}: the train split's {n} {unit} make no step of "
                f"{per_step_key}={per_step} (NeMo-RL drops a last partial batch)"]
    return []
