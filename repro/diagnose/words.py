"""Sorting a captured graph's words against the caching allocator.

Every 8-byte aligned parameter word in the user-space address range may be a device address.
With a snapshot taken at capture, Matcher matches each to its block at once. Without one (the
usual way: an engine captures thousands of graphs), Deferred sorts each by the pool of its
segment (allocator.PoolMap): words in the graph's own pool and words outside the allocator are
counted, the rest kept as the census's pending words. At the first check match_pending turns
those into references, as the allocator saw them at capture: from the allocator then and the
first alloc or free touching each word since the census (first_touches, over trace_index.py).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from repro.diagnose.allocator import DEFAULT_POOL, Block, BlockIndex, BlockState, PoolMap
from repro.diagnose.captured import GraphCensus, Reference, Word
from repro.diagnose.cuda_driver import NodeKind
from repro.diagnose.trace_index import FREE_ACTIONS, first_from

if TYPE_CHECKING:  # annotations only: torch is imported where the words are sorted as arrays
    import torch

WORD = 8  # device addresses are 64-bit, naturally aligned
# User-space virtual addresses on x86-64/aarch64 Linux: a word outside this range is no pointer.
MIN_ADDR, MAX_ADDR = 1 << 32, 1 << 48
SMALL_GRAPH_WORDS = 8192  # up to this, a graph's words are sorted one by one


def plausible_words(buf: bytes, base: int) -> tuple[int, list[tuple[int, int]]]:
    """(how many aligned words buf holds, (offset, value) of those that may be device
    addresses): the filter runs over every word of every kernel of every graph, so it is one
    comprehension over a memoryview, and only the survivors become tuples."""
    first = -base % WORD
    n = (len(buf) - first) // WORD
    if n <= 0:
        return 0, []
    values = memoryview(buf)[first : first + n * WORD].cast("Q")  # little-endian hosts only
    at = base + first
    return n, [(at + WORD * i, v) for i, v in enumerate(values) if MIN_ADDR <= v < MAX_ADDR]


def plausible_address(value: int) -> bool:
    return MIN_ADDR <= value < MAX_ADDR


class Chunks:
    """The kernel parameter bytes of one graph, node by node, kept 8-byte aligned so that all of
    them can be read as one array of words: a full decoder graph holds ~70,000 words, and sorting
    them one by one in Python was most of a census's cost."""

    def __init__(self):
        self.bufs: list[bytes] = []
        self.starts: list[int] = []  # index of each chunk's first word in the whole
        self.meta: list[tuple[int, str, int, Any]] = []  # (node, kernel, offset of its first word, where_of)
        self.words = 0

    def add(self, node: int, kernel: str, buf: bytes, base: int, where_of: Any) -> int:
        """buf: parameter bytes at offset base of the node's parameter buffer; returns how many
        aligned words it holds."""
        first = -base % WORD
        n = (len(buf) - first) // WORD
        if n <= 0:
            return 0
        self.bufs.append(buf[first : first + n * WORD] if first or len(buf) != n * WORD else buf)
        self.starts.append(self.words)
        self.meta.append((node, kernel, base + first, where_of))
        self.words += n
        return n

    def each(self) -> Any:
        """(node, kernel, where_of, [(offset, value)] of its plausible words) per chunk."""
        for buf, (node, kernel, at, where_of) in zip(self.bufs, self.meta):
            _, words = plausible_words(buf, at)
            yield node, kernel, where_of, words

    def locate(self, word: int) -> tuple[int, str, int, Any]:
        """(node, kernel, offset, where_of) of the word at this index of the whole."""
        c = bisect.bisect_right(self.starts, word) - 1
        node, kernel, at, where_of = self.meta[c]
        return node, kernel, at + WORD * (word - self.starts[c]), where_of


@dataclass
class Matcher:
    """Sorts captured words into references, own-pool references and outside addresses."""

    index: BlockIndex
    own_pool: tuple[int, int] | None
    pool_names: dict[tuple[int, int], str]
    is_device_address: Any = None  # callable(int) -> bool, or None: count nothing outside

    def add(
        self, census: GraphCensus, node: int, kind: NodeKind, kernel: str, where: str, offset: int, value: int
    ) -> None:
        if not plausible_address(value):
            return
        block = self.index.find(value)
        if block is None:
            if self.is_device_address is not None and self.is_device_address(value):
                census.outside += 1
            return
        if self.own_pool is not None and block.pool == self.own_pool:
            census.own_pool += 1
            return
        if not block.live:
            # Free before the capture ended: no kernel of this graph can have been given it.
            # Such words are stale host bytes baked into a struct (unused array slots of
            # torch's TensorInfo hold them), so they are counted, not checked.
            census.free_at_capture += 1
            return
        if block.pool != DEFAULT_POOL:
            name = self.pool_names.get(block.pool, f"pool {block.pool}")
            census.foreign_pools[name] = census.foreign_pools.get(name, 0) + 1
        census.references.append(
            Reference(node=node, kind=kind, kernel=kernel, where=where, offset=offset, addr=value, block=block)
        )

    def add_words(
        self, census: GraphCensus, node: int, kind: NodeKind, kernel: str, words: list[tuple[int, int]], where_of: Any
    ) -> None:
        for offset, value in words:
            self.add(census, node, kind, kernel, where_of(offset), offset, value)

    def add_chunks(self, census: GraphCensus, chunks: Chunks) -> None:
        for node, kernel, where_of, words in chunks.each():
            self.add_words(census, node, NodeKind.KERNEL, kernel, words, where_of)


# Past a size torch spreads a host op over its thread pool (elementwise ops and nonzero: 32,768
# elements, at::internal::GRAIN_SIZE in ATen/Parallel.h; searchsorted: 200 searches,
# SEARCHSORTED_GRAIN_SIZE in ATen/native/Bucketization.cpp). Inside an engine's capture phase that cost milliseconds
# per op (a 75,000-word mask and nonzero: 7 ms per graph in the watched engine, 0.4 ms alone; in
# 16,384-word slices 0.9 ms), so the census's arrays go through in slices below those sizes,
# on the calling thread.
SERIAL_ELEMENTS = 16384
SERIAL_SEARCHES = 192  # below SEARCHSORTED_GRAIN_SIZE (200)
# Indexing a tensor by positions goes to the thread pool past 3,000 of them
# (index_parallel_grain_size in ATen/native/cpu/IndexKernelUtils.h): a slice of a full decoder
# graph holds ~3,800 plausible words, and on a busy 2-core machine each such gather waited
# ~8 ms for the pool (a census of 1,056 kernels: ~80 ms instead of ~7).
SERIAL_GATHERS = 2048


def segment_positions(torch: Any, starts: Any, v: Any) -> Any:
    """searchsorted(starts, v, right=True), in slices."""
    if v.numel() <= SERIAL_SEARCHES:
        return torch.searchsorted(starts, v, right=True)
    return torch.cat(
        [
            torch.searchsorted(starts, v[i : i + SERIAL_SEARCHES], right=True)
            for i in range(0, v.numel(), SERIAL_SEARCHES)
        ]
    )


def take(torch: Any, source: Any, index: Any) -> Any:
    """source[index] (index: int64 positions), in slices."""
    if index.numel() <= SERIAL_GATHERS:
        return source[index]
    return torch.cat([source[index[i : i + SERIAL_GATHERS]] for i in range(0, index.numel(), SERIAL_GATHERS)])


def positions(mask: Any) -> Any:
    """The positions where a 1-d bool tensor is True (nonzero runs on the calling thread below
    SERIAL_ELEMENTS, where boolean indexing would gather through the thread pool)."""
    return mask.nonzero().squeeze(1)


@dataclass
class Deferred:
    """Sorts captured words by pool at capture time, with no snapshot: own-pool words are
    counted, words outside the allocator counted, the rest kept to match at the first check."""

    pools: PoolMap
    own_pool: tuple[int, int] | None
    is_device_address: Any = None  # callable(int) -> bool, or None: count nothing outside
    small: int = SMALL_GRAPH_WORDS  # graphs of up to this many words: sorted word by word
    # Words outside the allocator set aside in census.unasked, to be asked of the driver later
    # for many graphs at once (ask_outside), not per graph here: counting them per graph was a
    # fifth of the sort (CPU bench, a fifth of struct words host pointers), and they are a
    # statistic of the records, not a finding.
    ask_later: bool = False

    def add(
        self, census: GraphCensus, node: int, kind: NodeKind, kernel: str, where: str, offset: int, value: int
    ) -> None:
        if plausible_address(value):
            self.sort(census, node, kind, kernel, offset, value, lambda _: where)

    def sort(
        self, census: GraphCensus, node: int, kind: NodeKind, kernel: str, offset: int, value: int, where_of: Any
    ) -> None:
        """One plausible word: counted (own pool, outside the allocator) or kept as pending;
        where_of(offset) -> "param 3 +8" is made only for the words kept."""
        seg = self.pools.find(value)  # the map is current: take_census checked it
        self.sort_found(census, node, kind, kernel, offset, value, where_of, seg)

    def sort_found(
        self,
        census: GraphCensus,
        node: int,
        kind: NodeKind,
        kernel: str,
        offset: int,
        value: int,
        where_of: Any,
        seg: tuple[int, int, tuple[int, int]] | None,
    ) -> None:
        """sort() of a word whose segment was already looked up (seg: PoolMap.find's answer)."""
        if seg is None:
            if self.is_device_address is not None and self.is_device_address(value):
                census.outside += 1
            return
        if self.own_pool is not None and seg[2] == self.own_pool:
            census.own_pool += 1
            if seg[0] not in census.own_segments:
                block = self.pools.segment_block(seg)
                census.own_segments[seg[0]] = Reference(node, kind, kernel, where_of(offset), offset, value, block)
            return
        census.pending.append(Word(node, kind, kernel, where_of(offset), offset, value, seg[2]))

    def add_chunks(self, census: GraphCensus, chunks: Chunks) -> None:
        """add() for every kernel word of a graph at once, as arrays (torch on the host).

        A small graph's plausible words (a piece of a piecewise engine: ~25 kernels, ~360 such
        words) are then sorted one by one: the pool search's ~20 tensor ops cost more there
        than the words themselves. A large graph's go through the search in slices of
        SERIAL_ELEMENTS words: only those outside the own pool become Python objects, and
        where_of(offset) is made for those alone."""
        if not chunks.words:
            return
        import torch

        values = torch.frombuffer(bytearray().join(chunks.bufs), dtype=torch.int64)
        if chunks.words <= min(self.small, SERIAL_ELEMENTS):
            at = positions((values >= MIN_ADDR) & (values < MAX_ADDR))
            self.sort_each(census, chunks, at.tolist(), take(torch, values, at).tolist())
            return
        for first in range(0, chunks.words, SERIAL_ELEMENTS):
            self.sort_slice(torch, census, chunks, values[first : first + SERIAL_ELEMENTS], first)

    def sort_slice(self, torch: Any, census: GraphCensus, chunks: Chunks, values: Any, first: int) -> None:
        """The array path for the graph's words from index first on (values: at most
        SERIAL_ELEMENTS of them)."""
        at = positions((values >= MIN_ADDR) & (values < MAX_ADDR))
        if not at.numel():
            return
        v = take(torch, values, at)
        at = at + first  # positions in the whole graph's words
        starts, ends, pool_ix, pools = self.pools.arrays()
        if starts.numel():
            seg = segment_positions(torch, starts, v) - 1
            seg_c = seg.clamp(min=0)
            inside = (seg >= 0) & (v < take(torch, ends, seg_c))
        else:
            seg_c = torch.zeros_like(v)
            inside = torch.zeros(v.shape, dtype=torch.bool)
        own = torch.zeros_like(inside)
        if self.own_pool is not None and self.own_pool in pools:
            own = inside & (take(torch, pool_ix, seg_c) == pools.index(self.own_pool))
            census.own_pool += int(own.sum())
            self.note_own_segments(census, chunks, at, v, seg_c, own)
        if self.is_device_address is not None:
            self.count_outside(census, take(torch, v, positions(~inside)))
        rest = positions(inside & ~own)
        pool_of_seg = self.pools.segments
        pending = census.pending
        words, kept, segs = (take(torch, t, rest).tolist() for t in (at, v, seg_c))
        for word, value, s in zip(words, kept, segs):
            node, kernel, offset, where_of = chunks.locate(word)
            pending.append(Word(node, NodeKind.KERNEL, kernel, where_of(offset), offset, value, pool_of_seg[s][2]))

    def sort_each(self, census: GraphCensus, chunks: Chunks, at: list[int], values: list[int]) -> None:
        """sort() each plausible word (at: its index in the graph's words); the common one (own
        pool, in a segment already noted) is counted inline."""
        own_pool, noted, own = self.own_pool, census.own_segments, 0
        segs = self.pools.find_all(values)
        if self.is_device_address is not None:
            # Most plausible words are outside the allocator (host pointers, stale bytes): asked
            # per 2 MiB page at once, as the array path does, not a call per word.
            import torch

            outside = [value for value, seg in zip(values, segs) if seg is None]
            if outside:
                self.count_outside(census, torch.tensor(outside, dtype=torch.int64))
        for i, value, seg in zip(at, values, segs):
            if seg is None:
                continue
            if seg[2] == own_pool and seg[0] in noted:
                own += 1
            else:
                node, kernel, offset, where_of = chunks.locate(i)
                self.sort_found(census, node, NodeKind.KERNEL, kernel, offset, value, where_of, seg)
        census.own_pool += own

    def count_outside(self, census: GraphCensus, values: torch.Tensor) -> None:
        """Words outside every allocator segment (values, int64): counted into census.outside
        where the driver knows them as device addresses, now or (ask_later) by ask_outside."""
        if not values.numel():
            return
        if self.ask_later:
            census.unasked.append(values)
        else:
            census.outside += device_address_counts([[values]], self.is_device_address)[0]

    def note_own_segments(
        self,
        census: GraphCensus,
        chunks: Chunks,
        at: torch.Tensor,
        v: torch.Tensor,
        seg: torch.Tensor,
        own: torch.Tensor,
    ) -> None:
        """The first word of each own-pool segment the graph reads (a segment released while
        the graph lives is a finding)."""
        import torch

        own_at = positions(own)
        segs, which = torch.unique(take(torch, seg, own_at), return_inverse=True)
        each = segs.tolist()
        segments, noted = self.pools.segments, census.own_segments
        if all(segments[s][0] in noted for s in each):
            return  # past a graph's first slice, the usual case: no first words to find
        # The first own word of each segment: the least position among the words in it.
        first = torch.full(segs.shape, len(own_at), dtype=torch.int64).scatter_reduce_(
            0, which, torch.arange(len(own_at)), reduce="amin"
        )
        # Indexing a tensor from Python costs microseconds: pick the rows with tensors, then read
        # them as lists (a piecewise engine makes thousands of small graphs).
        rows = take(torch, own_at, first)
        for s, word, value in zip(each, take(torch, at, rows).tolist(), take(torch, v, rows).tolist()):
            start = segments[s][0]
            if start in noted:
                continue
            node, kernel, offset, where_of = chunks.locate(word)
            block = self.pools.segment_block(segments[s])
            noted[start] = Reference(node, NodeKind.KERNEL, kernel, where_of(offset), offset, value, block)


def device_address_counts(groups: list[list[torch.Tensor]], is_device_address: Any) -> list[int]:
    """How many words of each group (int64 tensors) the driver knows as device addresses:
    asked once per 2 MiB page of all the groups together (as is_device_address caches), with
    the page's lowest word, not once per word (a decoder graph holds thousands of int pairs
    that look like addresses)."""
    import torch

    sizes = [sum(t.numel() for t in group) for group in groups]
    if not sum(sizes):
        return [0] * len(groups)
    values = torch.cat([t for group in groups for t in group])
    pages, which = torch.unique(values >> 21, return_inverse=True)
    lowest = torch.full(pages.shape, MAX_ADDR, dtype=torch.int64).scatter_reduce_(0, which, values, reduce="amin")
    device = torch.tensor([bool(is_device_address(v)) for v in lowest.tolist()], dtype=torch.bool)
    group = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor(sizes))
    return torch.bincount(group[device[which]], minlength=len(groups)).tolist()


def ask_outside(censuses: list[GraphCensus], is_device_address: Any) -> None:
    """Count the words these censuses set aside outside the allocator (census.unasked: Deferred
    with ask_later) into their outside, asking the driver once per page for all of them."""
    waiting = [c for c in censuses if c.unasked]
    for census, n in zip(waiting, device_address_counts([c.unasked for c in waiting], is_device_address)):
        census.outside += n
        census.unasked = []


def match_pending(
    census: GraphCensus,
    now: BlockIndex,
    first: dict[int, dict[str, Any]] | None,
    pool_names: dict[tuple[int, int], str],
) -> None:
    """Turn the census's pending words into references, as the allocator saw them at capture.

    The allocator now, and its trace since the census, tell what each word's memory was then:
    still the same block (live, no free since), a block freed or freed and taken again since
    (a reference with that fate), a block already free at capture (stale bytes in a struct:
    counted, not a reference), or a segment released since. When the trace no longer reaches
    the census, a free block cannot be told from one that was free at capture: counted, noted.
    first: address -> the first alloc or free touching it since the census (first_touches);
    None when the trace no longer reaches the census.
    """
    lost = 0
    traced = first is not None
    first = first or {}
    for w in census.pending:
        current = now.find(w.addr)
        block = captured_block(w, current, first.get(w.addr), traced)
        if block is None:
            if not traced and current is None:
                census.outside += 1
            elif not traced:
                lost += 1
                census.free_at_capture += 1
            else:
                census.free_at_capture += 1
            continue
        if block.pool == census.pool and census.pool is not None:
            census.own_pool += 1
            continue
        if block.pool != DEFAULT_POOL:
            name = pool_names.get(block.pool, f"pool {block.pool}")
            census.foreign_pools[name] = census.foreign_pools.get(name, 0) + 1
        census.references.append(
            Reference(
                node=w.node, kind=w.kind, kernel=w.kernel, where=w.where, offset=w.offset, addr=w.addr, block=block
            )
        )
    census.pending = []
    if lost:
        census.notes.append(
            f"The allocator trace no longer reaches the capture: {lost} captured words "
            "into free blocks could not be told from stale struct bytes (not checked)."
        )


def first_touches(
    words: list[Word], trace: list[dict[str, Any]], points: dict[int, list[int]], start: int | None
) -> dict[int, dict[str, Any]] | None:
    """address -> the first alloc or free since position `start` whose allocation holds it,
    for the words' addresses; points: entries_at_points over (at least) those addresses, so
    many censuses share one pass over the trace. None when start is (the trace is lost)."""
    if start is None:
        return None
    first = {}
    for a in {w.addr for w in words}:
        positions = points.get(a)
        if positions:
            p = first_from(positions, start)
            if p is not None:
                first[a] = trace[p]
    return first


def captured_block(w: Word, current: Block | None, first: dict[str, Any] | None, traced: bool) -> Block | None:
    """The allocator block w pointed into at capture, or None (free then, or not allocator memory).

    The first alloc or free touching w since the census decides: a free means w's memory was
    allocated at capture (that allocation is the captured block), an alloc that it was free.
    Without the trace (traced False) a live block is taken as the captured one.
    """
    if first is not None and first["action"] in FREE_ACTIONS:
        return Block(
            start=first["addr"],
            size=first.get("size", 0),
            state=BlockState.ACTIVE_ALLOCATED,
            pool=w.pool,
            segment=current.segment if current else first["addr"],
        )
    if first is not None or current is None or not current.live:
        return None
    return current
