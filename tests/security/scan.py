"""File scanners of the security tests: every persisted file is a known safe format, no pickle.

:func:`check_files` walks a directory and returns one line per problem:

- the format, by name, must be one of: Arrow IPC (``.arrow``: magic, readable, no pickle-based
  ``arrow.py_extension_type`` fields), safetensors (``.safetensors``: JSON header, sizes add
  up), JSON / JSON lines, YAML (``yaml.safe_load``: no Python tags), plain UTF-8 text
  (``.jinja``, ``.txt``, ``.md``);
- no file may look like a pickle (protocol header ``\\x80\\x02``-``\\x80\\x05`` at the start), a
  ``torch.save`` zip (``PK\\x03\\x04`` with a ``data.pkl`` entry), or carry the tell-tale names of
  pickled tensors/arrays (``_rebuild_tensor``, ``torch._utils``, ``numpy.core.multiarray``...);
- no name may end in ``.pkl``, ``.pickle``, ``.pt``, ``.pth``, ``.bin``, ``.ckpt``, ``.npy``.

:func:`grep_files` finds files (and byte offsets) holding any of some byte strings.
"""

from __future__ import annotations

import io
import json
import os
import struct
import zipfile
from typing import Iterable

import pyarrow as pa
import yaml

TEXT_SUFFIXES = (".jinja", ".txt", ".md")
PICKLE_SUFFIXES = (".pkl", ".pickle", ".pt", ".pth", ".bin", ".ckpt", ".npy", ".npz", ".joblib")
PICKLE_MARKERS = (
    b"_rebuild_tensor",
    b"torch._utils",
    b"torch.storage",
    b"numpy.core.multiarray",
    b"numpy._core.multiarray",
    b"cbuiltins\n",
    b"ccopy_reg\n_reconstructor",
    b"arrow.py_extension_type",
)


def files_under(root: str) -> list[str]:
    out = []
    for base, _dirs, names in os.walk(root):
        out.extend(os.path.join(base, n) for n in names)
    return sorted(out)


def _looks_like_pickle(data: bytes) -> bool:
    return len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= 5


def _check_arrow(path: str, data: bytes) -> list[str]:
    if not (data.startswith(b"ARROW1") and data.endswith(b"ARROW1")):
        return [f"{path}: not an Arrow IPC file (magic)"]
    try:
        schema = pa.ipc.open_file(pa.py_buffer(data)).schema
    except pa.ArrowException as exc:
        return [f"{path}: unreadable Arrow IPC file: {exc}"]
    problems = []

    def visit(field: pa.Field) -> None:
        meta = field.metadata or {}
        if meta.get(b"ARROW:extension:name") == b"arrow.py_extension_type":
            problems.append(f"{path}: field {field.name!r} is a pickled Python extension type")
        for value in meta.values():
            if _looks_like_pickle(value):
                problems.append(f"{path}: field {field.name!r} metadata holds a pickle")
        for i in range(field.type.num_fields):
            visit(field.type.field(i))

    for field in schema:
        visit(field)
    for value in (schema.metadata or {}).values():
        if _looks_like_pickle(value):
            problems.append(f"{path}: schema metadata holds a pickle")
    return problems


def _check_safetensors(path: str, data: bytes) -> list[str]:
    if len(data) < 8:
        return [f"{path}: too short for safetensors"]
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as exc:
        return [f"{path}: safetensors header is not JSON: {exc}"]
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            if not all(isinstance(v, str) for v in info.values()):
                return [f"{path}: safetensors metadata values must be strings"]
            continue
        end = max(end, int(info["data_offsets"][1]))
    if 8 + n + end != len(data):
        return [f"{path}: safetensors sizes do not add up ({8 + n + end} != {len(data)})"]
    return []


def check_file(path: str) -> list[str]:
    """Problems of one file (empty when it is a known safe format without pickle)."""
    name = os.path.basename(path).lower()
    with open(path, "rb") as fh:
        data = fh.read()
    problems = []
    if name.endswith(PICKLE_SUFFIXES):
        problems.append(f"{path}: pickle-format file name")
    if _looks_like_pickle(data):
        problems.append(f"{path}: starts with a pickle protocol header")
    if data.startswith(b"PK\x03\x04"):
        try:
            names = zipfile.ZipFile(io.BytesIO(data)).namelist()
        except zipfile.BadZipFile:
            names = []
        problems.append(f"{path}: a zip archive ({'torch.save, ' if any(n.endswith('data.pkl') for n in names) else ''}{names[:5]})")
    for marker in PICKLE_MARKERS:
        if marker in data:
            problems.append(f"{path}: holds {marker!r}, a mark of pickled objects")
    if name.endswith(".arrow"):
        problems += _check_arrow(path, data)
    elif name.endswith(".safetensors"):
        problems += _check_safetensors(path, data)
    elif name.endswith(".json"):
        try:
            json.loads(data)
        except ValueError as exc:
            problems.append(f"{path}: not JSON: {exc}")
    elif name.endswith(".jsonl"):
        for n, line in enumerate(data.splitlines(), 1):
            if line.strip():
                try:
                    json.loads(line)
                except ValueError as exc:
                    problems.append(f"{path}: line {n} is not JSON: {exc}")
    elif name.endswith((".yaml", ".yml")):
        try:
            yaml.safe_load(data)
        except yaml.YAMLError as exc:
            problems.append(f"{path}: not safe YAML: {exc}")
    elif name.endswith(TEXT_SUFFIXES):
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            problems.append(f"{path}: not UTF-8 text")
    else:
        problems.append(f"{path}: unknown format (allowed: Arrow, safetensors, JSON, YAML, text)")
    return problems


def check_files(root: str) -> tuple[list[str], list[str]]:
    """``(files, problems)`` for every file below ``root``."""
    files = files_under(root)
    problems: list[str] = []
    for path in files:
        problems += check_file(path)
    return files, problems


def grep_files(paths: Iterable[str], needles: Iterable[bytes], max_bytes: int = 256 << 20) -> list[str]:
    """``"path @offset"`` for each file holding one of ``needles`` (files above ``max_bytes`` are skipped)."""
    needles = [n for n in needles if n]
    hits = []
    for path in paths:
        try:
            if os.path.getsize(path) > max_bytes:
                continue
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        for needle in needles:
            at = data.find(needle)
            if at >= 0:
                hits.append(f"{path} @{at}")
    return hits
