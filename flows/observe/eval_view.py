"""The eval view: one markdown artifact per sweep target comparing a run's evaluated checkpoints.

Pure functions (rows in, markdown out), so the view is testable without Prefect or storage. Per
training run: a link to its latest flow run in the Prefect UI's current (V2) pages
(``<PREFECT_UI_URL>/v2/runs/flow-run/<id>``) and to its earlier ones (a resume, an extension: the
run's history, :mod:`flows.run.history`); without a UI URL the flow-run id and the run's storage URI; then per dataset: the best checkpoint
by accuracy (ties: the earlier step) and a table of the newest :data:`TABLE_ROWS` checkpoints in step
order, the best one starred (none when every accuracy is 0), each with its files' location (a link
for http(s); a local path or ``s3://`` as text to copy: the Prefect UI drops ``file://`` links).
Flow runs are named as in the Runs list (``r1``, ``r1-extend-3``), a Prefect retry of the same
flow run listed once with what each attempt did. At the top, one plot (:func:`flows.observe.plot.line_plot_png`, axes, ticks,
legend, 0-1 scale) of accuracy per checkpoint step for the newest :data:`PLOT_SERIES` run/dataset
pairs shown (one run with one dataset: its accuracy and pass@k).

Its size is bounded (:data:`MAX_RUNS` runs, :data:`MAX_DATASETS` datasets a run, :data:`TABLE_ROWS`
rows a table) and it holds nothing that changes between two sweeps that evaluated nothing new (no
timestamps, no durations), so :func:`view_digest` tells whether a sweep has anything new to show:
the flow publishes a new artifact version only when the digest differs from the latest version's
(:func:`flows.observe.artifacts.publish_eval_view`). :func:`target_label` names a sweep target (in its
flow-run name and artifact key).

>>> rows = [{"run_id": "r", "checkpoint": f"step_00000{s}", "dataset": "val", "accuracy": a} for s, a in ((2, 0.5), (4, 0.5))]
>>> md = eval_view_markdown("r", rows)
>>> "best: step_000002 (accuracy 0.500)" in md and "| ★ | step_000002 |" in md
True
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from flows.config.storage_root import normalize_root
from flows.observe.flow_run_meta import flow_run_name
from flows.observe.plot import GREEN, PALETTE, Series, line_plot_png, png_data_uri
from nrl_tasks.run_layout import parse_step_dir

__all__ = [
    "MAX_DATASETS", "MAX_RUNS", "TABLE_ROWS", "best_row", "eval_view_markdown", "flow_run_url", "is_prefix",
    "target_label", "ui_page_url", "uri_link", "view_digest",
]

#: checkpoints a table shows at most (the newest by step)
TABLE_ROWS = 50
#: runs the view shows at most (the last ones given: ``list_runs`` orders them oldest first)
MAX_RUNS = 20
#: datasets shown a run at most
MAX_DATASETS = 8
#: earlier flow runs of a run linked at most (the newest)
EARLIER_FLOW_RUNS = 5
#: curves in the view's plot at most (the newest run/dataset pairs shown)
PLOT_SERIES = 6


def is_prefix(target: str) -> bool:
    """Whether a sweep target is a storage prefix (holding runs) rather than a run id."""
    return "/" in target or "://" in target


def target_label(target: str) -> str:
    """What a sweep evaluates, in its flow-run name and artifact key: the run id, or the basename of
    the storage prefix (``"runs"`` if it has none); only ``[A-Za-z0-9._-]``.

    >>> target_label("s3://bucket/team/runs/"), target_label("grpo-tiny_1")
    ('runs', 'grpo-tiny_1')
    """
    base = normalize_root(target).rstrip("/").rsplit("/", 1)[-1] if is_prefix(target) else target
    return re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-.") or "runs"


def ui_page_url(ui_url: str, path: str) -> str:
    """The page ``path`` of Prefect's current UI at ``ui_url`` (``PREFECT_UI_URL``). Prefect 3.9
    serves it (V2, the default) under ``/v2``; the same path without it opens the old one.

    >>> ui_page_url("http://127.0.0.1:4200/", "runs")
    'http://127.0.0.1:4200/v2/runs'
    >>> ui_page_url("http://127.0.0.1:4200/v2", "runs")
    'http://127.0.0.1:4200/v2/runs'
    """
    base = ui_url.rstrip("/")
    return f"{base if base.endswith('/v2') else base + '/v2'}/{path}"


def flow_run_url(ui_url: str | None, flow_run_id: str | None) -> str | None:
    """The Prefect UI page of a flow run (:func:`ui_page_url`), ``None`` without a UI URL or id.

    >>> flow_run_url("http://127.0.0.1:4200/", "abc")
    'http://127.0.0.1:4200/v2/runs/flow-run/abc'
    """
    if not ui_url or not flow_run_id:
        return None
    return ui_page_url(ui_url, f"runs/flow-run/{flow_run_id}")


def _code(text: Any) -> str:
    return "`" + str(text).replace("`", "'").replace("|", "\\|").replace("\n", " ") + "`"


def uri_link(uri: str | None) -> str:
    """A markdown link to an ``http(s)://`` ``uri``, else the URI as code to copy: the Prefect UI
    drops ``file://`` links (an underlined path that opens nothing), and ``s3://`` opens nowhere.

    >>> uri_link("/runs/r/checkpoints/step_000002"), uri_link("https://h/x")
    ('`/runs/r/checkpoints/step_000002`', '[https://h/x](https://h/x)')
    >>> uri_link("s3://b/runs/r/checkpoints/step_000002")
    '`s3://b/runs/r/checkpoints/step_000002`'
    """
    if not uri:
        return ""
    if not uri.startswith(("http://", "https://")) or any(c in uri for c in " ()<>|\n"):
        return _code(uri)
    return f"[{uri.replace('[', '(').replace(']', ')')}]({uri})"


def _num(v: Any, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def _step(row: Mapping[str, Any]) -> int:
    step = row.get("step")
    return int(step) if step is not None else parse_step_dir(str(row.get("checkpoint") or "")) or 0


def best_row(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The row with the highest accuracy, the earlier step on a tie; ``None`` if none has one
    above 0 (nothing to prefer: a star on a tie at 0 would single out a checkpoint for nothing)."""
    scored = [r for r in rows if r.get("accuracy") is not None and float(r["accuracy"]) > 0]
    return min(scored, key=lambda r: (-float(r["accuracy"]), _step(r))) if scored else None


def _flow_runs(run_id: str, info: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """``(flow run id, its name, what it did)`` per flow run of the run's history, oldest first; a
    flow run retried by Prefect (the same id) once, e.g. ``("…", "r1", "1 start, 2 retry")``."""
    by_id: dict[str, list[Mapping[str, Any]]] = {}
    for e in info.get("flow_runs") or []:
        if e.get("flow_run_id"):
            by_id.setdefault(str(e["flow_run_id"]), []).append(e)
    fr = info.get("flow_run_id")
    if fr and str(fr) not in by_id:
        by_id[str(fr)] = []
    out = []
    for fid, entries in by_id.items():
        first = entries[0] if entries else {}
        name = flow_run_name(run_id, str(first.get("kind", "start")), int(first.get("attempt", 1)))
        out.append((fid, name, ", ".join(f"{e.get('attempt', '?')} {e.get('kind', '')}" for e in entries)))
    return out


def _run_header(run_id: str, info: Mapping[str, Any]) -> str:
    fr = str(info.get("flow_run_id") or "")
    ui = info.get("ui_url")
    runs = _flow_runs(run_id, info)

    def label(fid: str, name: str, what: str) -> str:
        url = flow_run_url(ui, fid)
        text = f"{name} ({what})" if what else name
        return f"[{text}]({url})" if url else f"{text} {_code(fid)}"

    current = [r for r in runs if r[0] == fr]
    parts = [f"training run: {label(*current[0])}" if current else "training run: no flow-run id recorded"]
    earlier = [r for r in runs if r[0] != fr][-EARLIER_FLOW_RUNS:]
    if earlier:
        parts.append("earlier flow runs: " + ", ".join(label(*r) for r in earlier))
    if info.get("run_uri"):
        parts.append(f"storage {uri_link(info['run_uri'])}")
    return f"## Run {_code(run_id)}\n\n" + " · ".join(parts)


def _dataset_section(dataset: str, rows: list[Mapping[str, Any]], table_rows: int) -> list[str]:
    rows = sorted(rows, key=_step)
    best = best_row(rows)
    ks = sorted({r.get("k") for r in rows if r.get("k") is not None})
    pass_name = f"pass@{ks[0]}" if len(ks) == 1 else "pass@k"
    first, last = rows[0]["checkpoint"], rows[-1]["checkpoint"]
    out = [f"### Dataset {_code(dataset)}: {len(rows)} checkpoint(s)", ""]
    if best is not None:
        out.append(f"best: {best['checkpoint']} (accuracy {_num(best['accuracy'])})")
    else:
        scored = any(r.get("accuracy") is not None for r in rows)
        out.append("best: none (accuracy 0 at every checkpoint)" if scored else "best: n/a (no accuracy)")
    span = f"{first}..{last}" if len(rows) > 1 else first
    known = [r for r in rows if r.get("accuracy") is not None]
    if known:
        last_pass = rows[-1].get("pass_at_k")
        tail = f" ({pass_name} last {_num(last_pass)})" if last_pass is not None else ""
        out += ["", f"accuracy {span}: first {_num(known[0]['accuracy'])}, last {_num(known[-1]['accuracy'])}{tail}"]
    out += [""]
    shown = rows[-table_rows:]
    if len(shown) < len(rows):
        out += [f"the newest {len(shown)} of {len(rows)} checkpoints:", ""]
    out += [
        "| | checkpoint | accuracy | pass@k | k | sample reward | prompts | checkpoint files |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in shown:
        mark = "★" if r is best else ""
        out.append(
            f"| {mark} | {r['checkpoint']} | {_num(r.get('accuracy'))} | {_num(r.get('pass_at_k'))} | {_num(r.get('k'))} "
            f"| {_num(r.get('sample_reward_mean'))} | {_num(r.get('num_prompts'))} | {uri_link(r.get('checkpoint_uri'))} |"
        )
    return out + [""]


def _plot_section(by_run: Mapping[str, Mapping[str, list[Mapping[str, Any]]]], run_ids: Sequence[str]) -> list[str]:
    """The view's plot (see the module docstring) as markdown lines; none when nothing has an accuracy."""

    pairs = [(r, d) for r in run_ids for d in sorted(by_run[r], key=lambda d: (d != "val", d))[:MAX_DATASETS]][-PLOT_SERIES:]
    series = []
    for i, (run_id, ds) in enumerate(pairs):
        rows = sorted(by_run[run_id][ds], key=_step)
        label = "accuracy" if len(pairs) == 1 else f"{run_id}" + (f" / {ds}" if ds != "val" else "")
        series.append(Series(label, [(_step(r), r.get("accuracy")) for r in rows], PALETTE[i % len(PALETTE)], dots=True))
        if len(pairs) == 1 and any(r.get("pass_at_k") is not None for r in rows):
            series.append(Series("pass@k", [(_step(r), r.get("pass_at_k")) for r in rows], GREEN, dots=True))
    if not any(y is not None for s in series for _, y in s.points):
        return []
    png = line_plot_png(series, x_label="checkpoint step", y_label="accuracy")
    return [f"![accuracy per checkpoint step ({len(pairs)} run/dataset curve(s))]({png_data_uri(png)})", ""]


def eval_view_markdown(
    label: str,
    rows: Sequence[Mapping[str, Any]],
    runs: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    table_rows: int = TABLE_ROWS,
    max_runs: int = MAX_RUNS,
) -> str:
    """The eval view of sweep target ``label``.

    ``rows``: one per committed evaluation (``run_id``, ``checkpoint``, ``dataset``, ``accuracy``,
    ``pass_at_k``, ``k``, ``sample_reward_mean``, ``num_prompts``, optional ``step`` and
    ``checkpoint_uri``), as :func:`flows.algorithms.evaluate._eval_rows` reads them. ``runs``: per run id,
    ``flow_run_id`` (from ``status.json``), ``run_uri`` and ``ui_url`` (``PREFECT_UI_URL``, or
    ``None``). Runs appear in the order of their first row.
    """
    runs = runs or {}
    by_run: dict[str, dict[str, list[Mapping[str, Any]]]] = {}
    for r in rows:
        by_run.setdefault(str(r["run_id"]), {}).setdefault(str(r.get("dataset") or "val"), []).append(r)
    n_evals = sum(len(v) for ds in by_run.values() for v in ds.values())
    out = [f"# Checkpoint evaluations: {_code(label)}", "", f"{len(by_run)} run(s), {n_evals} evaluation(s)."]
    run_ids = list(by_run)
    if len(run_ids) > max_runs:
        out.append(f"The last {max_runs} runs are shown ({len(run_ids) - max_runs} older not shown).")
        run_ids = run_ids[-max_runs:]
    out.append("")
    out += _plot_section(by_run, run_ids)
    for run_id in run_ids:
        out += [_run_header(run_id, runs.get(run_id) or {}), ""]
        datasets = by_run[run_id]
        names = sorted(datasets, key=lambda d: (d != "val", d))
        if len(names) > MAX_DATASETS:
            out += [f"{len(names) - MAX_DATASETS} more dataset(s) not shown.", ""]
        for ds in names[:MAX_DATASETS]:
            out += _dataset_section(ds, datasets[ds], table_rows)
    return "\n".join(out).rstrip("\n") + "\n"


def view_digest(markdown: str) -> str:
    """Content digest of a view (16 hex digits of its SHA-256)."""
    return hashlib.sha256(markdown.encode("utf-8")).hexdigest()[:16]
