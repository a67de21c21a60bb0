"""Prefect artifacts of a run: metrics table, progress, best/worst rollouts; the eval view of a sweep.

Artifact keys are derived from the run id (lowercase letters, digits and dashes only). A flow run
of a run keeps one artifact of each kind (:class:`RunArtifacts`): created at its first publication,
then updated in place (:class:`KeyedArtifact`), so the Artifacts tab shows a handful of cards
whatever the run's length and each later flow run of the run (a resume, an extension) adds one
version of each key: the summary every step, progress every step, the metrics table (the newest
:data:`~flows.observe.summary.TABLE_WINDOW` lines, newest first) and the best/worst rollouts at
checkpoint steps and the last step. ``metrics.jsonl`` keeps every line. The eval view of a sweep
target (:mod:`flows.observe.eval_view`) gets a new version only when its content changed
(:func:`publish_eval_view`). Artifacts are best effort: a failure to publish is logged, never
fatal to training.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import json
import logging
import re
from typing import Any, Callable, Mapping, Sequence

from flows.observe.eval_view import eval_view_markdown, ui_page_url, view_digest

__all__ = [
    "BackgroundPublisher",
    "KeyedArtifact",
    "ProgressHandle",
    "RunArtifacts",
    "SummaryHandle",
    "artifact_key",
    "publish_eval_table",
    "publish_eval_view",
    "publish_metrics_table",
    "publish_progress",
    "publish_rollouts",
    "publish_summary",
    "conversation_markdown",
    "rollouts_markdown",
]

logger = logging.getLogger(__name__)


class BackgroundPublisher:
    """Runs cosmetic API calls (artifacts, flow-run renames) off the training loop's critical path.

    One worker thread, calls in submission order, each in a copy of the context the publisher was
    made in (the run's flow run: Prefect links the artifacts to it, also when a step publishes from
    a subflow). :meth:`flush` waits for the backlog (called at the end of the flow). Failures are
    logged, never raised.
    """

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nrl-artifacts")
        self._pending: list[concurrent.futures.Future[Any]] = []
        self._context = contextvars.copy_context()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        ctx = self._context.copy()
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._pool.submit(ctx.run, self._safe, fn, *args, **kwargs))

    @staticmethod
    def _safe(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - cosmetic
            logger.warning("background publication %s failed: %s", getattr(fn, "__name__", fn), exc)
            return None

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait up to ``timeout_s`` for the backlog; what is still running stays pending."""
        concurrent.futures.wait(self._pending, timeout=timeout_s)
        self._pending = [f for f in self._pending if not f.done()]

    def close(self, timeout_s: float = 60.0) -> None:
        self.flush(timeout_s)
        self._pool.shutdown(wait=False)


def artifact_key(run_id: str, kind: str) -> str:
    """``"nrl-<run>-<kind>"`` with only ``[a-z0-9-]``.

    >>> artifact_key("Grpo_Tiny.1", "metrics")
    'nrl-grpo-tiny-1-metrics'
    """
    slug = re.sub(r"[^a-z0-9-]+", "-", f"nrl-{run_id}-{kind}".lower()).strip("-")
    return re.sub(r"-{2,}", "-", slug)


def _in_run_context() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def _round(v: Any) -> Any:
    return round(v, 5) if isinstance(v, float) else v


def metrics_table(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rows of a metrics table artifact (floats rounded to 5 digits)."""
    return [{k: _round(v) for k, v in r.items()} for r in rows]


def publish_metrics_table(run_id: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Table artifact with one row per line of ``rows`` (the flows pass the newest lines, newest
    first: :func:`flows.observe.summary.metrics_window`), as a new version of its key (a flow
    publishing repeatedly keeps a :class:`RunArtifacts` instead)."""
    if not _in_run_context():
        return
    from prefect.artifacts import create_table_artifact

    try:
        table = metrics_table(rows)
        create_table_artifact(table=table, key=artifact_key(run_id, "metrics"), description=f"GRPO metrics of run {run_id}")
    except Exception as exc:  # noqa: BLE001 - artifacts must not kill a run
        logger.warning("metrics artifact not published: %s", exc)


def publish_progress(handle: ProgressHandle, done: int, total: int) -> None:
    handle.update(done, total)


def _cell(text: Any, limit: int = 160) -> str:
    s = str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", "⏎")
    return s if len(s) <= limit else s[: limit - 1] + "…"


def rollouts_markdown(
    run_id: str,
    step: int,
    prompts: Sequence[str],
    responses: Sequence[str],
    answers: Sequence[str],
    rewards: Sequence[float],
    n: int = 4,
    conversations: Sequence[str] | None = None,
) -> str:
    """Markdown with the ``n`` best and ``n`` worst rollouts of a step by reward; with
    ``conversations`` (multi-turn episodes' ``message_log`` JSON) also the best and the worst
    episode turn by turn (assistant turns, tool calls, the environment's observations).

    >>> md = rollouts_markdown("r", 1, ["p1", "p2"], ["a", "b"], ["x", "y"], [1.0, 0.0], n=1)
    >>> "Best" in md and "Worst" in md and "| 1.000 |" in md
    True
    """
    order = sorted(range(len(rewards)), key=lambda i: (-rewards[i], i))
    best, worst = order[:n], list(reversed(order))[:n]
    mean = sum(rewards) / max(len(rewards), 1)

    def table(idx: list[int]) -> str:
        lines = ["| reward | prompt | response | answer |", "|---:|---|---|---|"]
        lines += [f"| {rewards[i]:.3f} | {_cell(prompts[i])} | {_cell(responses[i])} | {_cell(answers[i], 40)} |" for i in idx]
        return "\n".join(lines)

    md = (
        f"# Rollouts of run `{run_id}`, step {step}\n\n"
        f"{len(rewards)} rollouts, mean reward {mean:.3f}.\n\n"
        f"## Best {len(best)}\n\n{table(best)}\n\n## Worst {len(worst)}\n\n{table(worst)}\n"
    )
    if conversations is not None and order:
        for title, i in (("Best", order[0]), ("Worst", order[-1])):
            md += f"\n## {title} episode (reward {rewards[i]:.3f})\n\n{conversation_markdown(conversations[i])}\n"
    return md


def conversation_markdown(message_log: str, limit: int = 600) -> str:
    """A ``message_log`` (JSON list of ``{"role", "content"}``) as a numbered list, one message a line.

    >>> print(conversation_markdown('[{"role": "user", "content": "2*3?"}, {"role": "tool", "content": "6"}]'))
    1. **user**: 2*3?
    2. **tool**: 6
    """
    try:
        log = json.loads(message_log)
    except (TypeError, ValueError):
        return f"(not a message log: {_cell(message_log, 80)})"
    return "\n".join(f"{k}. **{_cell(m.get('role', '?'), 20)}**: {_cell(m.get('content', ''), limit)}" for k, m in enumerate(log, 1))


def publish_rollouts(run_id: str, markdown: str) -> None:
    if not _in_run_context():
        return
    from prefect.artifacts import create_markdown_artifact

    try:
        create_markdown_artifact(markdown=markdown, key=artifact_key(run_id, "rollouts"), description="best/worst rollouts")
    except Exception as exc:  # noqa: BLE001
        logger.warning("rollouts artifact not published: %s", exc)


class KeyedArtifact:
    """One keyed artifact ``nrl-<run>-<kind>`` of a flow run: created at the first publication,
    then updated in place (``PATCH /artifacts/{id}``; the key's latest version follows), so the
    flow run has one card of it in the Artifacts tab however often it publishes, also over its
    retries (the same flow run run again takes over the artifact its earlier attempt made).
    ``form``: ``markdown``, ``table`` (rows of dicts) or ``progress`` (a percentage)."""

    def __init__(self, run_id: str, kind: str, description: str, *, form: str = "markdown") -> None:
        self.run_id, self.kind, self.description, self.form = run_id, kind, description, form
        self.artifact_id: Any = None

    @property
    def key(self) -> str:
        return artifact_key(self.run_id, self.kind)

    def publish(self, data: Any) -> None:
        """Publish ``data``; logs a failure, never raises."""
        if not _in_run_context():
            return
        from prefect.artifacts import TableArtifact

        try:
            if self.artifact_id is None:
                self.artifact_id = self._earlier_attempts()
                if self.artifact_id is None:
                    self.artifact_id = self._create(data)
                    self.created()
                    return
            from prefect.client.orchestration import get_client
            from prefect.client.schemas.actions import ArtifactUpdate

            body = TableArtifact(table=data).format() if self.form == "table" else data
            with get_client(sync_client=True) as client:
                client.update_artifact(self.artifact_id, ArtifactUpdate(data=body))
        except Exception as exc:  # noqa: BLE001 - artifacts must not kill a run
            logger.warning("%s artifact not published: %s", self.kind, exc)

    def _create(self, data: Any) -> Any:
        from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact

        if self.form == "table":
            return create_table_artifact(table=data, key=self.key, description=self.description)
        if self.form == "progress":
            return create_progress_artifact(progress=data, key=self.key, description=self.description)
        return create_markdown_artifact(markdown=data, key=self.key, description=self.description)

    def _earlier_attempts(self) -> Any:
        """The id of this key's latest version if the current flow run made it (an earlier attempt
        of this flow run: Prefect's Retry), else ``None``."""
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        latest = _latest_artifact(self.key)
        if ctx is None or latest is None or latest.flow_run_id != ctx.flow_run.id:
            return None
        return latest.latest_id

    def created(self) -> None:
        """Called once, after the artifact was created."""


class ProgressHandle(KeyedArtifact):
    """The progress artifact ``nrl-<run>-progress`` (steps done, percent), a :class:`KeyedArtifact`."""

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id, "progress", f"steps done of run {run_id}", form="progress")

    def update(self, done: int, total: int) -> None:
        self.publish(100.0 * done / max(total, 1))


class SummaryHandle(KeyedArtifact):
    """The run summary of one flow run (:mod:`flows.observe.summary`), ``nrl-<run>-summary``, a
    :class:`KeyedArtifact`. ``history``: the run's history as this flow run began it
    (``status.json``, :mod:`flows.run.history`), shown in every version."""

    def __init__(self, run_id: str, history: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__(run_id, "summary", f"summary of run {run_id}")
        self.history = list(history)

    def created(self) -> None:
        """One line in the flow run's log (its page opens on the logs) with the summary's page in
        the Prefect UI, when a UI URL is known: the artifact itself (``/artifacts/artifact/<id>``,
        updated in place, so the link always shows the latest content, not a list of versions)."""
        from prefect import get_run_logger
        from prefect.settings import get_current_settings

        ui = get_current_settings().ui_url
        if ui and self.artifact_id is not None:
            get_run_logger().info("summary of run %s (updated every step): %s", self.run_id,
                                  ui_page_url(ui, f"artifacts/artifact/{self.artifact_id}"))


class RunArtifacts:
    """What a flow run of a run publishes, one artifact of each kind, updated in place: progress,
    the summary, the metrics table and the algorithm's own (:meth:`keyed`: GRPO's best/worst rollouts)."""

    def __init__(self, run_id: str, history: Sequence[Mapping[str, Any]] = (), *, algorithm: str = "GRPO") -> None:
        self.run_id = run_id
        self.progress = ProgressHandle(run_id)
        self.summary = SummaryHandle(run_id, history)
        self.metrics = KeyedArtifact(run_id, "metrics", f"{algorithm} metrics of run {run_id}", form="table")
        self._keyed: dict[str, KeyedArtifact] = {}
        self.rollouts = self.keyed("rollouts", "best/worst rollouts")

    def keyed(self, kind: str, description: str) -> KeyedArtifact:
        """The flow run's markdown artifact of ``kind`` (made on first use)."""
        if kind not in self._keyed:
            self._keyed[kind] = KeyedArtifact(self.run_id, kind, description)
        return self._keyed[kind]


def publish_summary(run_id: str, markdown: str) -> None:
    """The run's summary artifact (:mod:`flows.observe.summary`) as a new version of its key
    (a flow publishing every step keeps one :class:`SummaryHandle` instead)."""
    if not _in_run_context():
        return
    from prefect.artifacts import create_markdown_artifact

    try:
        create_markdown_artifact(markdown=markdown, key=artifact_key(run_id, "summary"), description=f"summary of run {run_id}")
    except Exception as exc:  # noqa: BLE001
        logger.warning("summary artifact not published: %s", exc)


def _latest_artifact(key: str) -> Any:
    """The latest version of the artifact ``key`` on the Prefect API, ``None`` if there is none."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_latest_artifacts(
            artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(any_=[key])), limit=1
        )
    return found[0] if found else None


def publish_eval_view(key_name: str, markdown: str) -> bool:
    """The eval view of a sweep target (:mod:`flows.observe.eval_view`) as the markdown artifact
    ``nrl-<target>-evals``, published as a new version only when it differs from the latest
    version on the Prefect API (compared by :func:`~flows.observe.eval_view.view_digest`, which the
    description carries too): a sweep that evaluated nothing new adds nothing, whichever process
    ran the sweep before. Returns whether a version was created; never raises (warns)."""
    if not _in_run_context():
        return False
    from prefect.artifacts import create_markdown_artifact

    key, digest = artifact_key(key_name, "evals"), view_digest(markdown)
    try:
        latest = _latest_artifact(key)
    except Exception as exc:  # noqa: BLE001 - then publish: a duplicate version beats a missed change
        logger.warning("eval artifact %s: latest version not readable (%s); publishing", key, exc)
        latest = None
    if latest is not None and isinstance(latest.data, str) and view_digest(latest.data) == digest:
        logger.info("eval artifact %s unchanged (digest %s): not republished", key, digest)
        return False
    try:
        description = f"checkpoint evaluations of {key_name} (digest {digest})"
        create_markdown_artifact(markdown=markdown, key=key, description=description)
        return True
    except Exception as exc:  # noqa: BLE001
        logger.warning("eval artifact not published: %s", exc)
        return False


def publish_eval_table(
    key_name: str, rows: Sequence[Mapping[str, Any]], runs: Mapping[str, Mapping[str, Any]] | None = None
) -> bool:
    """The eval view of ``rows`` (:func:`flows.observe.eval_view.eval_view_markdown`; ``runs``: per run id
    its flow-run id, storage URI and UI URL), published by :func:`publish_eval_view`. (The name is
    from when it was a table.)"""

    try:
        markdown = eval_view_markdown(key_name, rows, runs)
    except Exception as exc:  # noqa: BLE001 - cosmetic
        logger.warning("eval artifact not rendered: %s", exc)
        return False
    return publish_eval_view(key_name, markdown)
