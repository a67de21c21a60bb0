"""Retries with exponential backoff for remote storage (S3) calls that fail transiently.

An object store that is down for a while, restarting, throttling (HTTP 503 ``SlowDown``) or
dropping connections must not end a run. Every filesystem call the storage helpers make on a
remote filesystem goes through :func:`call_with_retry` (see ``storage.fs.resolve``): a call that
fails with a *transient* error (connection refused/reset/closed, timeouts, HTTP 5xx/throttling)
is repeated after ``initial_delay_s``, then twice that, ... capped at ``max_delay_s``, up to
``attempts`` calls in all (tenacity's ``Retrying``); then :class:`StorageUnavailableError` names
the operation, the path, the attempts and the last error. Anything else (missing file, permission denied, bad input)
raises at once.

Every call retried this way is idempotent: reads, listings, whole-object PUTs of the same bytes
(an S3 object appears only once complete, so a failed PUT leaves nothing or the full object)
and deletes (a delete retried after a lost response finds nothing left: that is success). Local
files are never retried (a disk error is not transient).

Settings, in increasing precedence: the defaults of :class:`RetryPolicy`; the environment
(``NRL_STORAGE_RETRY_ATTEMPTS``, ``NRL_STORAGE_RETRY_INITIAL_S``, ``NRL_STORAGE_RETRY_MAX_S``,
read by :class:`storage.settings.StorageSettings`); :func:`set_retry_policy` (process-wide, every
thread, e.g. from the run config's ``storage.retry``) or the :func:`retry_policy` context
manager. Botocore's own retries are reduced to a single attempt by ``storage.fs.s3_options``
(unless configured explicitly) so that this policy alone decides how long an outage is waited
out.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import random
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional, TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from storage.settings import storage_settings

__all__ = [
    "RetryPolicy",
    "StorageUnavailableError",
    "call_with_retry",
    "get_retry_policy",
    "is_transient",
    "retry_policy",
    "set_retry_policy",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class StorageUnavailableError(OSError):
    """A remote storage call still failed transiently after every retry of the policy."""


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff: delays ``initial_delay_s * multiplier**i`` capped at ``max_delay_s``.

    ``attempts`` counts calls (1 = no retry). ``jitter`` (fraction) spreads each delay by up to
    that much either way, so that many clients do not retry in lockstep.

    >>> RetryPolicy(attempts=5, initial_delay_s=0.5, max_delay_s=2.0, jitter=0).delays()
    [0.5, 1.0, 2.0, 2.0]
    >>> RetryPolicy(attempts=1).delays()
    []
    """

    attempts: int = 8
    initial_delay_s: float = 0.5
    max_delay_s: float = 10.0
    multiplier: float = 2.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be an int >= 1, got {self.attempts!r}")
        for name in ("initial_delay_s", "max_delay_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"RetryPolicy.{name} must be a number >= 0, got {value!r}")
        if self.multiplier < 1:
            raise ValueError(f"RetryPolicy.multiplier must be >= 1, got {self.multiplier!r}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"RetryPolicy.jitter must be in [0, 1), got {self.jitter!r}")

    def delays(self) -> list[float]:
        """The nominal sleeps (s) between the ``attempts`` calls, without jitter."""
        return [
            min(self.max_delay_s, self.initial_delay_s * self.multiplier**i) for i in range(self.attempts - 1)
        ]

    def total_wait_s(self) -> float:
        """How long an outage this policy waits out (the sum of :meth:`delays`)."""
        return sum(self.delays())


class _PolicyHolder:
    """The explicitly set policy, shared by every thread of the process.

    Not a ``ContextVar``: the policy a flow sets (``with retry_policy(cfg.storage.retry.policy())``
    in ``flows.algorithms.grpo``) must reach the storage calls made from threads that do not inherit the
    flow thread's context: the parallel shard PUTs of ``storage.commit`` (a ``ThreadPoolExecutor``),
    the lease heartbeat, the checkpoint holds and refit threads of ``nrl_tasks.stages``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._policy: Optional[RetryPolicy] = None

    def get(self) -> Optional[RetryPolicy]:
        with self._lock:
            return self._policy

    def swap(self, policy: Optional[RetryPolicy]) -> Optional[RetryPolicy]:
        with self._lock:
            old, self._policy = self._policy, policy
        return old


_explicit = _PolicyHolder()


def get_retry_policy() -> RetryPolicy:
    """The policy in force: set explicitly, else from the environment, else the defaults."""
    explicit = _explicit.get()
    if explicit is not None:
        return explicit
    overrides = storage_settings().retry_overrides()
    return replace(RetryPolicy(), **overrides) if overrides else RetryPolicy()


def set_retry_policy(policy: Optional[RetryPolicy]) -> Optional[RetryPolicy]:
    """Set the process-wide policy (``None``: back to environment/defaults); returns the old one."""
    if policy is not None and not isinstance(policy, RetryPolicy):
        raise TypeError(f"expected a RetryPolicy or None, got {type(policy).__name__}")
    return _explicit.swap(policy)


@contextlib.contextmanager
def retry_policy(policy: Optional[RetryPolicy] = None, **fields: Any) -> Iterator[RetryPolicy]:
    """Use ``policy`` (or the current one with ``fields`` changed) inside the ``with`` block."""
    chosen = policy if policy is not None else replace(get_retry_policy(), **fields)
    old = set_retry_policy(chosen)
    try:
        yield chosen
    finally:
        set_retry_policy(old)


# --------------------------------------------------------------------------- classification
_PERMANENT = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ValueError,
    TypeError,
    KeyError,
    StorageUnavailableError,
)
_TRANSIENT_ERRNOS = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.EAGAIN,
}
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
    "502",
    "504",
}
_TRANSIENT_CLASS_NAMES = {
    # botocore (checked by name: botocore is optional for local-only use)
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ProxyConnectionError",
    "HTTPClientError",
    "IncompleteReadError",
    "ResponseStreamingError",
    # aiohttp
    "ClientConnectionError",
    "ClientConnectorError",
    "ClientOSError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
    "ClientPayloadError",
    # fsspec / http.client
    "FSTimeoutError",
    "IncompleteRead",
    "RemoteDisconnected",
}


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: Optional[BaseException] = exc
    while cur is not None and id(cur) not in seen and len(seen) < 16:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _is_transient_one(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    if any(cls.__name__ in _TRANSIENT_CLASS_NAMES for cls in type(exc).__mro__):
        return True
    response = getattr(exc, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        code = str((response.get("Error") or {}).get("Code", ""))
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if code in _TRANSIENT_CODES or (isinstance(status, int) and (status >= 500 or status == 429)):
            return True
    return False


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is worth retrying.

    Missing files, permissions, bad input and :class:`StorageUnavailableError` (the retries are
    already spent) are permanent even when caused by a network error.

    >>> is_transient(ConnectionRefusedError(111, "refused")), is_transient(FileNotFoundError("x"))
    (True, False)
    >>> is_transient(OSError(5, "I/O error"))
    False
    """
    if isinstance(exc, _PERMANENT):
        return False
    return any(_is_transient_one(e) for e in _chain(exc))


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 500 else text[:497] + "..."


def _backoff(policy: RetryPolicy) -> Callable[[RetryCallState], float]:
    """Tenacity's exponential wait for ``policy`` (the delays of :meth:`RetryPolicy.delays`), each
    spread by up to ``jitter`` either way."""
    nominal = wait_exponential(multiplier=policy.initial_delay_s, exp_base=policy.multiplier, max=policy.max_delay_s)
    if not policy.jitter:
        return nominal
    return lambda state: nominal(state) * (1 + random.uniform(-policy.jitter, policy.jitter))


def call_with_retry(
    fn: Callable[..., T],
    *args: Any,
    what: str,
    policy: Optional[RetryPolicy] = None,
    on_retry_missing_ok: bool = False,
    **kwargs: Any,
) -> T:
    """``fn(*args, **kwargs)``, repeated on transient errors per ``policy`` (default: current).

    ``what`` names the operation and path in logs and errors (never credentials).
    ``on_retry_missing_ok``: a ``FileNotFoundError`` on a *retry* means an earlier attempt took
    effect (deletes): return ``None``.
    """
    policy = policy or get_retry_policy()

    def log_retry(state: RetryCallState) -> None:
        assert state.outcome is not None and state.next_action is not None
        logger.warning(
            "%s failed (%s); retry %d/%d in %.2f s", what, _describe(state.outcome.exception()),
            state.attempt_number, policy.attempts - 1, state.next_action.sleep,
        )

    def give_up(state: RetryCallState) -> Any:
        assert state.outcome is not None
        exc = state.outcome.exception()
        raise StorageUnavailableError(
            f"{what}: storage unavailable after {policy.attempts} attempts over "
            f"{state.seconds_since_start or 0.0:.1f} s (storage.retry / NRL_STORAGE_RETRY_*): {_describe(exc)}"
        ) from exc

    retrying = Retrying(
        stop=stop_after_attempt(policy.attempts),
        wait=_backoff(policy),
        retry=retry_if_exception(is_transient),  # anything else is raised at once, as it was
        before_sleep=log_retry,
        retry_error_callback=give_up,
    )
    for attempt in retrying:
        with attempt:
            try:
                return fn(*args, **kwargs)
            except FileNotFoundError:
                if on_retry_missing_ok and attempt.retry_state.attempt_number > 1:
                    return None  # type: ignore[return-value]
                raise
    raise AssertionError("unreachable")  # pragma: no cover - tenacity returns, raises or gives up
