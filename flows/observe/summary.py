"""The run summary: one small Prefect markdown artifact per flow run, updated every step.

What a person watching the run in the Prefect UI wants at a glance: step ``k`` of ``N``, the latest
and best reward, a readable PNG plot of reward and eval accuracy (:mod:`flows.observe.plot`: axes,
ticks, a legend, the reward's moving average, a 0-1 scale for rates; inline: Prefect's UI renders a
data-URI image; with ``plot=False`` text curves instead, unicode sparklines, which Prefect's UI
draws as black blocks), time per step and ETA, the last checkpoint and the best one by
``checkpointing.metric_name``, and the run's history: every flow run of it (start, resumes,
extensions, retries), when it ran, what it restored and replayed and how it ended (crashed,
failed, interrupted, completed; :func:`history_markdown`). Its size does not grow with the run:
the curves are downsampled to the plot's width (:data:`CURVE_WIDTH` points for text) and the
history to :data:`HISTORY_ROWS` rows, and it is updated in place
(:class:`flows.observe.artifacts.SummaryHandle`).

>>> sparkline([0.0, 0.5, 1.0])
'▁▅█'
>>> sparkline([None, 1.0, 1.0])
' ▅▅'
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flows.observe.plot import bucket_means

__all__ = ["CURVE_WIDTH", "GRPO_FIELDS", "HISTORY_ROWS", "TABLE_WINDOW", "SummaryFields", "history_markdown", "metrics_window",
           "sparkline", "summary_markdown"]


@dataclass(frozen=True)
class SummaryFields:
    """What the summary and its plot show of an algorithm's metrics lines (its recipe's ``summary``)."""

    #: the per-step curve (a metrics key) and its label, e.g. ``reward_mean`` / ``reward``
    curve: str = "reward_mean"
    curve_label: str = "reward"
    #: the held-out figure of validation steps and its label, e.g. ``val_accuracy`` / ``eval accuracy``
    eval_metric: str = "val_accuracy"
    eval_label: str = "eval accuracy"
    #: whether a higher curve is better (its "best" row)
    higher_is_better: bool = True


#: GRPO's (and the default) summary fields
GRPO_FIELDS = SummaryFields()

#: points of a text curve at most (older steps are averaged into buckets)
CURVE_WIDTH = 60
#: rows of the metrics-table artifact (newest first)
TABLE_WINDOW = 30
#: flows of the run listed in the summary's history (the newest; ``status.json`` keeps more)
HISTORY_ROWS = 8

_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float | None], width: int = CURVE_WIDTH) -> str:
    """A one-line curve of ``values`` (``None``/NaN: a blank), at most ``width`` characters."""
    vals = [None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) for v in values]
    pts = bucket_means(vals, width)
    known = [v for v in pts if v is not None]
    if not known:
        return ""
    lo, hi = min(known), max(known)
    scale = (len(_BARS) - 1) / (hi - lo) if hi > lo else 0.0
    return "".join(" " if v is None else _BARS[round((v - lo) * scale) if scale else len(_BARS) // 2] for v in pts)


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _clock(unix: Any) -> str:
    import time

    return time.strftime("%m-%d %H:%M:%S", time.gmtime(float(unix))) if isinstance(unix, (int, float)) else "?"


def history_markdown(history: Sequence[Mapping[str, Any]], rows: int = HISTORY_ROWS) -> list[str]:
    """The run's history (``status.json`` ``history``, :mod:`flows.run.history`) as markdown lines:
    one row per flow of the run (the newest ``rows``), what it did, when (UTC) and how it ended (a
    killed flow: ``after <its last heartbeat>``, when it was last seen alive)."""
    if not history:
        return []
    out = ["", f"**History** ({len(history)} flow run(s) of this run{', the last ' + str(rows) if len(history) > rows else ''}, UTC):", "",
           "| # | kind | started | ended | outcome | trained before | restored from | replayed |", "|---:|---|---|---|---|---:|---|---|"]
    for e in history[-rows:]:
        restored = e.get("restore_from")
        restored = "-" if restored is None else "initial weights" if restored == 0 else f"checkpoint {restored}"
        replay = e.get("replay") or []
        replayed = "-" if not replay else f"{replay[0]}..{replay[-1]}" if len(replay) > 2 else ", ".join(map(str, replay))
        outcome = e.get("outcome") or "running"
        if e.get("error"):
            outcome += f": {str(e['error'])[:60]}"
        ended = _clock(e["ended_unix"]) if e.get("ended_unix") else f"after {_clock(e['last_seen_unix'])}" if e.get("last_seen_unix") else "-"
        out.append(f"| {e.get('attempt', '?')} | {e.get('kind', '?')} | {_clock(e.get('started_unix'))} | "
                   f"{ended} | {outcome.replace('|', '/')} | "
                   f"{e.get('trained', '-')} | {restored} | {replayed} |")
    return out


def metrics_window(rows: Sequence[Mapping[str, Any]], n: int = TABLE_WINDOW) -> list[dict[str, Any]]:
    """The newest ``n`` metrics lines, newest first (the metrics-table artifact)."""
    return [dict(r) for r in reversed(rows[-n:])]


def summary_markdown(
    run_id: str,
    rows: Sequence[Mapping[str, Any]],
    max_steps: int,
    *,
    checkpoints: Sequence[tuple[int, str]] = (),
    metric_name: str = "val_accuracy",
    higher_is_better: bool = True,
    links: Mapping[str, str] | None = None,
    plot: bool = True,
    history: Sequence[Mapping[str, Any]] = (),
    fields: SummaryFields = GRPO_FIELDS,
) -> str:
    """The summary of a run from its metrics lines and checkpoints (see the module docstring);
    ``plot``: the PNG plot of :mod:`flows.observe.plot` (inline, as a data URI), else text curves; ``history``:
    the run's flows (:func:`history_markdown`); ``fields``: which figures of the lines it shows (the
    run's algorithm's)."""
    if not rows:
        return f"# Run `{run_id}`\n\nno step finished yet (0 of {max_steps}).\n"
    last = rows[-1]
    step = int(last["step"])
    name, ev = fields.curve_label, fields.eval_label
    rewards = [r.get(fields.curve) for r in rows]
    known = [(r, int(row["step"])) for r, row in zip(rewards, rows) if r is not None]
    best_reward = (max if fields.higher_is_better else min)(known) if known else None
    times = [float(r["step_s"]) for r in rows[-20:] if r.get("step_s") is not None]
    per_step = statistics.median(times) if times else None
    eta = per_step * (max_steps - step) if per_step is not None else None
    lines = [
        f"# Run `{run_id}`: step {step} of {max_steps}",
        "",
        "| | |",
        "|---|---|",
        f"| {name} (latest) | {_fmt(last.get(fields.curve))} |",
        f"| {name} (best) | {_fmt(best_reward[0]) + f' at step {best_reward[1]}' if best_reward else 'n/a'} |",
        f"| loss (latest) | {_fmt(last.get('loss'), '.4f')} |",
        f"| time per step | {_fmt(per_step, '.2f')} s (median of the last {len(times)}) |",
        f"| ETA | {_duration(eta)} |",
    ]
    evals = [(r.get(fields.eval_metric), int(r["step"])) for r in rows if r.get(fields.eval_metric) is not None]
    if evals:
        best_eval = (max if fields.higher_is_better else min)(evals)
        lines.append(f"| {ev} (latest, best) | {_fmt(evals[-1][0])}, {_fmt(best_eval[0])} at step {best_eval[1]} |")
    if checkpoints:
        lines.append(f"| last checkpoint | step {checkpoints[-1][0]}: `{checkpoints[-1][1]}` |")
        scored = {int(r["step"]): r.get(metric_name) for r in rows if r.get(metric_name) is not None}
        ranked = [(scored[s], s, uri) for s, uri in checkpoints if s in scored]
        if ranked:
            v, s, uri = (max if higher_is_better else min)(ranked)
            lines.append(f"| best checkpoint ({metric_name}) | step {s} ({_fmt(v)}): `{uri}` |")
    for label, url in (links or {}).items():  # tracker runs: a link, or where the files are
        lines.append(f"| {label} | {f'[{url}]({url})' if url.startswith(('http://', 'https://')) else f'`{url}`'} |")
    if not plot:  # text curves (Prefect's UI draws these blocks poorly: the plot replaces them there)
        lines += ["", f"{name}, steps {rows[0]['step']}..{step}: `{sparkline(rewards)}`"]
        if evals:
            lines.append(f"{ev} at {len(evals)} evaluation(s): `{sparkline([e[0] for e in evals])}`")
    else:
        from flows.observe.plot import plot_data_uri

        index = {int(r["step"]): i for i, r in enumerate(rows)}
        uri = plot_data_uri(rewards, [(index[s], v) for v, s in evals], first_step=int(rows[0]["step"]), label=name, eval_label=ev)
        lines += ["", f"![{name} per step, its moving average and {ev}, steps {rows[0]['step']}..{step}]({uri})"]
    lines += history_markdown(history)
    return "\n".join(lines) + "\n"
