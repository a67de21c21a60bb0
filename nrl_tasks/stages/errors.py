"""What can go wrong in a stage, and which of it a retry can fix.

An **actor fault** (:func:`is_actor_fault`) is a dead, unreachable, stuck or stale actor: the flow
re-plans the run's recovery (re-create, restore, replay, refit; :mod:`flows.run.recovery`) and runs the
step again, up to the run's retry settings. Bad data, bad config and damaged storage are not actor
faults: they fail the run with their own message.

A :class:`NonFiniteTrainingError` (a NaN/inf loss, gradient norm, learning rate or parameter in a
train step) is not an actor fault either: the same data gives the same NaN. When its
``weights_valid`` is False (:func:`policy_weights_invalid`), the policy actors no longer hold the
weights of any committed step: recovery must restore them from a checkpoint (or re-create the
policy) before the policy is used again; the workers refuse other calls until then.
"""

from __future__ import annotations

from collections.abc import Iterator

from nrl_tasks.models.generation.interfaces import StaleWeightsError
from nrl_tasks.models.policy.errors import NonFiniteTrainingError
from nrl_tasks.utils.collective import CollectiveError

__all__ = [
    "DEFAULT_STAGE_RETRIES",
    "DEFAULT_STAGE_RETRY_DELAY_S",
    "DamagedRunError",
    "MissingOptimizerStateError",
    "NonFiniteTrainingError",
    "RefitFailedError",
    "StalePolicyError",
    "describe_error",
    "exception_chain",
    "is_actor_fault",
    "nonfinite_training_error",
    "policy_weights_invalid",
    "root_cause",
]

#: Defaults of ``grpo.stage_retries`` / ``grpo.stage_retry_delay_s``.
DEFAULT_STAGE_RETRIES = 2
DEFAULT_STAGE_RETRY_DELAY_S: tuple[float, ...] = (1.0, 3.0)


class DamagedRunError(ValueError):
    """Persisted data a resume or replay needs is damaged, missing or cannot be verified."""


class MissingOptimizerStateError(DamagedRunError):
    """A checkpoint restored to train on holds no optimizer state (``checkpointing.save_optimizer:
    false``): the steps after it would silently differ from an uninterrupted run's. Never retried."""


def _stale_weights_error() -> type:
    return StaleWeightsError


class StalePolicyError(RuntimeError):
    """The policy does not hold the weights version a stage needs (re-created or restarted actors)."""


class RefitFailedError(RuntimeError):
    """A refit attempt failed or missed its deadline; the generation workers are stale."""


def _fault_types() -> tuple[type, ...]:
    import ray.exceptions as rx

    types: list[type] = [rx.RayActorError, rx.GetTimeoutError, rx.WorkerCrashedError, rx.ObjectLostError]
    for name in ("ActorUnavailableError", "OwnerDiedError", "NodeDiedError", "RaySystemError"):
        t = getattr(rx, name, None)
        if isinstance(t, type):
            types.append(t)
    # stale weights on either side, a collective whose peer died or timed out, a failed refit
    types += [_stale_weights_error(), StalePolicyError, CollectiveError, RefitFailedError]
    return tuple(types)


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc``, then what it wraps: a ``RayTaskError``'s worker exception (``.cause``), else
    ``__cause__`` / ``__context__``; each exception once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        cause = getattr(exc, "cause", None)
        exc = cause if isinstance(cause, BaseException) else (exc.__cause__ or exc.__context__)


def _is_ray_wrapper(exc: BaseException) -> bool:
    """Whether ``exc`` is Ray's report of an error raised elsewhere (a ``RayTaskError`` from a task
    or actor method, a ``RayActorError`` from an actor's constructor)."""
    import sys

    rx = sys.modules.get("ray.exceptions")  # no Ray imported: no Ray error
    return rx is not None and isinstance(exc, (rx.RayTaskError, rx.RayActorError))


def root_cause(exc: BaseException) -> BaseException:
    """The error ``exc`` reports: through Ray's wrappers (``RayTaskError(ValueError)``,
    ``RayActorError``: their ``.cause``, else ``__cause__``) down to the exception raised in the
    worker; any other exception is its own root (its own message names what failed)."""
    seen: set[int] = set()
    while _is_ray_wrapper(exc) and id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)
        inner = cause if isinstance(cause, BaseException) else exc.__cause__
        if inner is None:
            break
        exc = inner
    return exc


def describe_error(exc: BaseException) -> str:
    """``"<Type>: <message>"`` of ``exc``'s :func:`root_cause`: what the CLI's last line and the
    run's ``status.json`` say when a run fails, e.g. ``"ValueError: lora_cfg.target_modules ..."``
    rather than ``"RayTaskError(ValueError): ray::PolicyWorker.setup() (pid=..., repr=...)"``
    followed by a remote traceback. A Ray wrapper with no cause (``ActorDiedError`` of an actor
    whose constructor raised) is named with its traceback's last line, the worker's error."""
    import re

    root = root_cause(exc)
    text = str(root).strip()
    if _is_ray_wrapper(root):
        lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines() if line.strip()]
        text = lines[-1] if lines else ""
    return f"{type(root).__name__}: {text}" if text else type(root).__name__


def is_actor_fault(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what it wraps) means a dead, stuck or stale actor: worth a retry
    after recovery. Bad data, bad config and storage damage are not."""
    types = _fault_types()
    for e in exception_chain(exc):
        if isinstance(e, (DamagedRunError, NonFiniteTrainingError)):
            return False
        if isinstance(e, types):
            return True
    return False


def nonfinite_training_error(exc: BaseException | None) -> NonFiniteTrainingError | None:
    """The :class:`NonFiniteTrainingError` ``exc`` is or wraps (through ``RayTaskError`` and
    ``__cause__`` / ``__context__``), or None."""
    for e in exception_chain(exc):
        if isinstance(e, NonFiniteTrainingError):
            return e
    return None


def policy_weights_invalid(exc: BaseException | None) -> bool:
    """Whether ``exc`` says the policy's weights are no longer valid (a non-finite or partial
    update was applied): the policy must be restored from a checkpoint or re-created."""
    err = nonfinite_training_error(exc)
    return err is not None and not err.weights_valid
