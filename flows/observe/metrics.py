"""``metrics.jsonl``: exactly one JSON line per step, keyed by step.

Each step's line is assembled from the committed stage manifests of that step (so a resumed
run can write the line of a step trained before the crash) plus the refit/validation/checkpoint
results of the flow, and the whole file is rewritten atomically with the line replaced: a
resume never duplicates a step.

Attempts (stages retried on actor faults): ``generate_attempts``, ``logprob_attempts``,
``train_attempts`` in every line, ``refit_attempts`` when the refit ran, ``checkpoint_attempts``
and ``val_attempts`` in the lines of steps that checkpointed / validated. Each is the Prefect run
count of the task attempt that returned (1: no retry, 2: one retry, ...), or **0** when the stage
did no work in this flow run: its output was already committed (by an earlier flow run, before a
resume) or, for the refit, the generation workers already held the weights.

**Repair** (:func:`repair_metrics`, run by every recovery): a line that is not a JSON object with
a ``step`` is dropped with a warning naming the file and line number (:func:`read_metrics` never
fails on one), and the line of every trained step before the last that is missing is rebuilt from
the step's committed datasets and checkpoint (:func:`rebuild_step_metrics`), marked
``"rebuilt": true``; the file is then rewritten atomically. A rebuilt line holds every figure
the manifests hold (rewards, loss, tokens, each stage's ``<stage>_s``, ``val_accuracy``,
``checkpoint_s`` of checkpoints that record their seconds) but not what only the flow run knew:
``refit_s``, ``refit_mb``, ``step_s``, ``orchestration_s`` and the attempts columns (``None``: unknown), and
``compute_s`` / ``stages_s`` without the refit.

``orchestration_s`` (:func:`orchestration_seconds`): the step's wall time (``step_s``) minus the time
spent inside stage compute; the console line shows the split (``step 3.10s = work 0.40s +
orchestration 2.70s``). Datasets deleted by retention leave their figures ``None``.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Callable, Iterable, Mapping

import storage
from nrl_tasks.stages.checkpoint import is_checkpoint_committed, read_checkpoint_info
from nrl_tasks.stages.errors import DamagedRunError
from nrl_tasks.stages.graph import GRPO_GRAPH, STAGES, StageGraph
from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.utils.jsonl import jsonl_lines
from storage import fs

__all__ = [
    "build_step_metrics",
    "format_console_line",
    "orchestration_seconds",
    "read_metrics",
    "mark_rebuilt",
    "rebuild_step_metrics",
    "repair_metrics",
    "stage_figures",
    "stored_step",
    "upsert_metrics",
]

_log = logging.getLogger(__name__)

#: stage name in the line ("<name>_s") -> dataset whose manifest holds ``seconds`` (the stage graph)
STAGE_SECONDS = {s.name: s.output for s in STAGES}

#: stage name in the line ("<name>_attempts") -> dataset whose reference holds ``attempts``: the
#: stages retried on actor faults
STAGE_ATTEMPTS = {s.name: s.output for s in STAGES if s.retried}


#: figures of dynamic sampling's step datasets (in the line only when it is on)
DYNAMIC_SAMPLING_KEYS = (
    "dynamic_sampling_num_gen_batches", "dynamic_sampling_num_discarded_valid_samples", "dynamic_sampling_zero_std_groups",
    "unfiltered_reward_mean",
)


def _fs():
    return fs


def _parse(text: str, uri: str, log: Any = None) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """``({step: row}, [line numbers of damaged lines])``; each damaged line logged."""
    rows: dict[int, dict[str, Any]] = {}
    bad: list[int] = []
    for n, line in jsonl_lines(text):
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, TypeError, KeyError) as exc:
            bad.append(n)
            (log or _log).warning(
                "%s line %d is damaged (%s: %s), ignored: %.80r", uri, n, type(exc).__name__, exc, line
            )
            continue
        rows[step] = row
    return rows, bad


def read_metrics(uri: str, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The lines of ``metrics.jsonl`` sorted by step (empty list when the file does not exist);
    a damaged line is skipped with a warning naming the file and line number."""
    fs = _fs()
    if not fs.exists(uri, storage_options=storage_options):
        return []
    rows, _bad = _parse(fs.read_text(uri, storage_options=storage_options), uri)
    return [rows[k] for k in sorted(rows)]


def _write(uri: str, rows: Mapping[int, Mapping[str, Any]], storage_options: dict[str, Any] | None) -> list[dict[str, Any]]:
    ordered = [dict(rows[k]) for k in sorted(rows)]
    text = "".join(json.dumps(r, sort_keys=False) + "\n" for r in ordered)
    _fs().write_text_atomic(uri, text, storage_options=storage_options)
    return ordered


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def upsert_metrics(uri: str, row: Mapping[str, Any], storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Insert or replace the line of ``row["step"]``; rewrite the file atomically; return all rows."""
    rows = {int(r["step"]): r for r in read_metrics(uri, storage_options)}
    rows[int(row["step"])] = {k: _clean(v) for k, v in row.items()}
    return _write(uri, rows, storage_options)


def drop_metrics_after(uri: str, step: int, storage_options: dict[str, Any] | None = None) -> None:
    """Remove the lines of steps ``>= step`` (used by ``--recompute``)."""
    rows = [r for r in read_metrics(uri, storage_options) if int(r["step"]) < step]
    _fs().write_text_atomic(uri, "".join(json.dumps(r) + "\n" for r in rows), storage_options=storage_options)


#: the ``generate`` figures of a multi-turn step (:mod:`nrl_tasks.stages.multi_turn`)
MULTI_TURN_KEYS = ("turns_mean", "turns_max", "terminated_frac", "env_seconds")


#: each dataset's seconds inside actor calls or reward functions (``compute_s``)
_COMPUTE_SECONDS = (("rollouts", "generate_seconds"), ("rewards", "seconds"), ("logprobs", "compute_seconds"),
                    ("teacher", "compute_seconds"), ("train", "train_seconds"))


def build_step_metrics(
    step: int,
    manifests: Mapping[str, Mapping[str, Any] | None],
    *,
    refit: Mapping[str, Any] | None = None,
    val: Mapping[str, Any] | None = None,
    checkpoint: Mapping[str, Any] | None = None,
    wall_seconds: float | None = None,
    rewards: Any = None,
    graph: StageGraph = GRPO_GRAPH,
) -> dict[str, Any]:
    """The metrics line of ``step`` from its stage manifests (dicts from ``committed``/tasks).

    ``rewards`` (optional ``(rewards, valid)`` tensors) adds ``reward_std`` and ``accuracy``;
    ``graph``: the stages of the run's algorithm (GRPO's, or distillation's, which samples as GRPO).
    """
    get = lambda stage, key: (manifests.get(stage) or {}).get(key)  # noqa: E731
    row: dict[str, Any] = {"step": step, "weights_version": step}
    row["reward_mean"] = get("rewards", "reward_mean")
    if rewards is not None:
        r, ok = rewards
        good = r[ok.bool()].float()
        if good.numel():
            row["reward_mean"] = float(good.mean())
            row["reward_std"] = float(good.std()) if good.numel() > 1 else 0.0
            row["reward_max"] = float(good.max())
    row["invalid_rewards"] = get("rewards", "invalid_rewards")
    row["loss"] = get("train", "loss")
    row["grad_norm"] = get("train", "grad_norm")
    row["is_weight_mean"] = get("train", "is_weight_mean")
    row["is_weight_max"] = get("train", "is_weight_max")
    row["policy_state_mb_per_rank"] = get("train", "policy_state_mb_per_rank")
    row["groups_with_signal"] = get("advantages", "groups_with_signal")
    for key in DYNAMIC_SAMPLING_KEYS:  # grpo.use_dynamic_sampling only
        value = get("rollouts", key) if key.startswith("dynamic") else get("rewards", key)
        if value is not None:
            row[key] = value
    for key in MULTI_TURN_KEYS:  # env.environment only: turns per episode, how episodes ended, environment time
        if get("rollouts", key) is not None:
            row[key] = get("rollouts", key)
    for key, value in (manifests.get("rewards") or {}).items():  # the environment's own step metrics
        if key.startswith("env_") and key not in row:
            row[key] = value
    row["new_tokens"] = get("rollouts", "new_tokens")
    row["truncated_frac"] = get("rollouts", "truncated_frac")
    row["tokens_per_s"] = get("rollouts", "tokens_per_s")
    row["train_tokens_per_s"] = get("train", "tokens_per_s")
    # time spent in actor calls / reward functions (the work itself; the rest of step_s is
    # orchestration, persistence and bookkeeping)
    compute = [get(d, key) for d, key in _COMPUTE_SECONDS if d in graph.datasets]
    val_figures = {"val_accuracy": (val or {}).get("val_accuracy")} if val is not None else {}
    if val is not None and val.get("val_turns_mean") is not None:  # a multi-turn environment's episodes
        val_figures["val_turns_mean"] = val["val_turns_mean"]
    row.update(stage_figures(graph, manifests, compute, refit=refit, val=val, val_figures=val_figures,
                             checkpoint=checkpoint, wall_seconds=wall_seconds))
    return {k: _clean(v) for k, v in row.items()}


def stage_figures(
    graph: StageGraph,
    manifests: Mapping[str, Mapping[str, Any] | None],
    compute: list[float | None],
    *,
    refit: Mapping[str, Any] | None = None,
    val: Mapping[str, Any] | None = None,
    val_figures: Mapping[str, Any] | None = None,
    checkpoint: Mapping[str, Any] | None = None,
    wall_seconds: float | None = None,
) -> dict[str, Any]:
    """The part of a metrics line every algorithm has, from its stage graph: ``compute_s`` (the
    sum of ``compute``, the seconds inside actor calls, plus the refit's), ``<stage>_s`` of each
    stage, ``refit_s``/``refit_mb``, ``checkpoint_s``, the validation's ``val_figures`` and
    ``val_s``, ``stages_s``, ``<stage>_attempts`` of the stages retried on actor faults and of
    the step's actions that ran, ``step_s`` and ``orchestration_s``."""
    get = lambda stage, key: (manifests.get(stage) or {}).get(key)  # noqa: E731
    row: dict[str, Any] = {}
    parts = [*compute, (refit or {}).get("seconds")]
    row["compute_s"] = sum(c for c in parts if c is not None) if any(c is not None for c in parts) else None
    total = 0.0
    for spec in graph.stages:
        sec = get(spec.output, "seconds")
        row[f"{spec.key}_s"] = sec
        total += sec or 0.0
    if refit is not None:
        row["refit_s"] = refit.get("seconds")
        if refit.get("bytes") is not None:
            row["refit_mb"] = round(refit["bytes"] / 1e6, 3)
        total += refit.get("seconds") or 0.0
    if checkpoint is not None and not checkpoint.get("skipped"):
        row["checkpoint_s"] = checkpoint.get("seconds")
        total += checkpoint.get("seconds") or 0.0
    if val is not None:
        row.update(val_figures or {})
        row["val_s"] = val.get("seconds")
    row["stages_s"] = total
    for spec in graph.stages:
        if spec.retried:
            row[f"{spec.key}_attempts"] = _attempts(manifests.get(spec.output))
    for name, result in (("refit", refit), ("checkpoint", checkpoint), ("val", val)):
        if result is not None:
            row[f"{name}_attempts"] = _attempts(result)
    if wall_seconds is not None:
        row["step_s"] = wall_seconds
        row["orchestration_s"] = orchestration_seconds(wall_seconds, row)
    return row


def orchestration_seconds(step_s: float, row: Mapping[str, Any]) -> float | None:
    """``orchestration_s``: a step's wall time minus the time spent inside stage compute (actor
    calls and reward functions, ``compute_s``, plus the checkpoint write and the validation when
    they ran): Prefect's task and subflow machinery, commits, manifests and bookkeeping. ``None``
    when the step's compute is unknown; never below 0 (the parts are timed apart)."""
    if row.get("compute_s") is None:
        return None
    work = float(row["compute_s"]) + float(row.get("checkpoint_s") or 0.0) + float(row.get("val_s") or 0.0)
    return max(0.0, float(step_s) - work)


def stored_step(
    layout: Any, step: int, datasets: Iterable[str], storage_options: dict[str, Any] | None = None,
) -> tuple[dict[str, dict[str, Any] | None], dict[str, Any] | None, dict[str, Any] | None]:
    """What storage holds of trained step ``step``: the summaries of its committed ``datasets``
    (``None``: not committed), of its ``val`` and of its checkpoint (its seconds; ``None``: none)."""
    kw = {"storage_options": storage_options} if storage_options else {}

    def committed(name: str) -> dict[str, Any] | None:
        uri = layout.stage_uri(step, name)
        if not storage.is_committed(uri, **kw):
            return None
        return DatasetRef.from_manifest(storage.read_manifest(uri, **kw), uri).summary()

    checkpoint = None
    ck = layout.checkpoint_uri(step)
    if is_checkpoint_committed(ck, storage_options):
        try:
            seconds = read_checkpoint_info(ck, storage_options).get("seconds")
        except DamagedRunError:  # the resume plan deals with the checkpoint; the line lacks its time
            seconds = None
        checkpoint = {"seconds": seconds, "attempts": None}
    return {d: committed(d) for d in datasets}, committed("val"), checkpoint


def mark_rebuilt(row: dict[str, Any]) -> dict[str, Any]:
    """A rebuilt line: its attempts unknown (no record of the flow run that did the work), ``rebuilt: true``."""
    for key in [k for k in row if k.endswith("_attempts")]:
        row[key] = None
    row["rebuilt"] = True
    return row


def rebuild_step_metrics(layout: Any, step: int, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The metrics line of trained step ``step`` from what storage holds (its committed
    datasets, its ``val`` and checkpoint), marked ``"rebuilt": true``; see the module docstring
    for what it lacks."""
    manifests, val, checkpoint = stored_step(layout, step, {*STAGE_SECONDS.values(), "train"}, storage_options)
    rewards = None
    if manifests.get("rewards") is not None:
        kw = {"storage_options": storage_options} if storage_options else {}
        rw = storage.load_batch(layout.stage_uri(step, "rewards"), columns=["rewards", "reward_valid"], **kw)
        rewards = (rw["rewards"], rw["reward_valid"])
    return mark_rebuilt(build_step_metrics(step, manifests, val=val, checkpoint=checkpoint, rewards=rewards))


def repair_metrics(
    layout: Any, last: int, storage_options: dict[str, Any] | None = None, *,
    rebuild: Callable[[Any, int, dict[str, Any] | None], dict[str, Any]] | None = None, log: Any = None,
) -> list[int]:
    """Make ``metrics.jsonl`` hold one valid line for each of steps ``1..last``: drop damaged
    lines (warning with file and line number) and rebuild the missing ones (``rebuild``: the run's
    algorithm's, GRPO's :func:`rebuild_step_metrics` by default); rewrite the file atomically when
    anything changed.

    Returns the steps rebuilt. The caller passes the trained steps whose line it will not write
    itself (the flow runs the last trained step again, which writes that line)."""
    log = log or _log
    uri, fs = layout.metrics_uri, _fs()
    text = fs.read_text(uri, storage_options=storage_options) if fs.exists(uri, storage_options=storage_options) else ""
    rows, bad = _parse(text, uri, log)
    lost = [s for s in range(1, last + 1) if s not in rows]
    if not lost and not bad:
        return []
    for s in lost:
        rows[s] = (rebuild or rebuild_step_metrics)(layout, s, storage_options)
    _write(uri, rows, storage_options)
    if lost:
        log.warning(
            "%s lacked the line(s) of trained step(s) %s: rebuilt from the committed datasets (marked rebuilt; "
            "refit_s, step_s and attempts unknown)", uri, ", ".join(map(str, lost)),
        )
    return lost


def _attempts(result: Mapping[str, Any] | None) -> int:
    """``attempts`` of a task result; 0 for a committed manifest read back (no task ran)."""
    return int((result or {}).get("attempts") or 0)


def _fmt(v: Any, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def format_console_line(run_id: str, row: Mapping[str, Any], max_steps: int) -> str:
    """``[run] step 3/10 reward 0.312 loss -0.012 | gen 1.2s score 0.0s lp 0.3s train 1.1s refit 0.1s | 512 tok/s
    | step 3.10s = work 2.70s + orchestration 0.40s``, plus ``| attempts train x2`` when a stage needed retries."""
    parts = [
        f"[{run_id}] step {row['step']}/{max_steps}",
        f"reward {_fmt(row.get('reward_mean'), '.3f')}",
        f"loss {_fmt(row.get('loss'), '.4f')}",
    ]
    if row.get("val_accuracy") is not None:
        parts.append(f"val_acc {row['val_accuracy']:.3f}")
    stages = (("gen", "generate_s"), ("score", "score_s"), ("lp", "logprob_s"), ("teacher", "teacher_s"), ("train", "train_s"),
              ("refit", "refit_s"))
    t = " ".join(  # distillation's line has a teacher instead of logprobs
        f"{label} {_fmt(row.get(key), '.2f')}s" for label, key in stages if key in row or key not in ("teacher_s", "logprob_s")
        or (key == "logprob_s" and "teacher_s" not in row)
    )
    tail = f"{_fmt(row.get('tokens_per_s'), '.0f')} tok/s"
    if row.get("step_s") is not None:
        tail += f" | step {row['step_s']:.2f}s"
        if row.get("orchestration_s") is not None:  # the step's wall time = stage work + orchestration
            tail += f" = work {row['step_s'] - row['orchestration_s']:.2f}s + orchestration {row['orchestration_s']:.2f}s"
    retried = [
        f"{key[: -len('_attempts')]} x{row[key]}" for key in row
        if key.endswith("_attempts") and isinstance(row[key], int) and row[key] > 1
    ]
    if retried:
        tail += " | attempts " + " ".join(retried)
    return " ".join(parts) + " | " + t + " | " + tail
