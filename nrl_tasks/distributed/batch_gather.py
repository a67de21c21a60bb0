"""``all_gather`` of a batch's columns across a ``torch.distributed`` group (gloo or NCCL).

Each rank's tensor columns travel as 16-byte aligned byte ranges of one ``uint8`` buffer in a
single ``all_gather``; their schemas (dtype, shape) and the list columns travel with
``all_gather_object`` (pickle, in transit only).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch

from nrl_tasks.distributed.batch_columns import concat_column

_ALIGN = 16  # bytes; every column's byte range starts on this boundary


def _round_up(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _check_schemas(gathered: list[Any], ranks: list[int]) -> dict[str, tuple]:
    """The first non-empty rank's schema; ``ValueError`` if any other rank's disagrees."""
    ref = gathered[ranks[0]][0]
    for r in ranks:
        for k in set(gathered[r][0]) | set(ref):
            a, b = gathered[r][0].get(k), ref.get(k)
            if a is None or b is None or a[0] != b[0] or (a[0] == "tensor" and (
                    a[1] != b[1] or len(a[2]) != len(b[2]) or a[2][2:] != b[2][2:])):
                raise ValueError(f"all_gather: column {k!r} is {a} on rank {r} but {b} on rank "
                                 f"{ranks[0]} (columns, dtypes, ranks and dims >= 2 must agree)")
    return ref


def all_gather_columns(
    data: Mapping[str, Any], group: Optional[torch.distributed.ProcessGroup] = None
) -> dict[str, Any]:
    """Every rank's columns concatenated in rank order (collective over ``group``).

    ``data`` maps names to tensors (batch on dim 0) or lists, with equal row counts (the caller
    checks). Leading dims may differ per rank; tensors of rank >= 2 are right-padded on dim 1
    with 0 to the widest rank. A rank with no columns contributes no rows; if no rank has any,
    the result is empty. Every rank raises the same ``ValueError`` on a schema mismatch.
    Tensor results live on the device of this rank's column.
    """
    dist = torch.distributed
    world, me = dist.get_world_size(group), dist.get_rank(group)
    schema = {k: ("tensor", v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else ("list",)
              for k, v in data.items()}
    lists = {k: v for k, v in data.items() if isinstance(v, list)}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (schema, lists), group=group)
    ranks = [r for r in range(world) if gathered[r][0]]
    if not ranks:
        return {}
    ref = _check_schemas(gathered, ranks)
    tensor_keys = [k for k in ref if ref[k][0] == "tensor"]
    spans: list[dict[str, tuple[int, int]]] = [{} for _ in range(world)]
    for r in ranks:
        pos = 0
        for k in tensor_keys:
            nbytes = math.prod(gathered[r][0][k][2]) * ref[k][1].itemsize
            spans[r][k] = (pos, pos + nbytes)
            pos += _round_up(nbytes)
    size = max([end for sp in spans for _, end in sp.values()] + [1])
    if tensor_keys:
        on_cuda = "gloo" not in str(dist.get_backend(group))
        device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
        send = torch.zeros(_round_up(size), dtype=torch.uint8, device=device)
        for k, (start, end) in spans[me].items():
            col = data[k].detach()  # copied from any layout: x[:, 0] of [1, S] has no uint8 view
            send[start:end].view(col.dtype).view(col.shape).copy_(col)
        received = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(received, send, group=group)
    out: dict[str, Any] = {}
    for k, desc in ref.items():
        if desc[0] == "list":
            out[k] = [item for r in ranks for item in gathered[r][1][k]]
            continue
        parts = [received[r][slice(*spans[r][k])].view(desc[1]).reshape(gathered[r][0][k][2])
                 for r in ranks]
        mine = data.get(k)  # results live where this rank's column lived
        out[k] = concat_column(k, parts, 0).to(
            mine.device if isinstance(mine, torch.Tensor) else parts[0].device
        )
    return out
