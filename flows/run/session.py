"""One run session: what every run does around its algorithm, written once.

Every algorithm's run enters the same session, with its recipe (:mod:`flows.run.recipe`)::

    with run_session(cfg, run_id, recipe=DPO, intent=RunIntent(resume=resume)) as session:
        records = DPO.prepare(...)                  # the algorithm's own data, nothing written to the run yet
        with session.running(max_steps=N):          # status "running" ... "completed"
            rt = session.start_runtime()
            run = session.context(records)
            ...                                      # the steps, fenced by session.fence()

Entering the session (:func:`run_session`):

1. takes the run's lease (:mod:`flows.run.lease`) before anything is written: a second writer is
   refused at once, naming the holder;
2. applies ``configure(cfg)`` under the lease (GRPO's warm start, which may train);
3. creates the run (``config.yaml``) or checks the config hash of the one it continues
   (:func:`flows.run.state.init_run`);
4. checks and plans the start with the one resume entry (:func:`flows.run.start.plan_start`:
   ``--recompute`` items, damaged data a resume reads, the run's facts and anchor):
   ``session.start``.

:meth:`RunSession.running` then owns the run's life:

5. cleans up what a killed predecessor left: its task runs left Running are marked Crashed, its
   local Ray and its ephemeral Prefect API server are stopped (:mod:`flows.run.process`);
6. writes ``status.json`` ``running`` (this flow process, the algorithm, the step budget), and at the
   end ``completed``, ``interrupted`` (SIGINT, SIGTERM, even when Prefect re-raised them as another
   error) or ``failed`` with the error; a refusal before this point leaves the status untouched;
   a flow whose lease was taken over (``--take-over``) writes no status (nor commits anything:
   every commit checks the lease first, :attr:`~nrl_tasks.stages.context.RunContext.fence`), and
   the new holder's ``completed`` clears ``error``; a start with a fresh optimizer
   (``--fresh-optimizer``) adds ``optimizer_reset`` (the checkpoint and the first step trained with
   it), which later flows keep;
7. applies the config's storage retry policy (``storage.retry``) to everything inside;
8. on success kills the run's actors; a local Ray this flow started is stopped however the run
   ends. ``NRL_KEEP_ACTORS=1`` keeps both.

Evaluation reads runs without writing them: it enters :func:`reading_session` (the retry policy
and the local Ray's end, no lease, no status).

Exit codes (130 for SIGINT, 143 for SIGTERM) are the CLI's (:mod:`flows.cli`), from the same
signals.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from prefect.exceptions import TerminationSignal

from flows.config import ConfigError, MasterConfig
from flows.observe.flow_run_meta import add_flow_run_tags, flow_tag, rename_flow_run, run_tag
from flows.run.crash_cleanup import mark_orphans_crashed
from flows.run.history import attempt_kind, begin_attempt, end_attempt, flow_run_name, refused_name
from flows.run.lease import check_fence, hold_run_lease
from flows.run.plugins import load_observers
from flows.run.process import (
    current_process,
    ephemeral_prefect_servers,
    flow_process_alive,
    reap_local_ray,
    reap_prefect_server,
    this_host,
)
from flows.run.recipe import Recipe
from flows.run.runtime import Runtime, build_run_context, ray_connected, setup_runtime, shutdown_local_ray
from flows.run.start import StartPlan, plan_start
from flows.run.state import check_new_run, init_run, read_status, write_status
from nrl_tasks.run_layout import RunLayout
from nrl_tasks.settings import nrl_settings
from nrl_tasks.stages.context import RunContext
from nrl_tasks.stages.errors import describe_error, exception_chain
from storage import fs, retry_policy
from storage.lease import LeaseHeldError, LeaseLostError, RunLease

__all__ = ["RunIntent", "RunSession", "own_local_ray", "reading_session", "run_session", "tag_this_flow_run"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunIntent:
    """What the user asked of a run.

    ``resume``: continue an existing run (``nrl resume``, ``resume=True``); ``take_over``: take a
    live-looking lease (its holder's machine died); ``restartable``: a new run whose id may exist
    already, which is then continued (the SFT warm start, started again by a resumed GRPO flow);
    ``fresh_optimizer``: train on from a checkpoint without optimizer state
    (:func:`flows.run.start.check_optimizer_state`)."""

    resume: bool = False
    take_over: bool = False
    restartable: bool = False
    fresh_optimizer: bool = False


def _flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return str(flow_run.id) if flow_run.id else None


def tag_this_flow_run(run_id: str) -> None:
    """Tag the flow run this runs in ``run:<run_id>`` and ``flow:<run_id>`` (the run's own flow runs,
    not its subflows). Every flow that enters a run session (GRPO, DPO, SFT) calls it first, before
    its config is read, so that every flow run of a run is found by its tag, refused ones too; the
    session itself tags nothing."""
    add_flow_run_tags(_flow_run_id(), [run_tag(run_id), flow_tag(run_id)])


@contextlib.contextmanager
def _named_if_refused(flow_run_id: str | None, run_id: str) -> Iterator[None]:
    """Rename the flow run ``<run_id>-refused-<6 hex>`` when the block refuses the run (another writer, an
    existing run id, a changed config): not to be mistaken for the run's own flow runs."""
    try:
        yield
    except (ConfigError, LeaseHeldError):
        rename_flow_run(flow_run_id, refused_name(run_id, flow_run_id))
        raise


@dataclass
class RunSession:
    """A run under its lease (see the module docstring); made by :func:`run_session`."""

    cfg: MasterConfig
    layout: RunLayout
    recipe: Recipe
    flow_run_id: str | None
    lease: RunLease
    config_hash: str
    previous: dict[str, Any]  # status.json as the previous flow of the run left it ({} for a new run)
    start: StartPlan  # what the start does (flows.run.start)
    log: Any
    intent: RunIntent = RunIntent()
    runtime: Runtime | None = None
    end_fields: dict[str, Any] = field(default_factory=dict)
    #: the run's history with this flow's entry (:mod:`flows.run.history`), set by :meth:`running`
    history: list[dict[str, Any]] = field(default_factory=list)
    #: called with the closed history once ``status.json`` says ``completed`` (the final summary)
    on_completed: list[Callable[[list[dict[str, Any]]], None]] = field(default_factory=list)

    @property
    def run_id(self) -> str:
        return self.layout.run_id

    @property
    def algorithm(self) -> str:
        """The run's kind (its recipe's)."""
        return self.recipe.kind

    @property
    def storage_options(self) -> dict[str, Any] | None:
        return self.cfg.storage.storage_options or None

    @property
    def resume(self) -> bool:
        """The run existed and is continued."""
        return self.start.resume

    @property
    def resuming(self) -> bool:
        """Whether this flow continues a run an earlier flow wrote (also a ``prefect flow-run
        retry``, which passes no ``resume``)."""
        return self.resume or bool(self.previous.get("status"))

    def fence(self) -> None:
        """Raise ``storage.lease.LeaseLostError`` once the lease was taken over (call between steps)."""
        check_fence(self.lease)

    def _fenced(self, exc: BaseException) -> bool:
        """Whether ``exc`` ended the run because its lease was taken over (or the lease is lost now)."""
        if any(isinstance(e, LeaseLostError) for e in exception_chain(exc)):
            return True
        try:
            self.fence()
        except LeaseLostError:
            return True
        except Exception:  # noqa: BLE001 - storage down: the status write below tries (and reports) too
            return False
        return False

    def start_runtime(self, records: dict[str, list[dict[str, str]]] | None = None, tokenizer: Any = None) -> Runtime:
        """Connect Ray and attach to or create the actors the run's recipe uses
        (:func:`flows.run.runtime.setup_runtime`; ``records``: the data snapshots the recipe took,
        ``tokenizer``: the one it took them with);
        the session directory of a local Ray it starts goes into ``status.json``."""

        def record_ray(rt: Runtime) -> None:
            if rt.ray_session_dir:
                self.fence()  # a fenced writer writes no status
                write_status(self.layout, self.storage_options, local_ray={"host": this_host(), "session_dir": rt.ray_session_dir})

        self.runtime = setup_runtime(self.cfg, self.run_id, actors=self.recipe.actors, records=records,
                                     tokenizer=tokenizer, on_connect=record_ray,
                                     reference_weights=self.recipe.reference_weights(self.cfg))
        return self.runtime

    def context(self) -> RunContext:
        """The run's context on the started runtime, with the observer plug-ins (``NRL_PLUGINS``)."""
        rt = self.runtime
        if rt is None:
            raise RuntimeError("start_runtime() comes before context()")
        run = build_run_context(self.cfg, self.run_id, rt, rt.tokenizer, load_observers(), records=rt.records,
                                graph=self.recipe.graph)
        run.fence = self.fence  # every commit checks the lease first
        return run

    def finish(self, **status_fields: Any) -> None:
        """Fields to record with ``completed`` (e.g. where the weights were restored from)."""
        self.end_fields.update(status_fields)

    @contextlib.contextmanager
    def running(self, *, max_steps: int) -> Iterator["RunSession"]:
        """The run's life from ``running`` to its end state (steps 5-8 of the module docstring)."""
        layout, opts, log = self.layout, self.storage_options, self.log
        # task runs a killed flow left Running (a live one taken over ends its own: it is fenced)
        alive = flow_process_alive(self.previous.get("flow_process"))
        orphaned = alive is not True
        plan, facts, reset = self.start.plan, self.start.facts, self.start.optimizer_reset
        if self.previous.get("status") not in (None, "completed") and orphaned:
            mark_orphans_crashed(self.previous.get("flow_run_id"), self.flow_run_id, log, account=_resume_account(plan, facts))
        reaped = reap_local_ray(self.previous)
        if reaped:
            log.warning("stopped %d leftover process(es) of the previous flow's local Ray: %s", len(reaped), ", ".join(reaped))
        reaped = reap_prefect_server(self.previous)
        if reaped:
            log.warning("stopped the previous flow's ephemeral Prefect API server: %s", ", ".join(reaped))
        kind = attempt_kind(self.previous, self.flow_run_id, max_steps=max_steps)
        # the previous flow's entry, left open: its process is gone (crashed) or it was taken over
        was = "crashed" if alive is False else "taken over" if self.intent.take_over else None
        gone = self.lease.taken_from  # the lease holder this flow took over: its last heartbeat
        self.history = begin_attempt(
            self.previous, kind=kind, flow_run_id=self.flow_run_id, max_steps=max_steps, previous_outcome=was,
            previous_last_seen=gone.heartbeat_at if gone is not None and not gone.released else None,
            trained=facts.last_trained if facts is not None else None,
            restore_from=plan.restore_from if plan is not None else None, replay=plan.replay if plan is not None else (),
        )
        write_status(
            layout, opts, status="running", algorithm=self.algorithm, flow_run_id=self.flow_run_id, max_steps=max_steps,
            config_hash=self.config_hash, error=None, flow_process=current_process(), local_ray=None,
            prefect_server=ephemeral_prefect_servers(), history=self.history,
        )
        rename_flow_run(self.flow_run_id, flow_run_name(self.run_id, kind, self.history[-1]["attempt"]))
        if reset is not None and facts is not None:  # --fresh-optimizer: kept in the run's record
            write_status(layout, opts, optimizer_reset={
                "checkpoint_step": reset, "first_step": facts.last_trained + 1, "unix": time.time()})
        try:
            with own_local_ray(self.run_id), retry_policy(self.cfg.storage.retry.policy()):
                yield self
                self.fence()  # taken over at the last moment: the new holder's status stays
                self.history = end_attempt(self.history, "completed")
                write_status(layout, opts, status="completed", error=None, history=self.history,
                             **{"last_step": max_steps, **self.end_fields})  # an early stop's last_step wins
                for hook in self.on_completed:
                    try:
                        hook(self.history)
                    except Exception as exc:  # noqa: BLE001 - the run is complete; its last summary is cosmetic
                        log.warning("could not publish the run's final summary: %s", exc)
                if self.runtime is not None and not nrl_settings().keep_actors:
                    self.runtime.shutdown()  # kill the actors, remove the placement groups
        except BaseException as exc:
            # SIGINT, SIGTERM (possibly re-raised by Prefect as another error): resumable, not a failure
            stopped = any(isinstance(e, (KeyboardInterrupt, TerminationSignal)) for e in exception_chain(exc))
            if self._fenced(exc):  # another process took the run over: its status.json, not ours
                log.error("run %s was taken over by another process: this one stops and writes nothing more", self.run_id)
                raise
            try:  # best effort: on a full disk or a lost bucket the status cannot be written either
                outcome, error = "interrupted" if stopped else "failed", describe_error(exc)[:2000]
                write_status(layout, opts, status=outcome, error=error, history=end_attempt(self.history, outcome, error))
            except Exception as status_exc:  # noqa: BLE001 - the run's own error is the one to raise
                log.warning("could not record the run's end in status.json: %s", status_exc)
            raise
        finally:  # an environment's actors are this flow process's own, kept actors or not
            if self.runtime is not None:
                self.runtime.stop_environment()


def _resume_account(plan: Any, facts: Any) -> str:
    """What the flow taking over a killed one does: ``"steps 1-14 were committed; resumed by flow
    run <id>: checkpoint 10 restored, steps 11-14 replayed"`` (parts known)."""
    parts = []
    if facts is not None and facts.last_trained:
        parts.append(f"steps 1-{facts.last_trained} were committed")
    todo = []
    if plan is not None and plan.restore_from is not None:
        todo.append(f"checkpoint {plan.restore_from} restored" if plan.restore_from else "the initial weights restored")
    if plan is not None and plan.replay:
        todo.append(f"steps {min(plan.replay)}-{max(plan.replay)} replayed" if len(plan.replay) > 1 else f"step {plan.replay[0]} replayed")
    return "; ".join(parts + ([f"the next flow run resumes it: {', '.join(todo)}"] if todo else ["the next flow run resumes it"]))


@contextlib.contextmanager
def own_local_ray(run_id: str | None = None) -> Iterator[None]:
    """A local Ray started inside (no Ray was connected on entry) is stopped when this ends,
    however it ends; ``NRL_KEEP_ACTORS=1`` keeps it."""
    own = not ray_connected()
    try:
        yield
    finally:
        if own and not nrl_settings().keep_actors:
            shutdown_local_ray(run_id)


@contextlib.contextmanager
def reading_session(cfg: MasterConfig) -> Iterator[None]:
    """What a flow that reads runs without writing them (evaluation: :mod:`flows.algorithms.evaluate`)
    shares with the run session: the config's storage retry policy over everything inside, and
    a local Ray it starts stopped at its end (:func:`own_local_ray`).

    It takes no lease and writes no status: evaluation runs beside the run's writer (a cron sweep
    while the run trains), each checkpoint claimed for the time of its evaluation
    (:mod:`nrl_tasks.stages.evaluate`)."""
    with own_local_ray(), retry_policy(cfg.storage.retry.policy()):
        yield


@contextlib.contextmanager
def run_session(
    cfg: MasterConfig,
    run_id: str,
    *,
    recipe: Recipe,
    intent: RunIntent = RunIntent(),
    configure: Callable[[MasterConfig], MasterConfig] | None = None,
    saved_form: Callable[[MasterConfig], MasterConfig] | None = None,
    recompute: list[str] | None = None,
    log: Any = None,
) -> Iterator[RunSession]:
    """Enter run ``run_id`` (steps 1-4 of the module docstring); the lease is released on exit.
    ``saved_form``: the config ``configure`` will return, known without its work: a new run is
    created with it before ``configure`` runs, so one killed there is listed and resumable."""
    layout = RunLayout(cfg.storage.root, run_id)
    opts = cfg.storage.storage_options or None
    fid = _flow_run_id()
    with _named_if_refused(fid, run_id):
        lease = hold_run_lease(layout, opts, fid, take_over=intent.take_over)  # refused at once while another writer lives
    try:
        with _named_if_refused(fid, run_id):
            previous = read_status(layout, opts) or {}
            existed = fs.exists(layout.config_uri, storage_options=opts)
            if existed and not (intent.resume or intent.restartable):
                check_new_run(layout, opts, fid)  # before configure (a warm start trains) does any work
            if configure is not None:
                if saved_form is not None and not existed and not intent.resume:
                    # the run exists (config, status) before its configure step trains: a warm start
                    # killed in its SFT is then `nrl runs`-listed and resumed like any run
                    init_run(layout, saved_form(cfg), resume=False, flow_run_id=fid)
                    write_status(layout, opts, status="running", algorithm=recipe.kind, flow_run_id=fid,
                                 flow_process=current_process(),
                                 history=begin_attempt({}, kind="start", flow_run_id=fid, max_steps=recipe.budget(cfg)))
                cfg = configure(cfg)
            # a new run whose id exists is refused, unless it is the same Prefect flow run retrying
            restartable = intent.restartable and fs.exists(layout.config_uri, storage_options=opts)
            chash = init_run(layout, cfg, resume=intent.resume or restartable, flow_run_id=fid)
            start = plan_start(cfg, layout, recipe=recipe, resume=existed, recompute=recompute,
                               fresh_optimizer=intent.fresh_optimizer)
        yield RunSession(
            cfg=cfg, layout=layout, recipe=recipe, flow_run_id=fid, lease=lease, config_hash=chash,
            previous=previous, start=start, log=log or logger, intent=intent,
        )
    finally:
        lease.release()
