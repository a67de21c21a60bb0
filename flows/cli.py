"""``nrl``: the command line of nrl-flows.

::

    nrl grpo --config configs/grpo_tiny.yaml [key=value ...] [--storage URI] [--run-id ID]
    nrl resume RUN_ID [--storage URI] [--recompute STAGE@STEP ...] [--take-over] [key=value ...]
    nrl eval RUN_ID|PREFIX [--storage URI] [--dataset PATH] [--num-samples K]
    nrl runs [--storage URI]

Defaults: storage ``./runs``; no ``PREFECT_API_URL`` -> Prefect's ephemeral API; no Ray
address (``cluster.ray.address`` or ``RAY_ADDRESS``) -> a local Ray. The config and the storage
URI are validated before anything starts (with :func:`flows.preflight.preflight`: reward
plug-in, prompt files, a local Ray's size; and the run's lease: one writer per run): a bad one
prints one clear error and exits with status 2 without starting Ray or a flow run, or writing
anything. ``nrl runs`` and ``nrl eval`` create nothing: their storage root must exist.

A run that does not finish exits non-zero with the error and the resume hint printed, whatever
ended it (an exception, or ``SystemExit`` / ``KeyboardInterrupt`` raised by user code): 1, or
130 on SIGINT and 143 on SIGTERM (both stop the flow cleanly: actors and local Ray stopped).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Sequence

__all__ = ["build_parser", "main"]

EXIT_USAGE = 2
EXIT_FAILED = 1
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


def _quiet_env() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # the ephemeral API server may need more than Prefect's default 20 s on a busy 2-core machine
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nrl", description="GRPO post-training as resumable Prefect flows on Ray actors")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("grpo", help="start a GRPO run")
    g.add_argument("--config", required=True, help="YAML config (e.g. configs/grpo_tiny.yaml)")
    g.add_argument("--storage", default=None, help="storage root: local path, file:// or s3:// (default: config's, ./runs)")
    g.add_argument("--run-id", default=None, help="run id (default: grpo-<date>-<time>-<hex>)")
    g.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")

    d = sub.add_parser("dpo", help="start a DPO run (a config with a `dpo` section, e.g. configs/dpo_tiny.yaml)")
    d.add_argument("--config", required=True, help="YAML config with a `dpo` section")
    d.add_argument("--storage", default=None, help="storage root: local path, file:// or s3:// (default: config's, ./runs)")
    d.add_argument("--run-id", default=None, help="run id (default: dpo-<date>-<time>-<hex>)")
    d.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")

    r = sub.add_parser("resume", help="resume a run (GRPO or DPO) from its persisted batches")
    r.add_argument("run_id")
    r.add_argument("--storage", default="./runs", help="storage root holding the run (default ./runs)")
    r.add_argument(
        "--recompute", action="append", default=[], metavar="STAGE@STEP",
        help="recompute one stage of one step, e.g. generate@3: in a step not trained yet the stage and what "
        "depends on it in that step; in a trained step after the last checkpoint only that dataset, which must "
        "reproduce the step's recorded weights checksum (see flows/recompute.py)",
    )
    r.add_argument(
        "--take-over", action="store_true",
        help="take the run's lease from a holder that looks live but is gone (its machine died) before the lease expires",
    )
    r.add_argument("overrides", nargs="*", metavar="key=value", help="overrides (e.g. grpo.max_num_steps=20)")

    e = sub.add_parser("eval", help="evaluate every checkpoint of a run (or of every run under a prefix) not yet evaluated")
    e.add_argument("target", help="run id, or a storage prefix holding runs")
    e.add_argument("--storage", default="./runs")
    e.add_argument("--dataset", default=None, help="held-out prompts file (default: the run's validation split)")
    e.add_argument("--num-samples", type=int, default=4, help="k of pass@k (0: greedy only)")
    e.add_argument("--max-prompts", type=int, default=None)

    ls = sub.add_parser("runs", help="list runs under a storage root with their last step and status")
    ls.add_argument("--storage", default="./runs")
    return p


def _error(msg: str) -> int:
    print(f"nrl: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _cmd_grpo(args: argparse.Namespace) -> int:
    from flows.config import ConfigError
    from flows.run_config import new_run_id, resolve_config
    from flows.run_layout import validate_run_id

    from flows.preflight import preflight

    try:
        run_id = validate_run_id(args.run_id) if args.run_id is not None else new_run_id()
        cfg = resolve_config(args.config, args.overrides, args.storage)
        from flows.run_layout import RunLayout
        from storage import fs

        layout = RunLayout(cfg.storage.root, run_id)
        if fs.exists(layout.config_uri, storage_options=cfg.storage.storage_options or None):
            raise ConfigError(f"run {run_id!r} already exists under {cfg.storage.root!r}: use `nrl resume {run_id}`")
        preflight(cfg)
    except ValueError as exc:
        return _error(str(exc))
    print(f"nrl: run {run_id} -> {layout.run_uri}", flush=True)
    from flows.grpo import grpo

    return _run_flow(lambda: grpo(config=args.config, run_id=run_id, overrides=args.overrides, storage=cfg.storage.root), layout)


def _cmd_dpo(args: argparse.Namespace) -> int:
    from flows.config import ConfigError
    from flows.run_config import new_run_id, resolve_config
    from flows.run_layout import RunLayout, validate_run_id
    from storage import fs

    try:
        run_id = validate_run_id(args.run_id) if args.run_id is not None else new_run_id("dpo")
        cfg = resolve_config(args.config, args.overrides, args.storage)
        if cfg.dpo is None:
            raise ConfigError(f"{args.config}: no `dpo` section (a GRPO config: use `nrl grpo`)")
        layout = RunLayout(cfg.storage.root, run_id)
        if fs.exists(layout.config_uri, storage_options=cfg.storage.storage_options or None):
            raise ConfigError(f"run {run_id!r} already exists under {cfg.storage.root!r}: use `nrl resume {run_id}`")
    except ValueError as exc:
        return _error(str(exc))
    print(f"nrl: dpo run {run_id} -> {layout.run_uri}", flush=True)
    from flows.dpo import dpo

    return _run_flow(lambda: dpo(config=args.config, run_id=run_id, overrides=args.overrides, storage=cfg.storage.root), layout)


def _cmd_resume(args: argparse.Namespace) -> int:
    from flows.run_config import resolve_config
    from flows.run_layout import RunLayout, validate_run_id
    from flows.recompute import check_recompute_config, check_resume_data, parse_recompute, plan_recompute
    from flows.run_state import check_config_hash

    from flows.preflight import preflight

    try:
        run_id = validate_run_id(args.run_id)
        cfg = resolve_config(None, args.overrides, args.storage, run_id=run_id)
        specs = parse_recompute(args.recompute)
        check_recompute_config(specs, cfg)
        layout = RunLayout(cfg.storage.root, run_id)
        check_config_hash(layout, cfg)
        opts = cfg.storage.storage_options or None
        if cfg.dpo is not None and specs:
            raise ValueError("--recompute is for GRPO runs; a DPO run recomputes what is not committed by itself")
        if cfg.dpo is None:
            # refused --recompute items and damaged batches: one clear error before anything starts
            check_resume_data(layout, opts, skip=plan_recompute(layout, specs, opts))
            preflight(cfg)
    except ValueError as exc:
        return _error(str(exc))
    from flows.run_lease import live_holder
    from flows.run_process import describe_status
    from flows.run_state import read_status

    holder = live_holder(layout, opts)
    if holder is not None and not args.take_over:  # one writer per run: refused before anything starts
        return _error(
            f"run {run_id} has a live writer ({holder.describe()}); wait for it to end, or, if that process is dead "
            f"on another machine, take over with `nrl resume {run_id} --take-over`"
        )
    state = describe_status(read_status(layout, opts) or {})
    print(f"nrl: resuming run {run_id} ({state}) at {layout.run_uri}", flush=True)
    if cfg.dpo is not None:
        from flows.dpo import dpo

        return _run_flow(
            lambda: dpo(config=None, run_id=run_id, resume=True, overrides=args.overrides, storage=cfg.storage.root,
                        take_over=args.take_over),
            layout,
        )
    from flows.grpo import grpo

    return _run_flow(
        lambda: grpo(
            config=None, run_id=run_id, resume=True, overrides=args.overrides, storage=cfg.storage.root,
            recompute=args.recompute or None, take_over=args.take_over,
        ),
        layout,
    )


class _StopSignals:
    """SIGINT and SIGTERM while a run's flow runs: each stops the flow like Ctrl-C (the flow
    unwinds: actors, local Ray), and which one came decides the exit status, whatever exception
    Prefect turns it into on the way out (a signal landing inside Prefect's task set-up comes out
    as another error chained to it). A second signal during that clean-up ends the process."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, _frame: object) -> None:
        from prefect.exceptions import TerminationSignal

        self.received = signum
        signal.signal(signum, signal.SIG_DFL)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise TerminationSignal(signum)

    def __enter__(self) -> "_StopSignals":
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may set handlers (the caller's then apply)
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _run_flow(call, layout) -> int:
    """Run the flow; exit status 0 only when it returned. Whatever ends it early (an exception,
    ``SystemExit`` or ``KeyboardInterrupt`` from user code such as a reward plug-in, SIGINT,
    SIGTERM) is printed with the resume hint: 130 (SIGINT), 143 (SIGTERM), else 1."""
    hint = f"nrl: resume with `nrl resume {layout.run_id} --storage {layout.root}`"
    t0 = time.perf_counter()
    with _StopSignals() as signals:
        try:
            result = call()
        except BaseException as exc:  # noqa: BLE001 - SystemExit from user code too; no Prefect traceback twice
            if signals.received == signal.SIGTERM:
                print(f"nrl: run {layout.run_id} stopped by SIGTERM", file=sys.stderr)
            elif signals.received == signal.SIGINT or isinstance(exc, KeyboardInterrupt):
                print(f"nrl: run {layout.run_id} interrupted", file=sys.stderr)
            else:
                print(f"nrl: run {layout.run_id} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            held = _lease_holder(exc)
            print(f"nrl: {held}" if held is not None else hint, file=sys.stderr)
            if signals.received == signal.SIGTERM:
                return EXIT_SIGTERM
            if signals.received == signal.SIGINT or isinstance(exc, KeyboardInterrupt):
                return EXIT_SIGINT
            return EXIT_FAILED
    print_summary(result, time.perf_counter() - t0)
    return 0


def _lease_holder(exc: BaseException) -> str | None:
    """The take-over advice when ``exc`` is (or wraps) a refused run lease, else ``None``."""
    from flows.run_lease import lease_refusal

    return lease_refusal(exc)


def print_summary(result: dict, seconds: float) -> None:
    fm = result.get("final_metrics") or {}
    print(f"nrl: run {result['run_id']} finished {result['last_step']} steps in {seconds:.0f} s", flush=True)
    if fm and "rewards_margin_mean" in fm:  # a DPO run
        print(f"nrl:   last step loss {fm.get('loss')}  accuracy {fm.get('accuracy')}  margin {fm.get('rewards_margin_mean')}")
    elif fm:
        print(f"nrl:   last step reward_mean {fm.get('reward_mean')}  loss {fm.get('loss')}")
    print(f"nrl:   metrics      {result['metrics_uri']}")
    print(f"nrl:   steps        {result['run_uri']}/steps/")
    for c in result.get("checkpoints", [])[-3:]:
        print(f"nrl:   checkpoint   {c}")
    print("nrl:   artifacts    Prefect UI (table/progress/markdown artifacts keyed "
          f"nrl-{result['run_id'].lower()}-*; `prefect artifact ls`)")


def _cmd_eval(args: argparse.Namespace) -> int:
    from flows.run_state import check_storage_root

    try:
        if "/" in args.target or "://" in args.target:  # a prefix holding runs: it must exist and hold some
            from flows.run_state import list_runs

            prefix = check_storage_root(args.target, create=False)
            if not list_runs(prefix):
                raise ValueError(f"no runs under {args.target!r}")
        else:
            from flows.evaluate import load_run_config
            from flows.run_layout import validate_run_id

            load_run_config(validate_run_id(args.target), check_storage_root(args.storage, create=False))
    except ValueError as exc:
        return _error(str(exc))
    from flows.evaluate import eval_sweep

    try:
        res = eval_sweep(
            args.target, storage=args.storage, dataset=args.dataset, num_samples=args.num_samples, max_prompts=args.max_prompts
        )
    except Exception as exc:  # noqa: BLE001
        print(f"nrl: eval failed: {type(exc).__name__}: {exc}", file=sys.stderr)
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


def _cmd_runs(args: argparse.Namespace) -> int:
    from flows.run_state import check_storage_root, list_runs

    try:
        root = check_storage_root(args.storage, create=False)
    except ValueError as exc:
        return _error(str(exc))
    runs = list_runs(root)
    if not runs:
        print(f"no runs under {root}")
        return 0
    print(f"{'run_id':40} {'step':>9}  {'updated':19}  status")
    for r in runs:
        upd = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["updated_unix"])) if r.get("updated_unix") else "-"
        steps = f"{r['last_step']}/{r['max_steps'] or '?'}"
        print(f"{r['run_id']:40} {steps:>9}  {upd:19}  {r['state']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    _quiet_env()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may come after options (`nrl resume RUN --storage X key=value`): argparse leaves them over
    bad = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    for name in ("storage", "run_id"):
        value = getattr(args, name, None)
        if value is not None and not value.strip():
            return _error(f"--{name.replace('_', '-')} is empty")
    handler = {"grpo": _cmd_grpo, "dpo": _cmd_dpo, "resume": _cmd_resume, "eval": _cmd_eval, "runs": _cmd_runs}[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
