"""storage.retry: backoff schedule, settings, which errors are transient, call_with_retry.

The outage itself (a killed S3 server) is exercised in ``tests/faults/test_s3_outage.py``.
"""

from __future__ import annotations

import errno

import pytest

from storage import fs as sfs
from storage.retry import (
    RetryPolicy,
    StorageUnavailableError,
    call_with_retry,
    get_retry_policy,
    is_transient,
    retry_policy,
    set_retry_policy,
)


def test_backoff_schedule_and_validation():
    p = RetryPolicy(attempts=6, initial_delay_s=0.25, max_delay_s=1.0, multiplier=2.0, jitter=0)
    assert p.delays() == [0.25, 0.5, 1.0, 1.0, 1.0]
    assert p.total_wait_s() == pytest.approx(3.75)
    assert RetryPolicy().total_wait_s() > 30  # the default waits out a restart of an S3 server
    for bad in ({"attempts": 0}, {"attempts": True}, {"initial_delay_s": -1}, {"multiplier": 0.5}, {"jitter": 1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RetryPolicy(**bad)


@pytest.fixture
def no_explicit_policy():
    """Start from the environment/defaults (a flow run earlier in the session sets its config's)."""
    old = set_retry_policy(None)
    yield
    set_retry_policy(old)


def test_settings_precedence(monkeypatch, no_explicit_policy):
    monkeypatch.setenv("NRL_STORAGE_RETRY_ATTEMPTS", "3")
    monkeypatch.setenv("NRL_STORAGE_RETRY_INITIAL_S", "0.01")
    assert get_retry_policy().attempts == 3 and get_retry_policy().initial_delay_s == 0.01
    with retry_policy(attempts=2) as p:
        assert get_retry_policy() is p and p.initial_delay_s == 0.01  # other fields kept
    assert get_retry_policy().attempts == 3
    old = set_retry_policy(RetryPolicy(attempts=9))
    try:
        assert get_retry_policy().attempts == 9
    finally:
        set_retry_policy(old)
    monkeypatch.setenv("NRL_STORAGE_RETRY_ATTEMPTS", "many")
    with pytest.raises(ValueError, match="NRL_STORAGE_RETRY_ATTEMPTS"):
        get_retry_policy()
    with pytest.raises(TypeError):
        set_retry_policy({"attempts": 3})  # type: ignore[arg-type]


def test_transient_classification_on_real_error_types():
    from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

    assert is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(ReadTimeoutError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(ConnectionResetError(errno.ECONNRESET, "reset"))
    assert is_transient(OSError(errno.ETIMEDOUT, "timed out"))
    slow = ClientError({"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject")
    assert is_transient(slow)
    wrapped = OSError(errno.EIO, "s3fs translated")  # how s3fs re-raises unknown ClientErrors
    wrapped.__cause__ = slow
    assert is_transient(wrapped)
    denied = ClientError({"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "GetObject")
    assert not is_transient(denied)
    missing = FileNotFoundError("gone")
    missing.__cause__ = ConnectionResetError()  # a permanent answer wins over its cause
    assert not is_transient(missing)
    assert not is_transient(PermissionError("no"))
    assert not is_transient(ValueError("bad"))
    assert not is_transient(StorageUnavailableError("spent"))


def test_call_with_retry_retries_only_transient_errors():
    policy = RetryPolicy(attempts=4, initial_delay_s=0.001, max_delay_s=0.001, jitter=0)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")
        return "ok"

    assert call_with_retry(flaky, what="get s3://b/k", policy=policy) == "ok" and len(calls) == 3

    calls.clear()

    def down():
        calls.append(1)
        raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")

    with pytest.raises(StorageUnavailableError, match=r"get s3://b/k: .*after 4 attempts") as info:
        call_with_retry(down, what="get s3://b/k", policy=policy)
    assert len(calls) == 4 and isinstance(info.value.__cause__, ConnectionRefusedError)

    calls.clear()

    def missing():
        calls.append(1)
        raise FileNotFoundError("s3://b/k")

    with pytest.raises(FileNotFoundError):
        call_with_retry(missing, what="get", policy=policy)
    assert len(calls) == 1

    state = {"n": 0}

    def delete_whose_first_answer_was_lost():
        state["n"] += 1
        if state["n"] == 1:
            raise ConnectionResetError(errno.ECONNRESET, "reset after the delete took effect")
        raise FileNotFoundError("already deleted")

    assert call_with_retry(delete_whose_first_answer_was_lost, what="rm", policy=policy, on_retry_missing_ok=True) is None


def test_remote_filesystems_are_wrapped_and_local_ones_are_not(tmp_path):
    fs, _ = sfs.resolve(tmp_path)
    assert not isinstance(fs, sfs.RetryingFileSystem)
    fs, path = sfs.resolve("s3://bucket/x", {"endpoint_url": "http://127.0.0.1:9", "key": "AKIA-secret", "secret": "s"})
    assert isinstance(fs, sfs.RetryingFileSystem) and path == "bucket/x"
    assert "AKIA" not in repr(fs)
    assert fs.wrapped.config_kwargs["retries"]["max_attempts"] == 1  # this policy decides, not botocore's
    fs, _ = sfs.resolve("s3://bucket/x", {"endpoint_url": "http://127.0.0.1:9", "config_kwargs": {"retries": {"max_attempts": 7}}})
    assert fs.wrapped.config_kwargs["retries"]["max_attempts"] == 7


def test_check_writable(tmp_path, moto_s3):
    sfs.check_writable(str(tmp_path / "new" / "dir"))
    assert sfs.list_dir(str(tmp_path / "new" / "dir")) == []  # the probe is gone
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError):
        sfs.check_writable(str(blocker / "runs"))
    bucket = moto_s3.make_bucket()
    sfs.check_writable(bucket + "/runs", moto_s3.storage_options)
    assert sfs.exists(bucket, moto_s3.storage_options)
    assert not sfs.exists("s3://no-such-bucket-nrl", moto_s3.storage_options)
