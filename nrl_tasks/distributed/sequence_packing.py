"""Sequence packing: bins of at most ``capacity`` tokens, dealt to data-parallel shards.

Units: every length here is a token count *after* padding each sequence up to the pad multiple
(``padded_length``). A *bin* is a list of row positions (indices into the ``lengths`` passed in);
its load is the sum of its rows' padded lengths and never exceeds the capacity.

Two bin-forming algorithms (names as NeMo-RL's config spells them):

- ``first_fit_decreasing`` (FFD): rows longest first, each into the first bin with room
  (O(n log n) with a max segment tree over bin slots).
- ``modified_first_fit_decreasing`` (MFFD, Johnson & Garey 1985): rows are classed large
  (> C/2), medium (> C/3), small (> C/6) and tiny; one bin per large row; a forward pass gives each
  large bin the largest medium that fits; a backward pass gives medium-free bins the smallest
  small plus the largest small that still fits; a forward pass tops every bin up with the largest
  leftover that fits; FFD packs what remains into new bins.

``pack_for_shards`` then (1) makes the bin count a multiple of the shard count (splitting the
fullest multi-row bins; only a global batch with fewer rows than the needed bins gets empty
bins, which its shards run as empty micro-batches to stay in lock-step), (2) re-spreads the rows over that
many bins so they carry near-equal tokens when that fits the capacity (worst-fit decreasing;
otherwise the algorithm's bins stay), and (3) gives every shard the same number of bins,
balancing **tokens** (greedy longest-processing-time with a per-shard bin quota, then pairwise
swaps between the heaviest and lightest shard). Dealing never does worse than NeMo-RL's
round-robin on the heaviest shard: both are computed and the lighter maximum is kept. Each
shard's bins are ordered by tokens, descending, so ranks in lock-step work on similar bins.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from typing import Literal, Sequence

PackingAlgorithm = Literal["first_fit_decreasing", "modified_first_fit_decreasing"]
PACKING_ALGORITHMS: tuple[str, ...] = ("first_fit_decreasing", "modified_first_fit_decreasing")


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (tokens)."""
    return -(-length // multiple) * multiple


class _FirstFit:
    """First-fit placement in O(log n): a max segment tree over bin slots' free tokens.

    Slots not opened yet hold the full capacity, so the first slot that fits is either an open
    bin or the next new one.
    """

    def __init__(self, capacity: int, max_bins: int) -> None:
        size = 1
        while size < max(1, max_bins):
            size *= 2
        self._size = size
        self._free = [capacity] * (2 * size)
        self.bins: list[list[int]] = []

    def place(self, length: int, item: int) -> None:
        free, node = self._free, 1
        while node < self._size:
            node *= 2
            if free[node] < length:
                node += 1
        slot = node - self._size
        if slot == len(self.bins):
            self.bins.append([])
        self.bins[slot].append(item)
        free[node] -= length
        node //= 2
        while node:
            left, right = free[2 * node], free[2 * node + 1]
            free[node] = left if left >= right else right
            node //= 2


def _check_fits(lengths: Sequence[int], capacity: int) -> None:
    if capacity <= 0:
        raise ValueError(f"bin capacity must be a positive number of tokens, got {capacity}")
    for i, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"row {i} has a negative length {length}")
        if length > capacity:
            raise ValueError(
                f"row {i} needs {length} tokens (padded), more than the bin capacity of {capacity}"
            )


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack rows (by padded length) into bins of ``capacity`` tokens, longest first."""
    _check_fits(lengths, capacity)
    packer = _FirstFit(capacity, len(lengths))
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        packer.place(lengths[i], i)
    return packer.bins


class _SortedItems:
    """Rows sorted by (length, index) ascending, with 'largest that fits' lookups."""

    def __init__(self, items: list[tuple[int, int]]) -> None:
        items.sort()
        self.sizes = [s for s, _ in items]
        self.ids = [i for _, i in items]

    def __len__(self) -> int:
        return len(self.sizes)

    def pop_largest_fitting(self, room: int) -> tuple[int, int] | None:
        j = bisect_right(self.sizes, room) - 1
        if j < 0:
            return None
        return self.sizes.pop(j), self.ids.pop(j)

    def pop_smallest(self) -> tuple[int, int]:
        return self.sizes.pop(0), self.ids.pop(0)


def modified_first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Johnson & Garey's MFFD (see module docstring); same contract as ``first_fit_decreasing``."""
    _check_fits(lengths, capacity)
    large: list[tuple[int, int]] = []
    medium: list[tuple[int, int]] = []
    small: list[tuple[int, int]] = []
    tiny: list[tuple[int, int]] = []
    for i, size in enumerate(lengths):  # exact integer comparisons with C/2, C/3, C/6
        if 2 * size > capacity:
            large.append((size, i))
        elif 3 * size > capacity:
            medium.append((size, i))
        elif 6 * size > capacity:
            small.append((size, i))
        else:
            tiny.append((size, i))
    large.sort(key=lambda t: (-t[0], t[1]))
    bins = [[i] for _, i in large]
    room = [capacity - size for size, _ in large]
    has_medium = [False] * len(bins)

    mediums = _SortedItems(medium)
    for b in range(len(bins)):  # forward: largest medium that fits
        got = mediums.pop_largest_fitting(room[b])
        if got is not None:
            bins[b].append(got[1])
            room[b] -= got[0]
            has_medium[b] = True

    smalls = _SortedItems(small)
    for b in reversed(range(len(bins))):  # backward: two smalls into medium-free bins
        if has_medium[b] or len(smalls) < 2 or smalls.sizes[0] + smalls.sizes[1] > room[b]:
            continue
        first = smalls.pop_smallest()
        second = smalls.pop_largest_fitting(room[b] - first[0])
        if second is None:  # cannot happen: the next smallest fits by the check above
            raise RuntimeError("MFFD invariant broken: no second small row fits")
        bins[b] += [first[1], second[1]]
        room[b] -= first[0] + second[0]

    rest = _SortedItems(
        list(zip(mediums.sizes, mediums.ids))
        + list(zip(smalls.sizes, smalls.ids))
        + tiny
    )
    for b in range(len(bins)):  # forward: top up with the largest leftover that fits
        while len(rest):
            got = rest.pop_largest_fitting(room[b])
            if got is None:
                break
            bins[b].append(got[1])
            room[b] -= got[0]

    packer = _FirstFit(capacity, len(rest))  # FFD on whatever is left
    for size, i in sorted(zip(rest.sizes, rest.ids), key=lambda t: (-t[0], t[1])):
        packer.place(size, i)
    return bins + packer.bins


def pack(lengths: Sequence[int], capacity: int, algorithm: str) -> list[list[int]]:
    """Dispatch to the named algorithm (one of ``PACKING_ALGORITHMS``)."""
    if algorithm == "first_fit_decreasing":
        return first_fit_decreasing(lengths, capacity)
    if algorithm == "modified_first_fit_decreasing":
        return modified_first_fit_decreasing(lengths, capacity)
    raise ValueError(
        f"unknown sequence packing algorithm {algorithm!r}; expected one of {PACKING_ALGORITHMS}"
    )


def split_to_multiple(
    bins: list[list[int]], lengths: Sequence[int], multiple: int
) -> list[list[int]]:
    """Add bins until their count is a positive multiple of ``multiple``.

    Each new bin takes the longest row of the multi-row bin holding the most tokens, so no bin
    grows. Only when every bin is down to one row (fewer rows than the needed bin count) are
    the remaining new bins left **empty**: a shard then runs an empty micro-batch at that step.
    """
    target = max(1, -(-len(bins) // multiple)) * multiple
    out = [list(b) for b in bins]
    load = [sum(lengths[i] for i in b) for b in out]
    while len(out) < target:
        multi = [b for b in range(len(out)) if len(out[b]) > 1]
        if not multi:
            out += [[] for _ in range(target - len(out))]
            break
        src = max(multi, key=lambda b: (load[b], -b))
        row = max(out[src], key=lambda i: (lengths[i], -i))
        out[src].remove(row)
        load[src] -= lengths[row]
        out.append([row])
        load.append(lengths[row])
    return out


def deal_round_robin(bin_tokens: Sequence[int], shards: int) -> list[list[int]]:
    """NeMo-RL's dealing: bin ``b`` goes to shard ``b % shards`` (baseline for comparisons)."""
    return [list(range(s, len(bin_tokens), shards)) for s in range(shards)]


def _loads(assignment: list[list[int]], bin_tokens: Sequence[int]) -> list[int]:
    return [sum(bin_tokens[b] for b in shard) for shard in assignment]


def _refine_by_swaps(assignment: list[list[int]], bin_tokens: Sequence[int], rounds: int) -> None:
    """Swap one bin between the heaviest and the lightest shard while that narrows their gap."""
    loads = _loads(assignment, bin_tokens)
    for _ in range(rounds):
        hi = max(range(len(loads)), key=lambda s: (loads[s], -s))
        lo = min(range(len(loads)), key=lambda s: (loads[s], s))
        gap = loads[hi] - loads[lo]
        if gap <= 0:
            return
        lo_sorted = sorted(assignment[lo], key=lambda b: bin_tokens[b])
        lo_tokens = [bin_tokens[b] for b in lo_sorted]
        best: tuple[int, int, int] | None = None  # (new pair max, hi bin, lo bin)
        for a in assignment[hi]:
            j = bisect_right(lo_tokens, bin_tokens[a] - gap / 2)
            for k in (j - 1, j):
                if 0 <= k < len(lo_tokens):
                    delta = bin_tokens[a] - lo_tokens[k]
                    if 0 < delta < gap:
                        new_max = max(loads[hi] - delta, loads[lo] + delta)
                        if best is None or new_max < best[0]:
                            best = (new_max, a, lo_sorted[k])
        if best is None:
            return
        _, a, b = best
        assignment[hi][assignment[hi].index(a)] = b
        assignment[lo][assignment[lo].index(b)] = a
        delta = bin_tokens[a] - bin_tokens[b]
        loads[hi] -= delta
        loads[lo] += delta


def deal_balanced(bin_tokens: Sequence[int], shards: int) -> list[list[int]]:
    """Give each shard ``len(bin_tokens) // shards`` bins, balancing tokens per shard.

    Returns, per shard, bin ids sorted by tokens descending (so data-parallel ranks work on
    similar-sized bins at the same step). The count must divide evenly.
    """
    if len(bin_tokens) % shards:
        raise ValueError(f"{len(bin_tokens)} bins cannot be dealt evenly to {shards} shards")
    quota = len(bin_tokens) // shards
    assignment: list[list[int]] = [[] for _ in range(shards)]
    heap = [(0, s) for s in range(shards)]
    for b in sorted(range(len(bin_tokens)), key=lambda b: (-bin_tokens[b], b)):
        load, s = heapq.heappop(heap)
        assignment[s].append(b)
        if len(assignment[s]) < quota:
            heapq.heappush(heap, (load + bin_tokens[b], s))
    _refine_by_swaps(assignment, bin_tokens, rounds=4 * shards)
    robin = deal_round_robin(bin_tokens, shards)
    if max(_loads(robin, bin_tokens), default=0) < max(_loads(assignment, bin_tokens), default=0):
        assignment = robin
    return [sorted(shard, key=lambda b: (-bin_tokens[b], b)) for shard in assignment]


def equalize_bins(
    bins: list[list[int]], lengths: Sequence[int], capacity: int
) -> list[list[int]]:
    """Re-spread the rows over the same number of bins with near-equal tokens, if they fit.

    Worst-fit decreasing: longest row first, each into the bin with the fewest tokens (ties: fewer
    rows, lower index), so the first ``len(bins)`` rows open distinct bins (no bin is empty when
    there are at least as many rows as bins). If a row does not fit the emptiest bin, the given
    bins are returned unchanged.
    """
    rows = sorted((i for b in bins for i in b), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = [[] for _ in bins]
    heap = [(0, 0, b) for b in range(len(bins))]
    for i in rows:
        load, count, b = heapq.heappop(heap)
        if load + lengths[i] > capacity:
            return bins
        out[b].append(i)
        heapq.heappush(heap, (load + lengths[i], count + 1, b))
    return out


def pack_for_shards(
    lengths: Sequence[int],
    capacity: int,
    algorithm: str,
    shards: int,
    balance: bool = True,
    equalize: bool = True,
) -> list[list[list[int]]]:
    """Pack one global batch and deal its bins: ``result[shard][k]`` is the k-th bin (row ids).

    The algorithm fixes how many bins are needed (rounded up to a multiple of ``shards``);
    ``equalize`` then evens their tokens (``equalize_bins``) and ``balance`` deals them by tokens
    (``deal_balanced``). Every shard gets the same number of bins; a bin is empty only when the
    global batch has fewer rows than bins (see ``split_to_multiple``). ``balance=False``
    and ``equalize=False`` is NeMo-RL's round-robin (kept for benchmarks and tests).
    """
    packed = split_to_multiple(pack(lengths, capacity, algorithm), lengths, shards)
    bins = equalize_bins(packed, lengths, capacity) if equalize else packed
    tokens = [sum(lengths[i] for i in b) for b in bins]
    dealt = deal_balanced(tokens, shards) if balance else deal_round_robin(tokens, shards)
    if balance and bins is not packed:  # never above NeMo-RL's heaviest shard
        packed_tokens = [sum(lengths[i] for i in b) for b in packed]
        robin = deal_round_robin(packed_tokens, shards)
        if max(_loads(robin, packed_tokens)) < max(_loads(dealt, tokens)):
            bins, dealt = packed, robin
    return [[bins[b] for b in shard] for shard in dealt]


ShardPlan = tuple[list[list[tuple[int, int]]], list[list[int]], list[int]]


def plan_packed_shards(
    lengths: Sequence[int],
    shards: int,
    batch_size: int,
    capacity: int,
    algorithm: str,
    pad_multiple: int = 1,
    lengths_key: str = "input_lengths",
    balance: bool = True,
    equalize: bool = True,
) -> tuple[list[list[int]], list[ShardPlan]]:
    """Pack every global batch of ``batch_size`` rows and deal its bins to ``shards``.

    Row ``i`` occupies ``padded_length(lengths[i], pad_multiple)`` tokens of a bin of
    ``capacity`` tokens. Returns ``(rows, plans)``: ``rows[s]`` the row ids of shard ``s`` (bin
    after bin, global batch after global batch); ``plans[s] = (ranges, tokens, counts)`` with,
    per global batch ``g``, the shard-local ``(start, end)`` row range of each bin, its padded
    tokens, and the shard's row count. ``lengths_key`` only names the column in errors. No rows
    make no global batch (``batch_size`` may then be 0): every shard is empty, its plan empty.
    """
    if algorithm not in PACKING_ALGORITHMS:
        raise ValueError(
            f"unknown sequence packing algorithm {algorithm!r}; expected one of {PACKING_ALGORITHMS}"
        )
    padded = [padded_length(n, pad_multiple) for n in lengths]
    for i, n in enumerate(padded):
        if n > capacity:
            raise ValueError(
                f"row {i} has {lengths_key}={lengths[i]} (padded to {n} with "
                f"sequence_length_pad_multiple={pad_multiple}), more than "
                f"max_tokens_per_microbatch={capacity}"
            )
    rows: list[list[int]] = [[] for _ in range(shards)]
    plans: list[ShardPlan] = [([], [], []) for _ in range(shards)]
    totals = [0] * shards
    if not padded:
        return rows, plans
    for off in range(0, len(padded), batch_size):
        gb = padded[off : off + batch_size]
        groups = pack_for_shards(gb, capacity, algorithm, shards, balance, equalize)
        if balance:  # heaviest group to the shard with the fewest tokens so far (whole-batch balance)
            weight = [sum(gb[i] for b in g for i in b) for g in groups]
            order = sorted(range(shards), key=lambda k: (-weight[k], k))
            lightest = sorted(range(shards), key=lambda s: (totals[s], s))
            placed: list[list[list[int]]] = [[] for _ in range(shards)]
            for k, s in zip(order, lightest):
                placed[s] = groups[k]
                totals[s] += weight[k]
            groups = placed
        for s, bins in enumerate(groups):
            ranges, tokens, start = [], [], 0
            for b in bins:
                rows[s] += [off + i for i in b]
                ranges.append((start, start + len(b)))
                tokens.append(sum(gb[i] for i in b))
                start += len(b)
            plans[s][0].append(ranges)
            plans[s][1].append(tokens)
            plans[s][2].append(start)
    return rows, plans
