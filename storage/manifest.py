"""The manifest: ``_manifest.json``, written last, commits a batch dataset.

A dataset directory holds ``part-00000.arrow`` ... ``part-NNNNN.arrow`` (Arrow IPC files, one
contiguous row range each, in order) and ``_manifest.json``. Without the manifest the
directory is not a dataset: readers refuse it.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ColumnSpec",
    "Manifest",
    "ShardInfo",
    "shard_name",
]

FORMAT = "nrl-batch"
FORMAT_VERSION = 1
MANIFEST_NAME = "_manifest.json"

ColumnKind = Literal["tensor", "tensor_list", "arrow", "json"]


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
