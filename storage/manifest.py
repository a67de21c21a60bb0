"""The manifest: ``_manifest.json``, written last, commits a batch dataset.

A dataset directory holds ``part-00000.arrow`` ... ``part-NNNNN.arrow`` (Arrow IPC files, one
contiguous row range each, in order) and ``_manifest.json``. Without the manifest the
directory is not a dataset: readers refuse it. :func:`parse_manifest` validates a manifest
read back (shard names and ranges, checksums, format version) before anyone trusts it.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from storage.checksum import ALGORITHMS, combine
from storage.errors import CorruptDatasetError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "SHARD_RE",
    "ColumnSpec",
    "Manifest",
    "ShardInfo",
    "parse_manifest",
    "shard_name",
]

FORMAT = "nrl-batch"
FORMAT_VERSION = 1
MANIFEST_NAME = "_manifest.json"

ColumnKind = Literal["tensor", "tensor_list", "arrow", "json"]
#: Shard file names: plain ``part-00000.arrow``, or one writer attempt's ``part-00000.<token>.arrow``.
SHARD_RE = re.compile(r"^part-\d{5,}(\.[0-9a-f]{12})?\.arrow$")
_HEX_RE = re.compile(r"^[0-9a-f]{1,128}$")


def shard_name(index: int) -> str:
    """File name of shard ``index``.

    >>> shard_name(7)
    'part-00007.arrow'
    """
    return f"part-{index:05d}.arrow"


class ShardInfo(BaseModel):
    """One shard file: rows ``[start, start + rows)`` of the batch."""

    model_config = ConfigDict(frozen=True)

    name: str  # file name inside the dataset directory
    start: int = Field(ge=0)  # first row (global index)
    rows: int = Field(ge=0)
    bytes: int = Field(ge=0)  # file size
    checksum: str  # hex digest of the whole file (Manifest.checksum_algorithm)


class ColumnSpec(BaseModel):
    """How one column is stored and how it comes back.

    ``kind``:
    - ``"tensor"``: a torch tensor ``[rows, *shape]``; Arrow primitive (``shape == []``) or
      ``fixed_size_list`` of the flattened row; ``dtype`` is the torch dtype, ``storage`` the
      Arrow value type holding its bits (``bool`` -> ``uint8``, ``bfloat16`` -> ``uint16``,
      ``float8_*`` -> ``uint8``, ``complex64`` -> pairs of ``float32``).
    - ``"tensor_list"``: a list of tensors ``[n_i, *shape]`` (ragged on their first dim) or
      ``None``; Arrow ``list``/``large_list`` of the flattened values.
    - ``"arrow"``: a list of Python values Arrow holds exactly (str, int, float, bool, bytes,
      None, and homogeneous nested lists/dicts of them); native Arrow type.
    - ``"json"``: anything else (heterogeneous dicts, message logs with tensors, tuples):
      one JSON string per row with tagged objects (see ``storage.pycodec``).
    """

    model_config = ConfigDict(frozen=True)

    name: str
    kind: ColumnKind
    dtype: Optional[str] = None  # torch dtype name without "torch.", tensor kinds only
    shape: Optional[list[int]] = None  # per-row shape (tensor) or trailing dims (tensor_list)
    storage: Optional[str] = None  # Arrow value type holding tensor bits
    arrow_type: str  # str() of the Arrow field type, for humans and other readers


class Manifest(BaseModel):
    """Everything needed to find, verify and decode a committed batch dataset."""

    format: Literal["nrl-batch"] = FORMAT
    format_version: int = FORMAT_VERSION
    uri: str  # where it was read from (as given to the call); where it was written, on save
    rows: int = Field(ge=0)
    num_shards: int = Field(ge=1)
    shards: list[ShardInfo]
    columns: list[ColumnSpec]
    meta: dict[str, Any] = Field(default_factory=dict)  # user metadata: run_id, step, stage, ...
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    checksum_algorithm: str
    checksum: str  # blake2b-128 over the shard checksums, in shard order

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def bytes(self) -> int:
        """Total size of the shard files."""
        return sum(s.bytes for s in self.shards)

    def summary(self) -> dict[str, Any]:
        """Small JSON-able dict for logs, Prefect results and artifacts."""
        return {
            "uri": self.uri,
            "rows": self.rows,
            "num_shards": self.num_shards,
            "bytes": self.bytes,
            "checksum": self.checksum,
            **{k: v for k, v in self.meta.items() if isinstance(v, (str, int, float, bool))},
        }


def parse_manifest(raw: bytes, where: str, uri: str) -> Manifest:
    """Validate the manifest bytes read from ``where``; returns it with its ``uri`` set to ``uri``.

    Raises ``CorruptDatasetError`` naming ``where`` for anything a writer of this store never
    produces: invalid JSON or fields, a newer format version, bad shard names or ranges,
    non-hex or inconsistent checksums, an unknown checksum algorithm, duplicate columns.
    """
    try:
        manifest = Manifest.model_validate_json(raw)
    except ValueError as exc:
        raise CorruptDatasetError(f"manifest {where} is invalid: {exc}") from None
    if manifest.format_version > FORMAT_VERSION:
        raise CorruptDatasetError(
            f"manifest {where} has format version {manifest.format_version}; this reader knows "
            f"up to {FORMAT_VERSION}"
        )
    expected = 0
    for info in manifest.shards:
        if not SHARD_RE.match(info.name) or info.start != expected:
            raise CorruptDatasetError(f"manifest {where}: bad shard entry {info.name!r}")
        expected += info.rows
    if len(manifest.shards) != manifest.num_shards or expected != manifest.rows:
        raise CorruptDatasetError(
            f"manifest {where}: {len(manifest.shards)} shards with {expected} rows, header says "
            f"{manifest.num_shards} shards with {manifest.rows} rows"
        )
    digests = [s.checksum for s in manifest.shards] + [manifest.checksum]
    if not all(_HEX_RE.match(d) for d in digests):
        raise CorruptDatasetError(f"manifest {where}: checksums must be hex digests")
    if manifest.checksum_algorithm not in ALGORITHMS:
        raise CorruptDatasetError(
            f"manifest {where}: unknown checksum algorithm {manifest.checksum_algorithm!r}; known: {list(ALGORITHMS)}"
        )
    names = manifest.column_names
    if len(set(names)) != len(names):
        raise CorruptDatasetError(f"manifest {where}: duplicate column names in {names}")
    if combine(s.checksum for s in manifest.shards) != manifest.checksum:
        raise CorruptDatasetError(f"manifest {where}: the dataset checksum does not match the shard checksums")
    return manifest.model_copy(update={"uri": uri})
