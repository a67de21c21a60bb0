"""``BatchedDataDict``: the batch every nrl-flows stage speaks (NeMo-RL seed 000 API).

A batch maps column names to either a ``torch.Tensor`` with the batch on dim 0 (``[B]``,
``[B, S]`` right-padded sequences, ``[B, S, ...]``) or a ``list`` with one element per row. All
columns hold the same number of rows; every operation checks this and raises ``ValueError``
naming the columns and their sizes.

Micro-batch plans. ``shard_by_batch_size(..., dynamic_batching_cfg=...)`` or
``(..., sequence_packing_cfg=...)`` stores on each returned shard, as instance attributes (they
survive pickling, so Ray transport, and ``to()``; not Arrow persistence, ``from_batches``,
``slice`` or ``select_indices``):

- ``micro_batch_kind``: ``"dynamic"`` or ``"packing"``.
- ``elem_counts_per_gb[g]``: rows of global batch ``g`` in this shard (rows are contiguous,
  global batch after global batch).
- ``micro_batch_indices[g]``: ``[(start, end), ...]`` row ranges of the micro-batches (dynamic)
  or bins (packing) of global batch ``g``, relative to that global batch's first row.
- ``micro_batch_lengths[g]``: per micro-batch, the padded sequence length (dynamic) or the
  padded tokens in the bin (packing).

Every shard gets the same number of micro-batches per global batch, so data-parallel ranks stay
in lock-step. ``get_batch(g)`` keeps global batch ``g``'s plan; the iterators walk every global
batch the dict holds.

The class keeps every method; the work behind some lives in sibling modules:
:mod:`~nrl_tasks.distributed.batch_columns` (per-column checks, row selection, concatenation),
:mod:`~nrl_tasks.distributed.microbatch_plan` (``DynamicBatchingCfg``, ``SequencePackingCfg``
and the planner behind ``shard_by_batch_size``) and :mod:`~nrl_tasks.distributed.batch_gather`
(``all_gather``). The cfg types are re-exported here.
"""

from __future__ import annotations

import copy
from collections import UserDict
from typing import Any, Generic, Iterator, Mapping, Optional, Sequence
from typing import Self, TypeVar, Union

import numpy as np
import torch

from nrl_tasks.distributed.batch_columns import (
    concat_column,
    positive_int,
    row_indices,
    rows_of,
    take_rows,
)
from nrl_tasks.distributed.batch_gather import all_gather_columns
from nrl_tasks.distributed.microbatch_plan import (
    DynamicBatchingCfg,
    MicroBatchKind,
    SequencePackingCfg,
    check_cfg,
    plan_shards,
)

__all__ = [
    "BatchedDataDict",
    "DictT",
    "DynamicBatchingCfg",
    "MicroBatchKind",
    "SequencePackingCfg",
    "SlicedDataDict",
]

DictT = TypeVar("DictT", bound=Mapping[str, Any])


class BatchedDataDict(UserDict, Generic[DictT]):
    """Column name -> tensor (batch on dim 0) or list (one element per row).

    ``repr`` prints like the plain dict of columns.
    """

    micro_batch_kind: Optional[MicroBatchKind]
    micro_batch_indices: Optional[list[list[tuple[int, int]]]]
    micro_batch_lengths: Optional[list[list[int]]]
    elem_counts_per_gb: Optional[list[int]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._clear_plan()
        super().__init__(*args, **kwargs)

    # ----------------------------------------------------------------- plan bookkeeping
    def _clear_plan(self) -> None:
        self.micro_batch_kind = None
        self.micro_batch_indices = None
        self.micro_batch_lengths = None
        self.elem_counts_per_gb = None

    def _set_plan(
        self,
        kind: MicroBatchKind,
        indices: list[list[tuple[int, int]]],
        lengths: list[list[int]],
        counts: list[int],
    ) -> None:
        self.micro_batch_kind = kind
        self.micro_batch_indices = [list(gb) for gb in indices]
        self.micro_batch_lengths = [list(gb) for gb in lengths]
        self.elem_counts_per_gb = list(counts)

    def _plan(self, kind: MicroBatchKind) -> list[tuple[int, int, int]]:
        """Absolute ``(start, end, length)`` per micro-batch over all global batches."""
        if self.micro_batch_kind != kind:
            cfg = "dynamic_batching_cfg" if kind == "dynamic" else "sequence_packing_cfg"
            raise ValueError(
                f"this batch carries no {kind!r} micro-batch plan (it has "
                f"{self.micro_batch_kind!r}); get it from shard_by_batch_size(..., {cfg}=...)"
            )
        counts = self.elem_counts_per_gb or []
        if sum(counts) != self.size:
            raise ValueError(
                f"micro-batch plan covers {sum(counts)} rows but the batch has "
                f"{self.size}; the rows changed after sharding"
            )
        out, offset = [], 0
        for count, ranges, lengths in zip(
            counts, self.micro_batch_indices or [], self.micro_batch_lengths or []
        ):
            out += [(offset + s, offset + e, n) for (s, e), n in zip(ranges, lengths)]
            offset += count
        return out

    # ------------------------------------------------------------------------- basics
    @property
    def size(self) -> int:
        """Rows in the batch (0 when there are no columns)."""
        sizes = {k: rows_of(k, v) for k, v in self.data.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"columns have different numbers of rows: {sizes}")
        return next(iter(sizes.values()), 0)

    def get_dict(self) -> dict[Any, Any]:
        """The underlying ``dict`` of columns (not a copy)."""
        return self.data

    def to(self, device: str | torch.device) -> Self:
        """Move every tensor to ``device`` in place; returns ``self`` (the plan is kept)."""
        for k, v in self.data.items():
            if isinstance(v, torch.Tensor):
                self.data[k] = v.to(device)
        return self

    @classmethod
    def from_batches(
        cls,
        batches: Sequence[Mapping[str, Any]],
        pad_value_dict: Optional[dict[str, int | float]] = None,
    ) -> Self:
        """Concatenate batches row-wise into one.

        Lists and 1-D tensors are concatenated; tensors of rank >= 2 are right-padded on dim 1 to
        the widest batch with ``pad_value_dict.get(key, 0)`` (dtype kept). The result has the
        union of the batches' columns, in first-seen order; a 0-row batch (``{}`` included) may
        lack any of them, a batch with rows must have them all (``ValueError`` naming the batch
        and the columns it lacks).

        >>> import torch
        >>> from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
        >>> b = BatchedDataDict.from_batches(
        ...     [{"ids": torch.tensor([[1, 2]]), "text": ["a"]},
        ...      {},
        ...      {"ids": torch.tensor([[3, 4, 5]]), "text": ["b"]}],
        ...     pad_value_dict={"ids": -1})
        >>> b["ids"].tolist(), b["text"]
        ([[1, 2, -1], [3, 4, 5]], ['a', 'b'])
        """
        if not batches:
            raise ValueError("from_batches needs at least one batch")
        pad_value_dict = pad_value_dict or {}
        keys = list(dict.fromkeys(k for batch in batches for k in batch))
        lacking = []
        for i, batch in enumerate(batches):
            sizes = {k: rows_of(k, v) for k, v in batch.items()}
            if len(set(sizes.values())) > 1:
                raise ValueError(f"batch {i}: columns have different numbers of rows: {sizes}")
            rows = next(iter(sizes.values()), 0)
            missing = [k for k in keys if k not in batch]
            if rows and missing:
                lacking.append(f"batch {i} has columns {list(batch)} but lacks {missing}")
        if lacking:
            raise ValueError("; ".join(lacking) + " (only a 0-row batch may omit columns)")
        out = cls()
        for k in keys:
            parts = [batch[k] for batch in batches if k in batch]
            out[k] = concat_column(k, parts, pad_value_dict.get(k, 0))
        return out

    def select_indices(
        self, indices: Union[Sequence[int], torch.Tensor, np.ndarray, int]
    ) -> Self:
        """New batch (same type) with rows ``indices`` in that order (repeats allowed).

        Accepts ids in ``[0, size)`` as a list, ``range``, 1-D integer ``numpy`` array or tensor,
        an integer scalar (one row; the batch dim is kept), or a bool ``torch`` mask of length
        ``size``; float and bool arrays are refused (see ``batch_columns.row_indices``).

        >>> import numpy as np
        >>> from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
        >>> BatchedDataDict({"x": ["a", "b", "c"]}).select_indices(np.array([2, 0]))
        {'x': ['c', 'a']}
        """
        rows = row_indices(indices, self.size)
        out = type(self)()
        for k, v in self.data.items():
            out[k] = take_rows(v, rows)
        return out

    def reorder_data(self, indices: Union[Sequence[int], torch.Tensor]) -> None:
        """Undo a permutation in place: the row now at position ``p`` becomes row ``indices[p]``.

        ``indices`` must be a permutation of ``range(size)`` (e.g. the indices returned with the
        shards by ``shard_by_batch_size``). Clears any micro-batch plan.

        >>> from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
        >>> b = BatchedDataDict({"x": ["c", "a", "b"]})
        >>> b.reorder_data([2, 0, 1]); b
        {'x': ['a', 'b', 'c']}
        """
        size = self.size
        order = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
        if len(order) != size or sorted(order) != list(range(size)):
            raise ValueError(
                f"reorder_data needs a permutation of range({size}); got {len(order)} indices"
                + ("" if len(order) != size else " with repeats or out-of-range values")
            )
        inverse = [0] * size
        for position, original in enumerate(order):
            inverse[original] = position
        for k, v in self.data.items():
            self.data[k] = take_rows(v, inverse)
        self._clear_plan()

    # ------------------------------------------------------------------------ slicing
    def slice(self, start: int, end: int) -> "SlicedDataDict":
        """Rows ``[start, end)`` (tensors are views), ``0 <= start <= end <= size``."""
        size = self.size
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= size):
            raise ValueError(f"slice [{start}, {end}) out of range for a batch of {size} rows")
        out = SlicedDataDict()
        for k, v in self.data.items():
            out[k] = v[start:end]
        return out

    def chunk(self, rank: int, chunks: int) -> "SlicedDataDict":
        """The ``rank``-th of ``chunks`` equal contiguous splits (a copy).

        >>> from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
        >>> BatchedDataDict({"x": list("AAABBBDDE")}).chunk(rank=2, chunks=3)
        {'x': ['D', 'D', 'E']}
        """
        positive_int("chunks", chunks)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < chunks:
            raise ValueError(f"rank {rank!r} out of range for {chunks} chunks")
        size = self.size
        if size % chunks:
            raise ValueError(f"batch of {size} rows cannot be split into {chunks} equal chunks")
        step = size // chunks
        return SlicedDataDict(self.select_indices(range(rank * step, (rank + 1) * step)).data)

    def get_batch(self, batch_idx: int, batch_size: Optional[int] = None) -> "SlicedDataDict":
        """Global batch ``batch_idx``: rows ``[batch_idx * batch_size, (batch_idx + 1) * batch_size)``.

        On a shard carrying a micro-batch plan the boundaries come from ``elem_counts_per_gb``
        and the result keeps that global batch's plan; ``batch_size`` may then be omitted (with
        packing, shards hold different row counts, so it is ignored; with dynamic batching it
        must match).
        """
        if isinstance(batch_idx, bool) or not isinstance(batch_idx, int) or batch_idx < 0:
            raise ValueError(f"batch_idx must be a non-negative int, got {batch_idx!r}")
        if self.micro_batch_kind is not None:
            counts = self.elem_counts_per_gb or []
            if batch_idx >= len(counts):
                raise ValueError(f"batch_idx {batch_idx} out of range: the plan has {len(counts)}")
            if (self.micro_batch_kind == "dynamic" and batch_size is not None
                    and batch_size != counts[batch_idx]):
                raise ValueError(
                    f"batch_size {batch_size} disagrees with the dynamic-batching plan, which "
                    f"has {counts[batch_idx]} rows per global batch in this shard"
                )
            start = sum(counts[:batch_idx])
            out = self.slice(start, start + counts[batch_idx])
            out._set_plan(
                self.micro_batch_kind,
                [(self.micro_batch_indices or [])[batch_idx]],
                [(self.micro_batch_lengths or [])[batch_idx]],
                [counts[batch_idx]],
            )
            return out
        if batch_size is None:
            raise ValueError("get_batch needs batch_size when the batch carries no plan")
        positive_int("batch_size", batch_size)
        end = (batch_idx + 1) * batch_size
        if end > self.size:
            raise ValueError(
                f"global batch {batch_idx} of {batch_size} rows ends at row {end}, past the "
                f"{self.size} rows of the batch"
            )
        return self.slice(end - batch_size, end)

    def repeat_interleave(self, num_repeats: int) -> Self:
        """Each row repeated ``num_repeats`` times, copies adjacent (list items deep-copied).

        >>> import torch
        >>> from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
        >>> r = BatchedDataDict({"key": torch.tensor([1, 2, 3]), "other_key": [1, 2, 3]})
        >>> r = r.repeat_interleave(2)
        >>> r["key"].tolist(), r["other_key"]
        ([1, 1, 2, 2, 3, 3], [1, 1, 2, 2, 3, 3])
        """
        positive_int("num_repeats", num_repeats)
        self.size  # noqa: B018
        out = type(self)()
        for k, v in self.data.items():
            if isinstance(v, torch.Tensor):
                out[k] = v.repeat_interleave(num_repeats, dim=0)
            else:
                out[k] = [copy.deepcopy(item) for item in v for _ in range(num_repeats)]
        return out

    def truncate_tensors(self, dim: int, truncated_len: int) -> None:
        """Narrow, in place, every tensor with more than ``truncated_len`` entries on ``dim``.

        ``dim`` >= 1 (dim 0 is the batch); tensors with fewer dims or already short enough are
        left unchanged. Results are views.
        """
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be an int >= 1 (dim 0 is the batch), got {dim!r}")
        if isinstance(truncated_len, bool) or not isinstance(truncated_len, int) or truncated_len < 0:
            raise ValueError(f"truncated_len must be a non-negative int, got {truncated_len!r}")
        for k, v in self.data.items():
            if isinstance(v, torch.Tensor) and v.ndim > dim and v.shape[dim] > truncated_len:
                self.data[k] = v.narrow(dim, 0, truncated_len)

    # --------------------------------------------------------------------- iterators
    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator["SlicedDataDict"]:
        """Consecutive micro-batches of ``microbatch_size`` rows (must divide ``size``)."""
        positive_int("microbatch_size", microbatch_size)
        size = self.size
        if size % microbatch_size:
            raise ValueError(f"batch of {size} rows is not a multiple of microbatch_size "
                             f"{microbatch_size}")
        return (self.slice(i, i + microbatch_size) for i in range(0, size, microbatch_size))

    def make_microbatch_iterator_with_dynamic_shapes(
        self, sequence_dim: int = 1
    ) -> Iterator["SlicedDataDict"]:
        """Micro-batches of the dynamic-batching plan, tensors narrowed to the padded length."""
        plan = self._plan("dynamic")

        def generate() -> Iterator[SlicedDataDict]:
            for start, end, length in plan:
                mb = self.slice(start, end)
                mb.truncate_tensors(dim=sequence_dim, truncated_len=length)
                yield mb

        return generate()

    def get_microbatch_iterator_dynamic_shapes_len(self) -> int:
        """Number of micro-batches ``make_microbatch_iterator_with_dynamic_shapes`` yields."""
        return len(self._plan("dynamic"))

    def make_microbatch_iterator_for_packable_sequences(self) -> Iterator["SlicedDataDict"]:
        """One ``SlicedDataDict`` per packing bin: the rows to pack into one sequence."""
        plan = self._plan("packing")
        return (self.slice(start, end) for start, end, _ in plan)

    def get_microbatch_iterator_for_packable_sequences_len(self) -> tuple[int, int]:
        """``(number of bins, most padded tokens in one bin)``."""
        plan = self._plan("packing")
        return len(plan), max((n for _, _, n in plan), default=0)

    # ---------------------------------------------------------------------- sharding
    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: Optional[int] = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_cfg: Optional[DynamicBatchingCfg] = None,
        sequence_packing_cfg: Optional[SequencePackingCfg] = None,
    ) -> Union[list["SlicedDataDict"], tuple[list["SlicedDataDict"], list[int]]]:
        """Split into ``shards``: cut global batches of ``batch_size`` rows (default: all rows),
        split each into ``shards`` pieces and give shard ``i`` piece ``i`` of every global batch.

        For example, with data [A A B B C C D D], batch_size=2, shards=2:
        shard 0 gets [A B C D] (first elements of each chunk), shard 1 [A B C D] (second ones).

        ``allow_uneven_shards`` (not with ``batch_size``): shards of ``ceil(size / shards)`` rows,
        the last ones shorter. With ``dynamic_batching_cfg`` or ``sequence_packing_cfg`` (one of
        them) rows are reordered and a micro-batch plan is stored on every shard (see the module
        docstring); the call then returns ``(shards, indices)`` where
        ``BatchedDataDict.from_batches(shards)`` followed by ``reorder_data(indices)`` restores
        the original order. With packing, ``batch_size`` need not divide by ``shards``: shards
        hold whole bins, the same number each, balanced by tokens; when a global batch has fewer
        rows than the bins it needs (e.g. fewer rows than shards), some bins are empty and their
        micro-batch is a 0-row ``SlicedDataDict`` that the rank must still step through. A cfg
        with an unknown or a missing key raises ``ValueError`` naming it. A 0-row batch gives
        ``shards`` empty shards (with a cfg: plans of no global batch, so no micro-batch, and
        ``indices == []``).

        >>> from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
        >>> # Create a batch of two message logs with different lengths
        >>> batch = BatchedDataDict({
        ...     'problem_id': [0, 0, 1, 1, 2, 2, 3, 3],
        ...     'arbitrary_data': [1, 2, 3, 4, 5, 6, 7, 8]
        ... })
        >>> shards = batch.shard_by_batch_size(shards=2)
        >>> shards
        [{'problem_id': [0, 0, 1, 1], 'arbitrary_data': [1, 2, 3, 4]}, {'problem_id': [2, 2, 3, 3], 'arbitrary_data': [5, 6, 7, 8]}]
        >>> # Now say that I'm training with a GBS of 4 and I want to take gradients steps on problems 0 and 1 before 2 and 3 (problems are repeated because GRPO)
        >>> # In the current case, problems 0 and 2 will be trained on first since they're the first elements in each DP rank's batch.
        >>> # So, we'll use the batch_size argument to split the batch into chunks of size 4 first.
        >>> shards = batch.shard_by_batch_size(shards=2, batch_size=4)
        >>> shards
        [{'problem_id': [0, 0, 2, 2], 'arbitrary_data': [1, 2, 5, 6]}, {'problem_id': [1, 1, 3, 3], 'arbitrary_data': [3, 4, 7, 8]}]
        >>> # Now, the ranks have 0 and 1 first so when they split their batches into microbatches (of size 2 since GBS=4 and DP=2), they'll train on 0 and 1 first.
        >>> # Another way to use this function is with the 'allow_uneven_shards' flag, which allows the last shard to be smaller than the others when necessary.
        >>> # This is necessary in multi-turn rollouts when some sequences terminate early, leaving unclean batch sizes.
        >>> batch = BatchedDataDict({
        ...     'problem_id': [0, 1, 2, 3, 4],
        ...     'arbitrary_data': [10, 11, 12, 13, 14]
        ... })
        >>> shards = batch.shard_by_batch_size(shards=2, allow_uneven_shards=True)
        >>> shards
        [{'problem_id': [0, 1, 2], 'arbitrary_data': [10, 11, 12]}, {'problem_id': [3, 4], 'arbitrary_data': [13, 14]}]
        >>> # This is incompatible with the batch_size argument
        """
        positive_int("shards", shards)
        if dynamic_batching_cfg is not None and sequence_packing_cfg is not None:
            raise ValueError("pass dynamic_batching_cfg or sequence_packing_cfg, not both")
        if allow_uneven_shards and batch_size is not None:
            raise ValueError(f"allow_uneven_shards=True cannot be combined with batch_size={batch_size}")
        if allow_uneven_shards and dynamic_batching_cfg is not None:
            raise ValueError("allow_uneven_shards=True cannot be combined with dynamic batching")
        if dynamic_batching_cfg is not None:
            check_cfg(dynamic_batching_cfg, "dynamic")
        if sequence_packing_cfg is not None:
            check_cfg(sequence_packing_cfg, "packing")
        total = self.size
        if batch_size is None:
            batch_size = total
        else:
            positive_int("batch_size", batch_size)
        if batch_size and total % batch_size:
            raise ValueError(f"batch of {total} rows is not a multiple of batch_size {batch_size}")
        num_gb = total // batch_size if batch_size else 0
        if sequence_packing_cfg is not None:
            return self._shard_with_plan(shards, batch_size, sequence_packing_cfg, "packing")
        if not allow_uneven_shards and batch_size % shards:
            raise ValueError(
                f"batch_size {batch_size} is not a multiple of shards {shards} (rows: {total})"
            )
        if dynamic_batching_cfg is not None:
            return self._shard_with_plan(shards, batch_size, dynamic_batching_cfg, "dynamic")
        per = -(-batch_size // shards)
        rows = [
            [g * batch_size + j for g in range(num_gb)
             for j in range(s * per, min((s + 1) * per, batch_size))]
            for s in range(shards)
        ]
        return [SlicedDataDict(self.select_indices(r).data) for r in rows]

    def _shard_with_plan(
        self, shards: int, batch_size: int, cfg: Mapping[str, Any], kind: MicroBatchKind
    ) -> tuple[list["SlicedDataDict"], list[int]]:
        """Shard for dynamic batching or sequence packing; validates ``cfg`` against the batch."""
        rows, plans = plan_shards(self.data, shards, batch_size, cfg, kind)
        out = []
        for s in range(shards):
            shard = SlicedDataDict(self.select_indices(rows[s]).data)
            shard._set_plan(kind, *plans[s])
            out.append(shard)
        return out, [i for r in rows for i in r]

    # ------------------------------------------------------------------ collectives
    def all_gather(self, group: Optional[torch.distributed.ProcessGroup] = None) -> "BatchedDataDict":
        """Concatenate every rank's batch in rank order (collective over ``group``).

        Works on gloo (CPU) and NCCL groups; leading dims may differ per rank, tensors of rank
        >= 2 are right-padded on dim 1 with 0 to the widest rank (like ``from_batches``); lists
        travel with ``all_gather_object`` (pickle, in transit only). A rank with no columns
        contributes no rows. Every rank raises the same ``ValueError`` on a schema mismatch.
        """
        self.size  # noqa: B018 (validates columns before anyone sends)
        return BatchedDataDict(all_gather_columns(self.data, group))


class SlicedDataDict(BatchedDataDict):
    """A slice or shard of a larger batch (a distinct type for type checking)."""
