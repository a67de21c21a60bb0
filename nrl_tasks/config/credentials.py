"""Credential-looking keys in config options: found (refused in ``storage.storage_options``) and redacted.

Configs are saved with the run and sent to Prefect as flow parameters, so credentials never go
in them; :func:`credential_paths` finds the ones that did, :func:`redact` hides secret-looking
values in what is written.
"""

from __future__ import annotations

from typing import Any

__all__ = ["credential_paths", "redact"]


_CREDENTIAL_NAMES = {"key", "secret", "token", "password", "passwd", "access_key", "secret_key", "session_token"}
_CREDENTIAL_PARTS = ("secret", "password", "token", "credential", "access_key", "private_key")


def credential_paths(options: Any, prefix: str = "") -> list[str]:
    """Dotted paths of credential-looking keys in nested ``options`` (``key``, ``secret``, ``*token*``...).

    >>> credential_paths({"endpoint_url": "u", "key": "k", "client_kwargs": {"aws_secret_access_key": "s"}})
    ['key', 'client_kwargs.aws_secret_access_key']
    """
    out: list[str] = []
    if isinstance(options, dict):
        for name, value in options.items():
            low = str(name).lower()
            path = f"{prefix}{name}"
            if isinstance(value, dict):
                out += credential_paths(value, path + ".")
            elif value is not None and (low in _CREDENTIAL_NAMES or any(p in low for p in _CREDENTIAL_PARTS)):
                out.append(path)
    return out


_SECRET_WORDS = ("key", "secret", "token", "password", "credential")


def redact(obj: Any) -> Any:
    """Copy of ``obj`` with the values of secret-looking keys replaced by ``"***"``.

    >>> redact({"client_kwargs": {"endpoint_url": "u"}, "secret": "s", "key": "k"})
    {'client_kwargs': {'endpoint_url': 'u'}, 'secret': '***', 'key': '***'}
    """
    if isinstance(obj, dict):
        return {
            k: ("***" if any(w in str(k).lower() for w in _SECRET_WORDS) and not isinstance(v, dict) else redact(v))
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj
