"""``nrl``: the command line of nrl-flows (a :mod:`cyclopts` app: ``nrl --help``, ``nrl grpo --help``).

::

    nrl grpo --config configs/grpo_tiny.yaml [key=value ...] [--storage URI] [--run-id ID]
    nrl dpo --config configs/dpo_tiny.yaml [key=value ...] [--storage URI] [--run-id ID]
    nrl sft --config configs/sft_tiny.yaml [key=value ...] [--storage URI] [--run-id ID]
    nrl rm --config configs/rm_tiny.yaml [key=value ...] [--storage URI] [--run-id ID]     (a reward model)
    nrl distill --config configs/distillation_tiny.yaml [key=value ...] [--storage URI] [--run-id ID]
    nrl ppo --config configs/ppo_tiny.yaml [key=value ...] [--storage URI] [--run-id ID]   (a value model, GAE)
    nrl train --config FILE [key=value ...]       (the config's algorithm: its `algorithm` key or section)
    nrl pipeline --config configs/pipeline_tiny.yaml [--storage URI] [--run-id ID]   (sft -> dpo -> grpo -> eval)
    nrl resume RUN_ID [--storage URI] [--recompute STAGE@STEP ...] [--take-over] [--fresh-optimizer] [key=value ...]
    nrl eval RUN_ID|PREFIX [--storage URI] [--dataset PATH] [--num-samples K] [--max-prompts N]
    nrl runs [--storage URI]
    nrl check CONFIG [key=value ...] [--resolved]   (load, resolve and validate; print the kind and hash)

One start command per registered algorithm (:mod:`flows.algorithms.registry`), each the same
code with the algorithm's recipe. ``key=value`` overrides may come before, between or after the options. Defaults: storage
``./runs``; no ``PREFECT_API_URL`` -> Prefect's ephemeral API; no Ray address
(``cluster.ray.address`` or ``RAY_ADDRESS``) -> a local Ray. The command line, the config and
the storage URI are validated before anything starts (with :func:`flows.run.preflight.preflight`:
reward plug-in, prompt files, a local Ray's size; and the run's lease: one writer per run): a bad
one prints one clear error and exits with status 2 without starting Ray or a flow run, or writing
anything. ``nrl runs`` and ``nrl eval`` create nothing: their storage root must exist.

A run that does not finish exits non-zero with the error and the resume hint printed
(:func:`flows.cli_run.run_flow`): 1, or 130 on SIGINT and 143 on SIGTERM.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Annotated, Any

from cyclopts import App, Parameter
from cyclopts.exceptions import CycloptsError, UnusedCliTokensError

from flows.algorithms.evaluate import eval_sweep
from flows.algorithms.registry import RECIPES, recipe_of
from flows.algorithms.step import flow_label
from flows.cli_run import EXIT_FAILED, run_flow, run_pipeline_flow
from flows.config import ConfigError, MasterConfig, config_hash, config_to_yaml, load_config, read_config_data
from flows.config.overrides import check_overrides_apply
from flows.pipeline import apply_pipeline_overrides, load_pipeline, pipeline_exists, plan_stages, read_pipeline
from flows.pipeline import pipeline as pipeline_flow
from flows.run.lease import resume_refusal
from flows.run.preflight import preflight
from flows.run.process import describe_status
from flows.run.recipe import Recipe
from flows.run.resolve import check_run_kind, new_run_id, resolve_config
from flows.run.start import plan_start
from flows.run.state import check_storage_root, list_runs, read_status, saved_config_data
from nrl_tasks.run_layout import RunLayout, validate_run_id
from storage import fs

__all__ = ["app", "main"]

EXIT_USAGE = 2
_OVERRIDE_COMMANDS = (*RECIPES, "train", "resume", "check")

app = App(
    name="nrl",
    help="Post-training (SFT, DPO, GRPO, ...) as resumable Prefect flows on Ray actors",
    version_flags=(),
    result_action="return_value",
    suppress_keyboard_interrupt=False,
)
#: ``key=value`` positionals: as many as given, anywhere among the options
Overrides = Annotated[str, Parameter(name="KEY=VALUE")]
#: a flag with no ``--no-`` form
Flag = Annotated[bool, Parameter(negative="", show_default=False)]


def _quiet_env() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # the ephemeral API server may need more than Prefect's default 20 s on a busy 2-core machine
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _error(msg: str) -> int:
    print(f"nrl: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _blank(**options: str | None) -> str | None:
    """The error for the first of ``options`` given as an empty (or blank) string, else ``None``."""
    for name, value in options.items():
        if value is not None and not value.strip():
            return f"--{name.replace('_', '-')} is empty"
    return None


def _start_command(recipe: Recipe) -> Any:
    """``nrl <kind>``: start a run of ``recipe`` (one command per registered algorithm)."""

    def start(*overrides: Overrides, config: str, storage: str | None = None, run_id: str | None = None) -> int:
        return _start(recipe, config, list(overrides), storage, run_id)

    name = recipe.kind.upper()
    start.__doc__ = f"""Start {'an' if name[0] in 'AEFHILMNORSX' else 'a'} {name} run (a config with its `{recipe.section}` settings, e.g. configs/{recipe.section}_tiny.yaml).

        Args:
            overrides: dotted config overrides (e.g. {recipe.section}.max_num_steps=20)
            config: YAML config
            storage: storage root: local path, file:// or s3:// (default: config's, ./runs)
            run_id: run id (default: {recipe.kind}-YYYYmmdd-HHMMSS-xxxxxx)
        """
    return start


for _i, _recipe in enumerate(RECIPES.values()):
    app.command(_start_command(_recipe), name=_recipe.kind, sort_key=_i)


@app.command(sort_key=len(RECIPES))
def train(*overrides: Overrides, config: str, storage: str | None = None, run_id: str | None = None) -> int:
    """Start a run of the config's algorithm: its `algorithm` key (a registered kind, or module:attribute
    of a recipe) or the algorithm whose section it has.

    Args:
        overrides: dotted config overrides
        config: YAML config
        storage: storage root: local path, file:// or s3:// (default: config's, ./runs)
        run_id: run id
    """
    try:
        recipe = recipe_of(read_config_data(config, list(overrides)))
    except ValueError as exc:
        return _error(str(exc))
    return _start(recipe, config, list(overrides), storage, run_id)


def _start(recipe: Recipe, config: str, overrides: list[str], storage: str | None, run_id: str | None) -> int:
    """``nrl <kind>``: a new run, refused (exit 2) before anything starts when its config,
    storage root or run id is bad or the run exists already."""
    if (blank := _blank(storage=storage, run_id=run_id)) is not None:
        return _error(blank)
    try:
        run_id = validate_run_id(run_id) if run_id is not None else new_run_id(flow_label(recipe.kind))
        cfg = resolve_config(config, overrides, storage, recipe=recipe)  # a config or override of another kind: refused
        problems = recipe.check_config(cfg)
        if problems:
            raise ConfigError("; ".join(problems))
        layout = RunLayout(cfg.storage.root, run_id)
        if fs.exists(layout.config_uri, storage_options=cfg.storage.storage_options or None):
            raise ConfigError(f"run {run_id!r} already exists under {cfg.storage.root!r}: use `nrl resume {run_id}`")
        preflight(cfg, check_data=recipe.check_data)  # the run's data, plug-ins, model, Ray size
    except ValueError as exc:
        return _error(str(exc))
    print(f"nrl: {recipe.kind} run {run_id} -> {layout.run_uri}", flush=True)
    return run_flow(lambda: recipe.run(config=config, run_id=run_id, overrides=overrides, storage=cfg.storage.root), layout)


@app.command(sort_key=len(RECIPES) + 1)
def pipeline(*, config: str, storage: str = "./runs", run_id: str | None = None) -> int:
    """Run a post-training pipeline: its stages (e.g. sft, dpo, grpo, eval) in one Prefect flow run, each
    stage's run from the previous stage's final checkpoint; resume with `nrl resume RUN_ID`.

    Args:
        config: the pipeline file (e.g. configs/pipeline_tiny.yaml)
        storage: storage root for the pipeline and its stage runs (<run-id>-<stage>)
        run_id: the pipeline's id (default: pipeline-YYYYmmdd-HHMMSS-xxxxxx)
    """
    if (blank := _blank(storage=storage, run_id=run_id)) is not None:
        return _error(blank)
    try:
        run_id = validate_run_id(run_id) if run_id is not None else new_run_id("pipeline")
        root = check_storage_root(storage, create=True)
        if pipeline_exists(root, run_id) or fs.exists(RunLayout(root, run_id).config_uri):
            raise ConfigError(f"{run_id!r} already exists under {root!r}: use `nrl resume {run_id}`")
        plans = plan_stages(load_pipeline(config), root, run_id)  # every stage's config and data, one error
        preflight(plans[0]["cfg"])  # the first stage's model, plug-ins, Ray size (later stages start from its checkpoints)
    except ValueError as exc:
        return _error(str(exc))
    print(f"nrl: pipeline {run_id}: {' -> '.join(p['stage'].name for p in plans)} under {root}", flush=True)
    return run_pipeline_flow(lambda: pipeline_flow(config=config, run_id=run_id, storage=root), RunLayout(root, run_id))


def _resume_pipeline(run_id: str, root: str, overrides: list[str]) -> int:
    """``nrl resume`` of a pipeline: its saved spec (with ``stages.<name>.…`` overrides), checked first."""
    try:
        spec = apply_pipeline_overrides(read_pipeline(root, run_id)["spec"], overrides)
        plan_stages(spec, root, run_id)
    except ValueError as exc:
        return _error(str(exc))
    print(f"nrl: resuming pipeline {run_id} at {RunLayout(root, run_id).run_uri}", flush=True)
    return run_pipeline_flow(lambda: pipeline_flow(run_id=run_id, resume=True, overrides=overrides, storage=root),
                             RunLayout(root, run_id))


@app.command(sort_key=len(RECIPES) + 2)
def resume(
    run_id: str,
    /,
    *overrides: Overrides,
    storage: str = "./runs",
    recompute: Annotated[list[str] | None, Parameter(negative="")] = None,
    take_over: Flag = False,
    fresh_optimizer: Flag = False,
) -> int:
    """Resume a run (of any algorithm) from its persisted batches.

    Args:
        run_id: the run to resume
        overrides: overrides (e.g. grpo.max_num_steps=20)
        storage: storage root holding the run
        recompute: STAGE@STEP (repeatable): recompute one stage of one step, e.g. generate@3: in a step
            not trained yet the stage and what depends on it in that step; in a trained step after the last
            checkpoint only that dataset, which must reproduce the step's recorded weights checksum (see
            flows/run/recompute.py)
        take_over: take the run's lease from a holder that looks live but is gone (its machine died) before
            the lease expires
        fresh_optimizer: train on from a checkpoint saved without optimizer state
            (checkpointing.save_optimizer=false) with a fresh optimizer; refused without it (the steps
            would differ from an uninterrupted run); recorded as optimizer_reset in status.json
    """
    if (blank := _blank(storage=storage)) is not None:
        return _error(blank)
    overrides_, recompute = list(overrides), list(recompute or [])
    try:
        run_id = validate_run_id(run_id)
        root = check_storage_root(storage, create=False)
    except ValueError as exc:
        return _error(str(exc))
    if pipeline_exists(root, run_id):  # a pipeline: its stages resume (finished ones are skipped)
        return _resume_pipeline(run_id, root, overrides_)
    try:
        recipe = recipe_of(saved_config_data(run_id, check_storage_root(storage, create=False)))  # the run's kind
        cfg = resolve_config(None, overrides_, storage, run_id=run_id, recipe=recipe)
        layout = RunLayout(cfg.storage.root, run_id)
        opts = cfg.storage.storage_options or None
        # the flow's own resume entry, as a dry run: refused items and damaged batches, the plan
        start = plan_start(cfg, layout, recipe=recipe, resume=True, recompute=recompute, fresh_optimizer=fresh_optimizer)
        preflight(cfg, layout, check_data=recipe.check_data)
    except ValueError as exc:
        return _error(str(exc))
    refused = None if take_over else resume_refusal(layout, opts)  # one writer per run: before anything starts
    if refused is not None:
        return _error(refused)
    state = describe_status(read_status(layout, opts) or {})
    print(f"nrl: resuming run {run_id} ({state}) at {layout.run_uri}", flush=True)
    print(f"nrl: plan: {start.describe()}", flush=True)
    return run_flow(lambda: recipe.run(config=None, run_id=run_id, resume=True, overrides=overrides_, storage=cfg.storage.root,
                                       take_over=take_over, recompute=recompute or None, fresh_optimizer=fresh_optimizer), layout)


@app.command(name="eval", sort_key=len(RECIPES) + 3)
def eval_(
    target: str, /, *, storage: str = "./runs", dataset: str | None = None, num_samples: int = 4, max_prompts: int | None = None
) -> int:
    """Evaluate every checkpoint of a run (or of every run under a prefix) not yet evaluated.

    Args:
        target: run id, or a storage prefix holding runs
        storage: storage root holding the run
        dataset: held-out prompts file (default: the run's validation split)
        num_samples: k of pass@k (0: greedy only)
        max_prompts: evaluate at most this many prompts (default: all)
    """
    if (blank := _blank(storage=storage)) is not None:
        return _error(blank)
    from flows.config.storage_root import check_storage_root

    try:
        if "/" in target or "://" in target:  # a prefix holding runs: it must exist and hold some
            from flows.run.state import list_runs

            prefix = check_storage_root(target, create=False)
            if not list_runs(prefix):
                raise ValueError(f"no runs under {target!r}")
        else:
            from flows.algorithms.evaluate import check_generates, load_run_config
            from nrl_tasks.run_layout import validate_run_id

            check_generates(load_run_config(validate_run_id(target), check_storage_root(storage, create=False)), target)
    except ValueError as exc:
        return _error(str(exc))

    try:
        res = eval_sweep(target, storage=storage, dataset=dataset, num_samples=num_samples, max_prompts=max_prompts)
    except Exception as exc:  # noqa: BLE001
        from nrl_tasks.stages.errors import describe_error

        print(f"nrl: eval failed: {describe_error(exc)}", file=sys.stderr)  # the root cause, through Ray's wrappers
        return EXIT_FAILED
    print(f"nrl: evaluated {len(res['evaluated'])} checkpoint(s), {len(res['skipped'])} already evaluated")
    for name in res.get("vanished", []):
        print(f"nrl: skipped {name}: the checkpoint vanished (deleted by retention?)")
    for name in res.get("busy", []):
        print(f"nrl: skipped {name}: being evaluated by another process")
    for row in res["rows"]:
        print(
            f"  {row['run_id']}/{row['checkpoint']} [{row['dataset']}]  accuracy {row['accuracy']}"
            f"  pass@{row['k']} {row['pass_at_k']}"
        )
    return 0


@app.command(sort_key=len(RECIPES) + 4)
def runs(*, storage: str = "./runs") -> int:
    """List runs under a storage root with their last step and status.

    Args:
        storage: storage root
    """
    if (blank := _blank(storage=storage)) is not None:
        return _error(blank)
    from flows.config.storage_root import check_storage_root

    try:
        root = check_storage_root(storage, create=False)
    except ValueError as exc:
        return _error(str(exc))
    found = list_runs(root)
    if not found:
        print(f"no runs under {root}")
        return 0
    print(f"{'run_id':40} {'step':>9}  {'updated':19}  status")
    for r in found:
        upd = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["updated_unix"])) if r.get("updated_unix") else "-"
        steps = f"{r['last_step']}/{r['max_steps'] or '?'}"
        print(f"{r['run_id']:40} {steps:>9}  {upd:19}  {r['state']}")
    for r in found:
        if r.get("lease_error"):
            print(f"nrl: {r['lease_error']}")
    return 0


@app.command(sort_key=len(RECIPES) + 5)
def check(config: str, *overrides: Overrides, resolved: Flag = False) -> int:
    """Load a config (NeMo-RL's `defaults:` chains and `${...}` interpolations too), apply the overrides,
    resolve and validate it as `nrl train` would, without starting or writing anything: prints its
    algorithm, the resolved config's hash and what became of its keys (honoured, mapped, ignored:
    docs/nemo_rl_keys.md) (exit 0), or every problem (exit 2).

    Args:
        config: YAML config
        overrides: dotted config overrides
        resolved: also print the resolved config (as a run saves it)
    """
    overrides = list(overrides)
    try:
        recipe = recipe_of(read_config_data(config, overrides))
        check_overrides_apply(overrides, recipe.kind, recipe.unread_sections)
        cfg = load_config(config, overrides)
        check_run_kind(cfg, recipe.kind, config)
        if problems := recipe.check_config(cfg):
            raise ConfigError("; ".join(problems))
        preflight(cfg, check_data=recipe.check_data)  # the data, plug-ins, model, Ray size
    except ValueError as exc:
        return _error(str(exc))
    print(f"{config}: a valid {recipe.kind.upper()} config, hash {config_hash(cfg)}")
    from flows.config.compose import resolve_interpolations
    from flows.config.nemo_rl import fate_lines

    for line in fate_lines(resolve_interpolations(read_config_data(config, overrides), config)):
        print(line)
    if resolved:
        print(config_to_yaml(cfg), end="")
    return 0


def _config_sections() -> str:
    """The config model's sections, for the help of the commands that take ``key=value`` overrides."""

    return "Config sections (key=value overrides; flows/config/__init__.py): " + ", ".join(MasterConfig.model_fields) + "."


def main(argv: Sequence[str] | None = None) -> int:
    """``nrl ARGV``: the command's exit status (2 for a usage error, printed as ``nrl: error: ...``)."""
    _quiet_env()
    tokens = list(sys.argv[1:] if argv is None else argv)
    if not tokens:
        return _error(f"a command is required: {', '.join(RECIPES)}, train, pipeline, resume, eval, runs or check "
                      "(see `nrl --help`)")
    if tokens and tokens[0] in _OVERRIDE_COMMANDS and {"-h", "--help"} & set(tokens):
        app[tokens[0]].help_epilogue = _config_sections()  # imported only for this help
    else:
        from nrl_tasks.settings import settings_problems

        if problems := settings_problems():  # NRL_* variables: before anything starts, naming each
            return _error("; ".join(problems))
    try:
        rc = app(tokens, exit_on_error=False, print_error=False)
    except CycloptsError as exc:
        if isinstance(exc, UnusedCliTokensError) and exc.unused_tokens:
            return _error(f"unrecognized arguments: {' '.join(exc.unused_tokens)}")
        return _error(str(exc).strip())
    return 0 if rc is None else rc


if __name__ == "__main__":
    sys.exit(main())
