"""One resume plan: from what storage holds and how the actors are, what recovery must do.

:func:`plan_resume` is a pure function of two small records:

- :class:`RunFacts` (read from storage by :func:`read_run_facts`): the trained prefix (steps
  ``1..last`` with a committed ``train``), the committed checkpoints and those found damaged (a
  file missing or of another size or checksum than ``checkpoint.json`` lists, or weights whose
  checksum after loading is not the one the step recorded), the datasets missing from the steps
  a replay would read, the weights checksum each ``train`` recorded;
- :class:`ActorHealth` (probed by :func:`nrl_tasks.stages.health.probe_actors`): whether every
  policy rank answers and which version it holds (and its weights checksum), whether the
  generation workers answer and which version they hold.

The plan (:class:`ResumePlan`) says:

1. re-create the policy workers when a rank is dead or stuck, the generation workers likewise;
2. keep a live policy when it holds exactly the run's weights after step ``last`` (version and
   recorded checksum) and no replayed step needs repairs; otherwise **restore** the *anchor*, the
   newest undamaged checkpoint at or before ``last`` (none: the initial weights, re-creating live
   actors that hold others; a damaged newer one is **discarded**, uncommitted so that the step's
   next checkpoint replaces it), and **replay** the ``train`` of every step after it from its persisted batches,
   **recomputing** first the missing datasets of a replayed step (``--recompute``; only when its
   ``train`` recorded a checksum, which the replay must then reproduce);
3. **refit** the generation workers to ``last`` when they are re-created, stale, hold another
   version, the policy was restored, or the caller asks (every resume starts with a full refit).

**Async GRPO** (``lookahead = a > 0``, :mod:`nrl_tasks.stages.schedule`): step ``s`` generates on
weights version ``max(0, s-1-a)``, so the steps after ``last`` up to ``last + a`` generate on
versions older than the policy's. Those whose rollouts are not committed (the run stopped while
they were being generated) are the *ungenerated* steps: the policy must pass through their version
again. The anchor is then the newest undamaged checkpoint at or before the oldest version
needed (by an ungenerated step, or by a replayed step whose rollouts must be recomputed); the
plan **generates** each such step when the replay holds its version (``generate_at``: version ->
steps, the generation workers refitted to it first) and replays on to ``last``. A live policy at
``last`` is restored for it too: the rollouts then come from their scheduled weights exactly.

The flow carries the plan out with one executor (:func:`flows.run.recovery.execute_plan`), at the
start of every run and after every actor fault, before the failed step runs again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import storage
from nrl_tasks.stages.checkpoint import check_checkpoint, list_checkpoints
from nrl_tasks.stages.errors import DamagedRunError
from nrl_tasks.stages.graph import STEP_INPUTS
from nrl_tasks.stages.logprob import logprob_needed
from nrl_tasks.stages.schedule import StepSchedule

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nrl_tasks.config.master import MasterConfig

__all__ = ["ActorHealth", "ResumePlan", "RunFacts", "grpo_facts_options", "plan_resume", "read_run_facts"]


@dataclass(frozen=True)
class RunFacts:
    """What the run's storage says."""

    run_id: str
    #: last step of the trained prefix (0: nothing trained)
    last_trained: int
    #: steps with a committed checkpoint, ascending
    checkpoints: tuple[int, ...] = ()
    #: step -> its datasets before ``train`` that are not committed (steps after the anchor only)
    missing: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    #: step -> weights checksum its ``train`` recorded (``None``: none recorded)
    checksums: Mapping[int, str | None] = field(default_factory=dict)
    #: checkpoint step -> what is wrong with it (names the file); checked ones only
    damaged_checkpoints: Mapping[int, str] = field(default_factory=dict)
    #: the async schedule's trajectory age (0: synchronous GRPO)
    lookahead: int = 0
    #: steps after ``last_trained`` whose rollouts are not committed and whose scheduled weights
    #: version is older than ``last_trained`` (async only)
    ungenerated: tuple[int, ...] = ()

    def generation_version(self, step: int) -> int:
        """The weights version that generates ``step``'s rollouts (:class:`~nrl_tasks.stages.schedule.StepSchedule`)."""
        return max(0, step - 1 - self.lookahead)

    def _newest_checkpoint(self, at_most: int) -> int:
        return max((c for c in self.checkpoints if c <= at_most and c not in self.damaged_checkpoints), default=0)

    @property
    def anchor(self) -> int:
        """The newest undamaged checkpoint at or before ``last_trained`` and at or before every
        version an ungenerated step, or a replayed step lacking its rollouts, generates on (0: none).

        >>> RunFacts("r", 4, (2, 3, 4), lookahead=1, ungenerated=(5,)).anchor  # step 5 generates on v3
        3
        """
        floor = min([self.last_trained, *(self.generation_version(s) for s in self.ungenerated)])
        while True:
            anchor = self._newest_checkpoint(floor)
            need = [self.generation_version(s) for s in range(anchor + 1, self.last_trained + 1)
                    if "rollouts" in self.missing.get(s, ())]
            if not need or min(need) >= anchor:
                return anchor
            floor = min(need)

    @property
    def skipped_checkpoints(self) -> tuple[int, ...]:
        """The damaged checkpoints newer than the anchor, at or before ``last_trained``."""
        return tuple(c for c in self.checkpoints if self.anchor < c <= self.last_trained and c in self.damaged_checkpoints)


@dataclass(frozen=True)
class ActorHealth:
    """How the run's actors are (``None`` versions: dead, stuck, stale or disagreeing)."""

    policy_version: int | None
    generation_version: int | None
    generation_alive: bool
    #: the live policy's weights checksum (probed only when its version is the target)
    policy_checksum: str | None = None
    #: the policy actors were just created (hold the initial weights)
    policy_fresh: bool = False


@dataclass(frozen=True)
class ResumePlan:
    """What recovery does, in this order (see the module docstring)."""

    #: the weights version the policy (and then the generation workers) must hold
    target: int
    recreate_policy: bool = False
    recreate_generation: bool = False
    #: checkpoint step to restore (0: the initial weights), ``None``: keep the live policy
    restore_from: int | None = None
    replay: tuple[int, ...] = ()
    recompute: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    refit: bool = False
    reasons: tuple[str, ...] = ()
    #: damaged checkpoints to uncommit (step -> what is wrong)
    discard: Mapping[int, str] = field(default_factory=dict)
    #: the weights checksum the restored checkpoint must hold after loading (``None``: unknown)
    restore_checksum: str | None = None
    #: weights version -> steps whose rollouts are generated (and scored) when the restored and
    #: replayed policy holds that version, on generation workers refitted to it (async GRPO;
    #: in sync mode the replayed steps lacking rollouts, at their own ``step - 1``)
    generate_at: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def touches_actors(self) -> bool:
        return bool(self.recreate_policy or self.recreate_generation or self.restore_from is not None or self.refit)

    def describe(self) -> str:
        if not self.touches_actors:
            return f"nothing to do: the actors hold weights version {self.target}"
        parts = []
        if self.recreate_policy:
            parts.append("re-create the policy workers")
        if self.recreate_generation:
            parts.append("re-create the generation workers")
        if self.discard:
            parts.append(f"discard damaged checkpoint(s) {', '.join(map(str, sorted(self.discard)))}")
        if self.restore_from is not None:
            parts.append(f"restore {'checkpoint ' + str(self.restore_from) if self.restore_from else 'the initial weights'}")
        if self.recompute:
            parts.append("recompute " + ", ".join(f"{s}: {'/'.join(d)}" for s, d in sorted(self.recompute.items())))
        ahead = {v: steps for v, steps in self.generate_at.items() if any(s > self.target for s in steps)}
        if ahead:
            parts.append("generate " + ", ".join(
                f"step {'/'.join(str(s) for s in steps if s > self.target)} on version {v}" for v, steps in sorted(ahead.items())
            ))
        if self.replay:
            parts.append(f"replay train of step(s) {', '.join(map(str, self.replay))}")
        if self.refit:
            parts.append(f"refit the generation workers to version {self.target}")
        why = f" ({'; '.join(self.reasons)})" if self.reasons else ""
        return ", then ".join(parts) + why


def plan_resume(facts: RunFacts, health: ActorHealth, *, force_refit: bool = False) -> ResumePlan:
    """The recovery plan for ``facts`` and ``health`` (pure; see the module docstring).

    ``DamagedRunError`` when a replayed step lacks datasets and recorded no checksum to verify
    recomputed ones against (naming the damaged checkpoints when they forced the replay).
    """
    last, anchor = facts.last_trained, facts.anchor
    reasons: list[str] = []
    skipped = facts.skipped_checkpoints
    damage = "; ".join(f"checkpoint {c}: {facts.damaged_checkpoints[c]}" for c in reversed(skipped))
    repair = {s: tuple(facts.missing[s]) for s in range(anchor + 1, last + 1) if facts.missing.get(s)}
    for s in sorted(repair):
        if facts.checksums.get(s) is None:
            if skipped:
                raise DamagedRunError(
                    f"run {facts.run_id}: no valid checkpoint to restore ({damage}); "
                    f"{'checkpoint ' + str(anchor) if anchor else 'the initial weights'} would need a replay of "
                    f"step {s}, which lacks {list(repair[s])} and recorded no weights checksum to verify recomputed "
                    "inputs against"
                )
            raise DamagedRunError(
                f"run {facts.run_id}: trained step {s} lacks {list(repair[s])} and its train recorded no weights "
                "checksum (logger.weights_checksum=false), so recomputed inputs could not be verified; restore "
                f"a checkpoint at or after step {s} instead"
            )
    recreate_policy = health.policy_version is None
    if recreate_policy:
        reasons.append("a policy rank is dead or does not answer")
    want = facts.checksums.get(last) if last > 0 else None
    behind = facts.ungenerated
    live_ok = (
        not recreate_policy
        and health.policy_version == last
        and (want is None or health.policy_checksum == want)
        and not repair
        and not behind
    )
    if live_ok:
        restore_from = None
    else:
        restore_from = anchor
        if skipped:
            reasons.append(f"{damage}: restore {'checkpoint ' + str(anchor) if anchor else 'the initial weights'} instead")
        if not recreate_policy:
            if repair:
                reasons.append(f"steps {sorted(repair)} lack datasets: restore and replay to recompute them")
            elif behind:
                reasons.append(
                    f"step(s) {', '.join(map(str, behind))} must generate on older weights than version {last}: "
                    "restore and replay through them"
                )
            elif health.policy_version != last:
                reasons.append(f"the policy holds weights version {health.policy_version}, the run needs {last}")
            else:
                reasons.append(f"the live policy at version {last} does not hold the recorded weights")
            # back to the initial weights without a checkpoint: live actors hold others
            recreate_policy = anchor == 0 and not health.policy_fresh
    recreate_generation = not health.generation_alive
    if recreate_generation:
        reasons.append("a generation worker is dead or does not answer")
    generate_at: dict[int, tuple[int, ...]] = {}
    if restore_from is not None:
        gen = [s for s in sorted(repair) if "rollouts" in repair[s]] + list(behind)
        for s in gen:
            generate_at.setdefault(facts.generation_version(s), ())
            generate_at[facts.generation_version(s)] += (s,)
    # recomputing a replayed step's rollouts refits the workers to that step's weights first
    refit = (
        force_refit or recreate_generation or health.generation_version != last
        or bool(repair and restore_from is not None) or bool(generate_at)
    )
    return ResumePlan(
        target=last,
        recreate_policy=recreate_policy,
        recreate_generation=recreate_generation,
        restore_from=restore_from,
        replay=tuple(range(anchor + 1, last + 1)) if restore_from is not None else (),
        recompute=repair if restore_from is not None else {},
        refit=refit,
        reasons=tuple(reasons),
        discard={c: facts.damaged_checkpoints[c] for c in skipped} if restore_from is not None else {},
        restore_checksum=facts.checksums.get(anchor) if restore_from else None,
        generate_at=generate_at,
    )


def grpo_facts_options(cfg: MasterConfig) -> dict[str, Any]:
    """The :func:`read_run_facts` options of a GRPO run's config: its trajectory age (async GRPO),
    step budget and the datasets its steps do not make (``logprobs`` when nothing reads them)."""

    return {"lookahead": StepSchedule.from_config(cfg).lookahead, "max_steps": cfg.grpo.max_num_steps,
            "skipped": () if logprob_needed(cfg) else ("logprobs",), "step_inputs": STEP_INPUTS}


def read_run_facts(
    layout: Any,
    storage_options: dict[str, Any] | None = None,
    *,
    max_step: int | None = None,
    verify_checkpoints: bool = False,
    damaged: Mapping[int, str] | None = None,
    lookahead: int = 0,
    max_steps: int | None = None,
    skipped: tuple[str, ...] = (),
    read_checksums: bool = True,
    step_inputs: tuple[str, ...] = STEP_INPUTS,
) -> RunFacts:
    """Read :class:`RunFacts` of the run at ``layout`` (``max_step`` caps the trained prefix).

    ``verify_checkpoints``: check the files of the anchor, and of the next older checkpoint
    while one fails, until one passes (:func:`~nrl_tasks.stages.checkpoint_files.check_checkpoint`;
    it reads every byte of a local checkpoint, so recovery asks only when it would restore one).
    ``damaged``: checkpoints already found damaged (step -> problem), kept as facts.
    ``lookahead``: the async schedule's trajectory age (steps after the trained prefix, up to
    ``max_steps``, whose rollouts are missing are then looked for: :attr:`RunFacts.ungenerated`).
    ``skipped``: datasets the run's steps do not make (``logprobs`` when nothing reads them), never missing.
    ``step_inputs``: a step's datasets before ``train`` (its algorithm's stage graph; GRPO's by default).
    ``read_checksums=False``: leave the ``train`` manifests unread (every checksum ``None``): the
    anchor and the trained prefix do not depend on them, and a damaged manifest is then the
    damaged-data check's to report.
    """

    kw = {"storage_options": storage_options} if storage_options else {}
    last = 0
    checksums: dict[int, str | None] = {}
    while max_step is None or last < max_step:
        uri = layout.stage_uri(last + 1, "train")
        if not storage.is_committed(uri, **kw):
            break
        last += 1
        checksums[last] = storage.read_manifest(uri, **kw).meta.get("weights_checksum") if read_checksums else None
    listed = list_checkpoints(layout.checkpoints_uri, storage_options)
    checkpoints = tuple(s for s, _ in listed)
    bad = {s: p for s, p in (damaged or {}).items() if s in checkpoints}
    horizon = last + lookahead if max_steps is None else min(max_steps, last + lookahead)
    ungenerated = tuple(
        s for s in range(last + 1, horizon + 1)
        if max(0, s - 1 - lookahead) < last and not storage.is_committed(layout.stage_uri(s, "rollouts"), **kw)
    )
    missing: dict[int, tuple[str, ...]] = {}
    looked = last + 1  # steps >= looked have been looked at; an older anchor needs more of them
    while True:
        facts = RunFacts(layout.run_id, last, checkpoints, dict(missing), checksums, dict(bad), lookahead, ungenerated)
        anchor = facts.anchor
        if anchor + 1 < looked:
            for s in range(anchor + 1, looked):
                gone = tuple(d for d in step_inputs
                             if d not in skipped and not storage.is_committed(layout.stage_uri(s, d), **kw))
                if gone:
                    missing[s] = gone
            looked = anchor + 1
            continue
        if not verify_checkpoints or anchor == 0:
            return facts
        problem = check_checkpoint(dict(listed)[anchor], storage_options)
        if problem is None:
            return facts
        bad[anchor] = problem  # the next older one is the anchor then
