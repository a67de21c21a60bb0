"""Errors of the batch store; each names the dataset URI or the file at fault.

They subclass the built-in errors callers already expect (``FileNotFoundError``,
``FileExistsError``, ``ValueError``), so ``except FileNotFoundError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "AlreadyCommittedError",
    "CorruptDatasetError",
    "MissingShardError",
    "NotCommittedError",
]


class NotCommittedError(FileNotFoundError):
    """The URI holds no ``_manifest.json``: never written, half-written, or deleted."""


class AlreadyCommittedError(FileExistsError):
    """``save_batch`` to a committed URI without ``overwrite=True``."""


class CorruptDatasetError(ValueError):
    """A shard or manifest does not match what the manifest promises (size, checksum, schema)."""


class MissingShardError(CorruptDatasetError, FileNotFoundError):
    """A shard file named by the manifest is not there."""
