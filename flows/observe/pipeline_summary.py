"""The post-training pipeline's summary artifact (``nrl-<pipeline_id>-summary``, :mod:`flows.pipeline`).

One table row per stage (its algorithm, run, status, its gate and whether it held, a link to the
stage run's own summary in the Prefect UI), the model each stage started from and its final
checkpoint (below the table: paths are long, the table must fit the UI's column), then each run
stage's curve (its algorithm's summary fields: GRPO's reward, DPO's pair
accuracy, SFT's loss, with the held-out figure as dots). Updated in place after every stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefect.settings import get_current_settings

from flows.observe.artifacts import artifact_key
from flows.observe.eval_view import ui_page_url
from flows.observe.metrics import read_metrics
from flows.observe.plot import plot_data_uri
from nrl_tasks.run_layout import RunLayout

__all__ = ["pipeline_markdown"]


def _cell(value: Any) -> str:
    return "-" if value in (None, "") else str(value).replace("|", "/")


def _below(path: Any, root: str) -> Any:
    """``path`` relative to the storage ``root`` (named once above the table), so the table fits the UI."""
    prefix = root.rstrip("/") + "/"
    return path[len(prefix):] if isinstance(path, str) and path.startswith(prefix) else path


def _gate(entry: Mapping[str, Any] | None) -> str:
    gate = (entry or {}).get("gate")
    if not gate:
        return "-"
    value = gate.get("value")
    shown = "never recorded" if value is None else f"{value:.4g}"
    return f"{gate['rule']}: {shown} ({'held' if gate['held'] else 'NOT held'})"


def pipeline_markdown(pipeline_id: str, plans: Sequence[Mapping[str, Any]], state: Mapping[str, Any], root: str) -> str:
    """The pipeline's summary (see the module docstring) from its stage plans and state."""
    stages = state.get("stages") or {}
    done = sum(1 for p in plans if p["stage"].name in stages)
    status = state.get("status") or "running"
    ui = get_current_settings().ui_url
    lines = [f"# Pipeline `{pipeline_id}`: {done} of {len(plans)} stage(s) done ({status})", ""]
    if state.get("message"):
        lines += [f"**{state['message']}**", ""]
    lines += ["| # | stage | run | status | gate | summary |", "|---:|---|---|---|---|---|"]
    models = []
    for i, p in enumerate(plans, 1):
        s = p["stage"]
        entry = stages.get(s.name)
        kind = "eval" if s.eval is not None else p["recipe"].kind
        run_id = (entry or {}).get("run_id") or p.get("run_id")
        shown_status = (entry or {}).get("outcome") or (entry or {}).get("status") or "pending"
        link = "-"
        if s.eval is None and run_id and ui:
            key = artifact_key(run_id, "summary")
            link = f"[summary]({ui_page_url(ui, 'artifacts/key/' + key)})"
        figures = (entry or {}).get("figures")
        if figures:
            shown_status += " " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(figures.items()) if k in ("accuracy", "pass_at_k"))
        lines.append(f"| {i} | {s.name} ({kind}) | `{_cell(run_id)}` | {_cell(shown_status)} | {_gate(entry)} | {link} |")
        start = _below(p.get("start_model"), root) if s.eval is None else None
        final = _below((entry or {}).get("final_checkpoint") or (entry or {}).get("checkpoint"), root)
        models.append(f"{i}. {s.name}: evaluated `{_cell(final)}`" if s.eval is not None
                      else f"{i}. {s.name}: from `{_cell(start)}`, final checkpoint `{_cell(final)}`")
    lines += ["", f"Models (paths below the storage root `{root}`):", "", *models]
    for p in plans:
        s = p["stage"]
        if s.eval is not None or s.name not in stages:
            continue
        rows = read_metrics(RunLayout(root, p["run_id"]).metrics_uri)
        if not rows:
            continue
        fields = p["recipe"].summary
        curve = [r.get(fields.curve) for r in rows]
        evals = [(i, r[fields.eval_metric]) for i, r in enumerate(rows) if isinstance(r.get(fields.eval_metric), (int, float))]
        uri = plot_data_uri(curve, evals, first_step=int(rows[0]["step"]), label=fields.curve_label, eval_label=fields.eval_label)
        lines += ["", f"### {s.name} ({p['recipe'].kind}): {fields.curve_label} per step", "",
                  f"![{s.name}: {fields.curve_label} per step and {fields.eval_label}]({uri})"]
    return "\n".join(lines) + "\n"
