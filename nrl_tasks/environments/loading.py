"""Finding and running the configured environment: ``env.environment`` and its Ray actors.

``env.environment`` names a built-in (:data:`BUILTIN`) or a user class ``"package.module:ClassName"``
implementing :class:`~nrl_tasks.environments.interfaces.EnvironmentInterface`, built with
``env.environment_kwargs``. :func:`make_environment` imports and builds it (preflight does, so a bad
path, a class without ``step`` or bad keyword arguments is a config error naming the key before
anything starts); :class:`EnvironmentWorkers` runs ``env.num_workers`` copies as Ray actors, each
stepping a contiguous slice of the batch, and checks what they return
(:func:`~nrl_tasks.environments.interfaces.check_environment_return`).
"""

from __future__ import annotations

from typing import Any

from nrl_tasks.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    MessageLog,
    check_environment_return,
)
from nrl_tasks.utils.import_path import import_attribute

__all__ = ["BUILTIN", "EnvironmentDiedError", "EnvironmentTimeoutError", "EnvironmentWorkers", "environment_class", "initial_stop_strings", "make_environment"]

#: built-in environments by name
BUILTIN: dict[str, str] = {
    "calculator": "nrl_tasks.environments.calculator:CalculatorEnvironment",
    "guess_number": "nrl_tasks.environments.guess_number:GuessNumberEnvironment",
}


def environment_class(spec: str, *, isolate: bool = False) -> type:
    """The class ``spec`` names (a built-in name or ``"package.module:ClassName"``); ``ValueError``
    naming ``env.environment`` when it cannot be imported or has no ``step`` method. ``isolate``
    (preflight): a user's module is imported in a child process first, under a time limit
    (:func:`nrl_tasks.utils.import_path.import_attribute`)."""
    path = BUILTIN.get(spec, spec)
    module_name, _, attr = path.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ValueError(
            f"env.environment must be a built-in ({', '.join(sorted(BUILTIN))}) or 'package.module:ClassName', got {spec!r}"
        )
    obj = import_attribute(module_name, attr, f"env.environment {spec!r}", isolate=isolate)
    if not isinstance(obj, type) or not callable(getattr(obj, "step", None)):
        raise ValueError(
            f"env.environment {spec!r} is not an environment class: it needs a step(message_logs, metadata) method "
            "(nrl_tasks.environments.interfaces.EnvironmentInterface)"
        )
    return obj


def make_environment(spec: str, kwargs: dict[str, Any] | None = None, *, isolate: bool = False) -> EnvironmentInterface:
    """An instance of the environment ``spec`` built with ``kwargs`` (``env.environment_kwargs``);
    ``isolate``: as for :func:`environment_class`."""
    cls = environment_class(spec, isolate=isolate)
    try:
        return cls(**(kwargs or {}))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"env.environment {spec!r} with env.environment_kwargs {kwargs or {}!r}: {exc}") from exc


def initial_stop_strings(spec: str) -> list[str] | None:
    """The stop strings of an episode's first turn the environment declares (``stop_strings``
    class attribute, e.g. the calculator's ``</tool_call>``); later turns use ``next_stop_strings``."""
    stops = getattr(environment_class(spec), "stop_strings", None)
    return list(stops) if stops else None


class _EnvironmentActor:
    """One environment instance in a Ray actor."""

    def __init__(self, spec: str, kwargs: dict[str, Any]) -> None:
        self.env = make_environment(spec, kwargs)

    def ready(self) -> bool:
        return True

    def step(self, message_logs: list[MessageLog], metadata: list[dict[str, Any] | None]) -> tuple:
        try:
            return tuple(self.env.step(message_logs, metadata))
        except SystemExit as exc:  # would end the actor (Ray: an intended exit), then look like an actor fault
            raise RuntimeError(
                f"step() called sys.exit({exc.code!r}): an environment reports a bad episode in what it returns, "
                "or raises"
            ) from None

    def post_process(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        return self.env.global_post_process_and_metrics(batch)


class EnvironmentDiedError(RuntimeError):
    """An environment actor's process ended inside ``step()`` (``os._exit``, a crash, the OOM
    killer): an actor fault (it wraps Ray's ``RayActorError``, so the stage is retried on fresh
    actors) whose message names the environment."""


class EnvironmentTimeoutError(RuntimeError):
    """A ``step()`` call took longer than ``env.step_timeout_s``; the actors were replaced. Not an
    actor fault: a step that hangs on these episodes hangs again on a retry."""


class EnvironmentWorkers:
    """``num_workers`` Ray actors running environment ``spec`` (see the module docstring);
    ``step_timeout_s``: the longest wait for one batch's ``step()`` (``env.step_timeout_s``)."""

    def __init__(
        self, spec: str, kwargs: dict[str, Any] | None, num_workers: int = 1, *, namespace: str | None = None,
        step_timeout_s: float | None = None,
    ) -> None:
        import ray

        self.spec, self.kwargs, self.namespace, self.num_workers = spec, dict(kwargs or {}), namespace, max(1, num_workers)
        self.step_timeout_s = step_timeout_s
        self._remote = ray.remote(num_cpus=0)(_EnvironmentActor)  # light: they wait on the environment, not on cores
        self.workers = self._start()

    def _start(self) -> list[Any]:
        """Start the actors and wait until each has built its environment (so their start-up is
        neither in the first step's environment seconds nor a surprise there)."""
        import ray

        workers = [self._remote.options(namespace=self.namespace).remote(self.spec, self.kwargs) for _ in range(self.num_workers)]
        ray.get([w.ready.remote() for w in workers])
        return workers

    def step(self, message_logs: list[MessageLog], metadata: list[dict[str, Any] | None]) -> EnvironmentReturn:
        """Step every conversation, slices of the batch on the actors in parallel; checked."""
        import ray
        import torch

        n = len(message_logs)
        if n == 0:
            return EnvironmentReturn([], [], [], torch.zeros(0), torch.zeros(0, dtype=torch.bool), [])
        k = min(len(self.workers), n)
        bounds = [(i * n // k, (i + 1) * n // k) for i in range(k)]
        refs = [w.step.remote(message_logs[a:b], metadata[a:b]) for w, (a, b) in zip(self.workers, bounds)]
        results = None
        try:
            results = ray.get(refs, timeout=self.step_timeout_s)
        except ray.exceptions.GetTimeoutError:  # a hung step(): end it with its actors (raised below,
            self._restart()  # outside this block: chained to Ray's timeout it would count as an actor fault)
        except ray.exceptions.RayActorError as exc:  # an actor died (the environment crashed its process):
            self._restart()  # the stage fails on an actor fault; its retry steps on fresh actors
            raise EnvironmentDiedError(
                f"environment {self.spec}: its worker process died inside step() (os._exit, a crash or the OOM killer)"
            ) from exc
        except ray.exceptions.RayTaskError as exc:  # the environment raised: name it, keep its error
            raise RuntimeError(f"environment {self.spec}: step() raised {exc.cause!r}"[:2000]) from exc.cause
        if results is None:
            raise EnvironmentTimeoutError(
                f"environment {self.spec}: step() of {n} episodes did not return within env.step_timeout_s="
                f"{self.step_timeout_s:g} s (its actors were replaced); fix the environment or raise the limit, then resume"
            )
        parts = [check_environment_return(out, b - a, self.spec) for out, (a, b) in zip(results, bounds)]
        answers = [x for p in parts for x in (p.answers or [None] * len(p.observations))]
        return EnvironmentReturn(
            [o for p in parts for o in p.observations], [m for p in parts for m in p.metadata],
            [s for p in parts for s in p.next_stop_strings], torch.cat([p.rewards for p in parts]),
            torch.cat([p.terminateds for p in parts]), answers,
        )

    def _restart(self) -> None:
        self.shutdown()
        self.workers = self._start()

    def post_process(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        """The environment's ``global_post_process_and_metrics`` (on the first actor)."""
        import ray

        return ray.get(self.workers[0].post_process.remote(batch))

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.workers = []
