"""The post-training pipeline as one resumable Prefect flow: ``sft → dpo → grpo → eval``.

``nrl pipeline --config configs/pipeline_tiny.yaml --storage S --run-id P`` (or the ``post-train``
deployment) runs the stages of a pipeline file (:mod:`nrl_tasks.config.pipeline`) in order, in
one flow run ``P`` whose subflows are the stage runs::

    model = the first stage's own policy.model_name
    for stage in stages:
        run (its recipe's flow) P-<stage> from `model`    # a run of its own: lease, status, summary, resume
        gate: stop here (state "Gated", exit 3) when the stage's figure misses it
        model = its final checkpoint's weights            # recorded in P/pipeline.json, by reference
    eval stage: nrl eval of the last run's final checkpoint

A stage whose recipe's product is a reward model (``nrl rm``) starts from ``model`` too (e.g. the
SFT stage's weights) but does not replace it: its final weights become the reward model of the
later stages that score with one (GRPO: ``env.reward_model.enabled=true``,
``env.reward_model.model_name=<its weights>``), and an eval stage evaluates the last *policy*
stage.

**Checked before anything starts**: every stage's config (its file, overrides and the model it
will start from), its algorithm's own checks and data, all problems in one error naming the stage.
The resolved stage configs are frozen in ``S/P/pipeline.json`` with the pipeline's state, so
editing a config file later changes nothing of a started pipeline.

**Resume** (``nrl resume P``, or the UI's Retry of the flow run): finished stages are skipped (their
runs completed with every step trained), the interrupted one resumes where it stopped (its run's
own resume: bit-identical), the rest start. A stage whose config changed since its run started is
refused, naming the keys. ``nrl resume P stages.<name>.gate.min=0.2`` changes a gate and
``stages.<name>.config.<key>=value`` (e.g. ``stages.dpo.config.dpo.max_num_steps=12``) a stage's
budget; a pipeline stopped at a gate goes on from there.

One writer per pipeline: the flow holds the pipeline's lease (``S/P/lease``) from start to end;
each stage run holds its own. The pipeline's summary artifact (``nrl-<P>-summary``) lists the
stages with their status, starting model, final checkpoint, gate and a link to each stage's own
summary, and shows each stage's curve.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed

from flows.algorithms.evaluate import evaluate_checkpoint
from flows.algorithms.registry import recipe_for
from flows.config import ConfigError, MasterConfig, config_hash, load_config_dict, read_config_data
from flows.config.overrides import apply_overrides
from flows.observe.artifacts import KeyedArtifact
from flows.observe.flow_run_meta import add_flow_run_tags, flow_tag, run_tag
from flows.observe.metrics import read_metrics
from flows.observe.pipeline_summary import pipeline_markdown
from flows.run.lease import hold_run_lease
from flows.run.preflight import check_plugins
from flows.run.recipe import Recipe
from flows.run.resolve import new_run_id, resolve_config
from flows.run.state import check_storage_root, read_status, trained_prefix
from nrl_tasks.config.hash import changed_keys
from nrl_tasks.config.master import config_kind
from nrl_tasks.config.pipeline import PipelineConfig, PipelineStageConfig
from nrl_tasks.run_layout import RunLayout, checkpoint_name, join_uri, validate_run_id
from nrl_tasks.stages.checkpoint import is_checkpoint_committed
from storage import fs

__all__ = ["EXIT_GATED", "PIPELINE_FILE", "load_pipeline", "pipeline", "pipeline_exists", "plan_stages"]

#: the pipeline's own state file under ``<storage>/<pipeline_id>/``
PIPELINE_FILE = "pipeline.json"
#: ``nrl pipeline`` / ``nrl resume`` exit status of a pipeline stopped at a gate
EXIT_GATED = 3


def pipeline_uri(root: str, pipeline_id: str) -> str:
    return join_uri(RunLayout(root, pipeline_id).run_uri, PIPELINE_FILE)


def pipeline_exists(root: str, pipeline_id: str) -> bool:
    """Whether ``<root>/<pipeline_id>`` holds a pipeline (not a run)."""
    return fs.exists(pipeline_uri(root, pipeline_id))


def read_pipeline(root: str, pipeline_id: str) -> dict[str, Any]:
    return json.loads(fs.read_text(pipeline_uri(root, pipeline_id)))


def _write(root: str, pipeline_id: str, state: Mapping[str, Any]) -> None:
    fs.write_text_atomic(pipeline_uri(root, pipeline_id), json.dumps(state, indent=1, sort_keys=False))


# ----------------------------------------------------------------------------------------------
# the pipeline file and its stages


def load_pipeline(path: str) -> dict[str, Any]:
    """A pipeline file's spec with every run stage's config read in (``config_data``: its file
    and overrides applied, not validated yet), so that a started pipeline never reads the files
    again. ``ConfigError`` naming the file and stage."""
    data = load_config_dict(path)
    try:
        spec = PipelineConfig.model_validate(data)
    except ValueError as exc:
        raise ConfigError(f"pipeline {path!r}: {exc}") from None
    base = os.path.dirname(os.path.abspath(path))
    stages = []
    for s in spec.stages:
        entry = s.model_dump(mode="json")
        if s.config is not None:
            cfg_path = s.config if os.path.isabs(s.config) else os.path.join(base, s.config)
            try:
                entry["config_data"] = read_config_data(cfg_path, s.overrides)
            except ConfigError as exc:
                raise ConfigError(f"pipeline {path!r} stage {s.name!r}: {exc}") from None
        stages.append(entry)
    return {"source": os.path.abspath(path), "stages": stages}


def apply_pipeline_overrides(spec: Mapping[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``spec`` with ``stages.<name>.gate.<key>=v`` / ``stages.<name>.config.<key>=v`` overrides applied."""
    by_name = {s["name"]: {"gate": s.get("gate"), "config": s.get("config_data")} for s in spec["stages"]}
    bad = [o for o in overrides if not o.startswith("stages.") or o.split(".")[1] not in by_name
           or o.split(".")[2].partition("=")[0] not in ("gate", "config")]
    if bad:
        raise ConfigError(f"pipeline overrides {bad}: expected stages.<name>.gate.<key>=value or "
                          f"stages.<name>.config.<key>=value with <name> one of {sorted(by_name)}")
    try:
        changed = apply_overrides({"stages": by_name}, overrides)["stages"]
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    out = dict(spec)
    out["stages"] = [{**s, "gate": changed[s["name"]]["gate"], **({"config_data": changed[s["name"]]["config"]}
                                                                   if s.get("config_data") is not None else {})}
                     for s in spec["stages"]]
    return out


def _stage_model(stage: Mapping[str, Any]) -> PipelineStageConfig:
    return PipelineStageConfig.model_validate({k: v for k, v in stage.items() if k != "config_data"})


def final_weights(root: str, run_id: str, budget: int) -> str:
    """The ``weights`` folder of run ``run_id``'s checkpoint at its last step."""
    return join_uri(RunLayout(root, run_id).checkpoint_uri(budget), "weights")


def plan_stages(spec: Mapping[str, Any], root: str, pipeline_id: str) -> list[dict[str, Any]]:
    """Every stage resolved and checked before anything starts: ``[{"stage", "recipe", "cfg",
    "run_id", "start_model"}]`` (``recipe``/``cfg`` ``None`` for an eval stage); one
    ``ConfigError`` listing every problem, each naming its stage."""
    problems: list[str] = []
    plans: list[dict[str, Any]] = []
    model: str | None = None  # the previous policy stage's final weights
    scorer: str | None = None  # the previous reward-model stage's final weights
    last_run: dict[str, Any] | None = None  # the previous policy stage
    for stage in spec["stages"]:
        s = _stage_model(stage)
        if s.eval is not None:
            if last_run is not None and not last_run["cfg"].checkpointing.enabled:
                problems.append(f"stage {s.name!r} evaluates the final checkpoint of {last_run['stage'].name!r}, whose "
                                "checkpointing.enabled is false")
            plans.append({"stage": s, "recipe": None, "cfg": None, "run_id": last_run["run_id"] if last_run else None,
                          "start_model": model})
            continue
        data = dict(stage["config_data"])
        run_id = f"{pipeline_id}-{s.name}"
        try:
            recipe = recipe_for(config_kind(data))
            chained = [f"policy.model_name={model}"] if model is not None else []  # the previous policy stage's weights
            if scorer is not None and recipe.actors.reward_model:  # scored by the previous reward-model stage
                chained += ["env.reward_model.enabled=true", f"env.reward_model.model_name={scorer}"]
            cfg = resolve_config(apply_overrides(data, chained), [], root, recipe=recipe)
            found = recipe.check_config(cfg)
            if recipe.stop_rule(cfg) is not None:
                found.append(f"{recipe.stop_rule(cfg).key}: a pipeline stage runs its whole budget (the next stage "
                             "starts from its final checkpoint); stop between stages with the stage's `gate` instead")
            if found:
                raise ConfigError("; ".join(found))
            check_plugins(cfg)
            recipe.check_data(cfg, None)
        except ValueError as exc:
            problems.append(f"stage {s.name!r}: {exc}")
            model = None
            continue
        if last_run is not None and not last_run["cfg"].checkpointing.enabled:
            problems.append(f"stage {s.name!r} starts from the final checkpoint of {last_run['stage'].name!r}, whose "
                            "checkpointing.enabled is false")
        plan = {"stage": s, "recipe": recipe, "cfg": cfg, "run_id": run_id, "start_model": cfg.policy.model_name}
        plans.append(plan)
        if recipe.product == "reward_model":
            if not cfg.checkpointing.enabled:
                problems.append(f"stage {s.name!r} trains a reward model for the later stages, but its "
                                "checkpointing.enabled is false")
            scorer = final_weights(root, run_id, recipe.budget(cfg))
        else:
            last_run = plan
            model = final_weights(root, run_id, recipe.budget(cfg))
    if problems:
        raise ConfigError(f"pipeline {spec.get('source', pipeline_id)!r}: {len(problems)} problem(s):\n"
                          + "\n".join(f"  - {p}" for p in problems))
    return plans


# ----------------------------------------------------------------------------------------------
# running it


def _finished(root: str, run_id: str, recipe: Recipe, cfg: MasterConfig) -> bool:
    """Whether stage run ``run_id`` completed every step with its final checkpoint."""
    layout = RunLayout(root, run_id)
    budget = recipe.budget(cfg)
    status = read_status(layout) or {}
    return (status.get("status") == "completed" and trained_prefix(layout, budget) >= budget
            and is_checkpoint_committed(layout.checkpoint_uri(budget)))


def _check_unchanged(root: str, run_id: str, recipe: Recipe, cfg: MasterConfig) -> None:
    """``ConfigError`` when stage run ``run_id`` was started with other result-affecting settings
    than the pipeline's stage config now has (its length may grow: an extension)."""
    saved = resolve_config(None, [f"{recipe.section}.max_num_steps={recipe.budget(cfg)}"], root, run_id=run_id, recipe=recipe)
    if config_hash(saved) != config_hash(cfg):
        keys = changed_keys(saved, cfg)
        raise ConfigError(f"stage run {run_id!r} was started with another config ({', '.join(keys[:12])} differ): a "
                          "started stage keeps its config; change only its max_num_steps, or start a new pipeline")


def _gate_value(root: str, run_id: str, metric: str) -> float | None:
    """The last recorded ``metric`` of run ``run_id``'s metrics lines."""
    for row in reversed(read_metrics(RunLayout(root, run_id).metrics_uri)):
        if isinstance(row.get(metric), (int, float)):
            return float(row[metric])
    return None


def _run_stage(plan: Mapping[str, Any], root: str, log: Any) -> dict[str, Any]:
    """Run (or resume, or skip when finished) one run stage; its state entry."""
    recipe, cfg, run_id, s = plan["recipe"], plan["cfg"], plan["run_id"], plan["stage"]
    layout = RunLayout(root, run_id)
    budget = recipe.budget(cfg)
    exists = fs.exists(layout.config_uri)
    if exists:
        _check_unchanged(root, run_id, recipe, cfg)
    if exists and _finished(root, run_id, recipe, cfg):
        log.info("pipeline stage %s: run %s finished already (%d steps): not run again", s.name, run_id, budget)
        outcome = "skipped (finished)"
    else:
        log.info("pipeline stage %s: %s run %s from %s", s.name, "resuming" if exists else "starting", run_id,
                 plan["start_model"])
        recipe.run(config=None if exists else cfg.model_dump(mode="json"), run_id=run_id, resume=exists,
                   overrides=[f"{recipe.section}.max_num_steps={budget}"] if exists else [], storage=root)
        outcome = "resumed" if exists else "ran"
    return {"kind": recipe.kind, "run_id": run_id, "status": "completed", "outcome": outcome,
            "start_model": plan["start_model"], "final_checkpoint": layout.checkpoint_uri(budget), "steps": budget}


def _eval_stage(plan: Mapping[str, Any], root: str, previous: Mapping[str, Any]) -> dict[str, Any]:
    """Evaluate the previous run stage's final checkpoint (``nrl eval``; committed: not again)."""
    ev = plan["stage"].eval
    res = evaluate_checkpoint(run_id=previous["run_id"], checkpoint=checkpoint_name(previous["steps"]), dataset=ev.dataset,
                              storage=root, num_samples=ev.num_samples, max_prompts=ev.max_prompts)
    return {"kind": "eval", "run_id": previous["run_id"], "status": "completed", "checkpoint": previous["final_checkpoint"],
            "figures": {k[len("eval_"):]: v for k, v in res.items() if k.startswith("eval_") and isinstance(v, (int, float))}}


def _pipeline_run_name() -> str:
    params = flow_run.parameters or {}
    pid = params.get("run_id") or "pipeline"
    return f"{pid}-resume" if params.get("resume") else str(pid)


@flow(name="pipeline", flow_run_name=_pipeline_run_name, validate_parameters=False, persist_result=False)
def pipeline(
    config: str | None = None,
    run_id: str | None = None,
    resume: bool = False,
    overrides: list[str] | None = None,
    storage: str | None = None,
) -> Any:
    """Run a post-training pipeline (see the module docstring); returns ``{"pipeline_id",
    "status", "stages", "message"}`` (``status``: ``completed`` or ``gated``: a gate stopped it,
    the flow run's state then named ``Gated``).

    Args:
        config: the pipeline file (e.g. configs/pipeline_tiny.yaml); ignored on resume (the
            pipeline keeps the spec it started with).
        run_id: the pipeline's id (default: a new one); its stage runs are <run_id>-<stage>.
        resume: continue the pipeline (finished stages are skipped).
        overrides: stages.<name>.gate.<key>=value, stages.<name>.config.<key>=value.
        storage: storage root holding the pipeline and its runs.
    """
    log = get_run_logger()
    root = check_storage_root(storage or "./runs", create=not resume)
    pid = validate_run_id(run_id) if run_id else new_run_id("pipeline")
    add_flow_run_tags(str(flow_run.id) if flow_run.id else None, [run_tag(pid), flow_tag(pid)])
    existing = pipeline_exists(root, pid)
    previous = read_pipeline(root, pid) if existing else None
    retry = bool(previous and flow_run.id and previous.get("flow_run_id") == str(flow_run.id))
    if existing and not (resume or retry):
        raise ConfigError(f"pipeline {pid!r} already exists under {root!r}: use `nrl resume {pid}`")
    if resume and not existing:
        raise ConfigError(f"no pipeline {pid!r} under {root!r}")
    spec = apply_pipeline_overrides(previous["spec"] if previous else load_pipeline(str(config)), list(overrides or []))
    plans = plan_stages(spec, root, pid)  # every stage checked before anything starts
    lease = hold_run_lease(RunLayout(root, pid), None, str(flow_run.id) if flow_run.id else None)
    state: dict[str, Any] = {"pipeline_id": pid, "flow_run_id": str(flow_run.id) if flow_run.id else None,
                             "status": "running", "spec": spec, "stages": dict((previous or {}).get("stages") or {}),
                             "updated_unix": time.time(), "message": None}
    summary = KeyedArtifact(pid, "summary", f"summary of pipeline {pid}")
    try:
        _write(root, pid, state)
        last: dict[str, Any] | None = None
        for plan in plans:
            s = plan["stage"]
            entry = _eval_stage(plan, root, last) if s.eval is not None else _run_stage(plan, root, log)
            if s.gate is not None:
                value = entry["figures"].get(s.gate.metric) if s.eval is not None else _gate_value(root, entry["run_id"], s.gate.metric)
                entry["gate"] = {"rule": s.gate.describe(), "value": value, "held": s.gate.holds(value)}
            state["stages"][s.name] = entry
            state["updated_unix"] = time.time()
            _write(root, pid, state)
            summary.publish(pipeline_markdown(pid, plans, state, root))
            if entry.get("gate") and not entry["gate"]["held"]:
                nxt = plans[plans.index(plan) + 1]["stage"].name if plan is not plans[-1] else None
                state["status"], state["message"] = "gated", (
                    f"pipeline {pid} stopped after stage {s.name}: its gate {s.gate.describe()} did not hold "
                    f"(value {entry['gate']['value']})" + (f"; stage {nxt} was not started" if nxt else ""))
                break
            if s.eval is None and plan["recipe"].product == "policy":  # what an eval stage evaluates
                last = entry
        else:
            state["status"], state["message"] = "completed", f"pipeline {pid}: {len(plans)} stage(s) done"
        state["updated_unix"] = time.time()
        _write(root, pid, state)
        summary.publish(pipeline_markdown(pid, plans, state, root))
    except BaseException as exc:
        state["status"], state["message"] = "failed", f"{type(exc).__name__}: {exc}"[:2000]
        try:
            _write(root, pid, state)
        except Exception:  # noqa: BLE001 - the stage's own error is the one to raise
            pass
        raise
    finally:
        lease.release()
    log.info("%s", state["message"])
    result = {k: state[k] for k in ("pipeline_id", "status", "stages", "message")}
    if state["status"] == "gated":
        return Completed(name="Gated", message=state["message"], data=result)
    return result
