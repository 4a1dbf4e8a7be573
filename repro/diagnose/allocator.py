"""torch's caching allocator as the census reads it: its blocks, its segments by pool, its counters.

Snapshots are plain dicts in torch's documented format (``torch.cuda.memory._snapshot()``:
segments with their blocks), so what reads one runs without torch or a GPU. What asks torch
itself (take_snapshot, take_segments, allocator_counters, start_trace: the alloc/free trace
trace_index.py reads, with each allocation's stack where asked) imports it when called:
importing this module needs no torch.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from enum import StrEnum
from collections.abc import Callable
from itertools import repeat
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: importing this module needs no torch
    import torch

# Allocator trace kept while censuses are live. Without stacks an entry is small, but every
# snapshot copies the whole ring, so it is bounded to keep a check within milliseconds.
TRACE_ENTRIES = 8192
DEFAULT_POOL = (0, 0)
SEEN_LIMIT = 1 << 20  # addresses PoolMap remembers between refreshes
_UNSEEN = object()  # PoolMap.find_all: an address not remembered yet


class BlockState(StrEnum):
    """A caching-allocator block's "state" in torch's memory snapshot."""

    ACTIVE_ALLOCATED = "active_allocated"  # used by a tensor
    ACTIVE_PENDING_FREE = "active_pending_free"  # freed, waiting for its streams' events
    ACTIVE_AWAITING_FREE = "active_awaiting_free"  # the same, as torch's memory.py documents it
    INACTIVE = "inactive"  # free, cached


# States whose memory no tensor holds any more.
INACTIVE_STATES = frozenset((BlockState.INACTIVE, BlockState.ACTIVE_PENDING_FREE, BlockState.ACTIVE_AWAITING_FREE))
# torch's word -> member by a dict lookup (a snapshot has thousands of blocks; BlockState(word)
# costs ten times as much). A state this module does not know stays torch's word, and is live.
_BLOCK_STATES = {s.value: s for s in BlockState}


@dataclass(frozen=True)
class Block:
    """One caching-allocator block, from a snapshot."""

    start: int
    size: int
    state: BlockState | str  # torch's word; one BlockState does not know stays a str
    pool: tuple[int, int]  # segment_pool_id; (0, 0) is the default pool
    segment: int  # start address of its segment

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def live(self) -> bool:
        return self.state not in INACTIVE_STATES


def blocks_of(snapshot: dict[str, Any], device: int | None = None) -> list[Block]:
    """Every block of every segment (of one device when given), sorted by start address.

    torch >= 2.1 gives each block its "address"; older snapshots list blocks in address order
    from the segment start, so the address is the running sum.
    """
    out = []
    for seg in snapshot.get("segments", []):
        if device is not None and seg.get("device", device) != device:
            continue
        pool = tuple(seg.get("segment_pool_id") or DEFAULT_POOL)
        addr = seg["address"]
        for b in seg.get("blocks", []):
            start = b.get("address", addr)
            state = b.get("state", BlockState.INACTIVE)
            out.append(
                Block(
                    start=start,
                    size=b["size"],
                    state=_BLOCK_STATES.get(state, state),
                    pool=(int(pool[0]), int(pool[1])),
                    segment=seg["address"],
                )
            )
            addr = start + b["size"]
    out.sort(key=lambda b: b.start)
    return out


class BlockIndex:
    """Address -> block lookup by bisection over one snapshot's blocks."""

    def __init__(self, blocks: list[Block]):
        self.blocks = blocks
        self.starts = [b.start for b in blocks]

    @classmethod
    def of(cls, snapshot: dict[str, Any], device: int | None = None) -> BlockIndex:
        return cls(blocks_of(snapshot, device))

    def find(self, addr: int) -> Block | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i >= 0 and addr < self.blocks[i].end:
            return self.blocks[i]
        return None


class PoolMap:
    """Address -> graph pool of its segment, from the allocator's segments: a segment belongs
    to one pool for its whole life, so the map is read again only when segments came or went
    (the allocator's own counters say so) or an address falls outside every known segment."""

    def __init__(self, device: int | None = None):
        self.device = device
        self.starts: list[int] = []
        self.segments: list[tuple[int, int, tuple[int, int]]] = []  # (start, end, pool)
        self.signature: tuple | None = None
        self.refreshes = 0
        self.seconds = 0.0  # spent in check(): the counters read, and the segments when read again
        self.events: int | None = None  # allocator_events() as of the last check()
        self.seen: dict[int, Any] = {}  # address -> its segment (or None), until the next refresh
        self._arrays: tuple | None = None  # the segments as tensors (Deferred.add_chunks)
        self._blocks: dict[int, Block] = {}  # segment start -> the segment as one block (segment_block)

    def pool_of(self, addr: int) -> tuple[int, int] | None:
        """The pool of the segment holding addr (DEFAULT_POOL for ordinary memory), or None
        outside every segment of the caching allocator, as of the last check()."""
        found = self.find(addr)
        return None if found is None else found[2]

    def graph_pool_of(self, addr: int) -> tuple[int, int] | None:
        """The graph pool (private or shared, MemPool included) holding addr; None for the
        ordinary default pool and for memory outside the allocator."""
        pool = self.pool_of(addr)
        return None if pool is None or pool == DEFAULT_POOL else pool

    def segment_of(self, addr: int) -> int | None:
        found = self.find(addr)
        return None if found is None else found[0]

    def find(self, addr: int) -> tuple[int, int, tuple[int, int]] | None:
        found = self.seen.get(addr, self)
        if found is not self:
            return found
        i = bisect.bisect_right(self.starts, addr) - 1
        found = self.segments[i] if i >= 0 and addr < self.segments[i][1] else None
        if len(self.seen) < SEEN_LIMIT:
            self.seen[addr] = found  # graphs of one engine read the same weights, again and again
        return found

    def find_all(self, addrs: list[int]) -> list[tuple[int, int, tuple[int, int]] | None]:
        """find() of each address. The remembered ones are looked up in one pass in C (the
        graphs of an engine read the same addresses again and again: a piecewise engine's
        graphs hold ~450 such words each, and a Python call per word was most of a small
        census); the others go through find()."""
        found = list(map(self.seen.get, addrs, repeat(_UNSEEN)))
        for i in [i for i, seg in enumerate(found) if seg is _UNSEEN]:
            found[i] = self.find(addrs[i])
        return found

    def segment_block(self, seg: tuple[int, int, tuple[int, int]]) -> Block:
        """A segment of the map as one allocated block (what a census notes of its own pool's
        segments). Blocks are immutable: one per segment serves every graph until the
        segments change."""
        block = self._blocks.get(seg[0])
        if block is None:
            block = self._blocks[seg[0]] = Block(
                start=seg[0], size=seg[1] - seg[0], state=BlockState.ACTIVE_ALLOCATED, pool=seg[2], segment=seg[0]
            )
        return block

    def check(self) -> None:
        """Before a census: read the segments again if the allocator says they changed. One
        read of the allocator's counters serves both (and sets self.events)."""
        t0 = time.perf_counter()
        signature, self.events = allocator_counters(self.device)
        if self.signature is None or signature is None or signature != self.signature:
            self.refresh(signature=signature)
        self.seconds += time.perf_counter() - t0

    def stale(self) -> bool:
        return segment_signature(self.device) != self.signature

    def refresh(self, snapshot: dict[str, Any] | None = None, signature: tuple | None = None) -> None:
        self.signature = signature or segment_signature(self.device)
        if snapshot is None:
            snapshot, self.device = take_segments()
        self.segments = sorted(
            (
                seg["address"],
                seg["address"] + seg["total_size"],
                tuple(int(x) for x in (seg.get("segment_pool_id") or DEFAULT_POOL)),
            )
            for seg in snapshot.get("segments", [])
            if self.device is None or seg.get("device", self.device) == self.device
        )
        self.starts = [seg[0] for seg in self.segments]
        self.seen = {}
        self._arrays = None
        self._blocks = {}
        self.refreshes += 1

    def arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
        """(segment starts, ends, pool index of each, the pools) as int64 tensors, sorted by
        start: the segments to sort a graph's words by in one search."""
        if self._arrays is None:
            import torch

            pools = sorted({seg[2] for seg in self.segments})
            self._arrays = (
                torch.tensor([seg[0] for seg in self.segments], dtype=torch.int64),
                torch.tensor([seg[1] for seg in self.segments], dtype=torch.int64),
                torch.tensor([pools.index(seg[2]) for seg in self.segments], dtype=torch.int64),
                pools,
            )
        return self._arrays


def allocator_counters(device: int | None = None) -> tuple[tuple | None, int | None]:
    """(segment signature, trace events) from one read of torch's allocator counters (a nested
    dict of some hundred entries: read once per capture, not once per question).

    signature: counters that change whenever a segment is made, freed or grown; events: about
    how many entries the allocator's trace gained so far (allocs, two per free, segment
    changes), which tells when pending words must be matched before the bounded trace forgets
    their capture. (None, None) where the counters cannot be read."""
    try:
        import torch

        stats = torch._C._cuda_memoryStats(torch.cuda.current_device() if device is None else device)
        alloc, seg, reserved = stats["allocation"]["all"], stats["segment"]["all"], stats["reserved_bytes"]["all"]
    except Exception:
        return None, None  # unknown: every check reads the segments again
    return (
        (seg["allocated"], seg["freed"], reserved["current"], reserved["allocated"], reserved["freed"]),
        alloc["allocated"] + 2 * alloc["freed"] + seg["allocated"] + seg["freed"],
    )


def allocator_events(device: int | None = None) -> int | None:
    return allocator_counters(device)[1]


def segment_signature(device: int | None) -> tuple | None:
    return allocator_counters(device)[0]


def take_snapshot() -> tuple[dict[str, Any], int]:
    """(allocator snapshot of the current device, that device's index)."""
    import torch

    device = torch.cuda.current_device()
    return torch.cuda.memory._snapshot(device), device


def take_segments() -> tuple[dict[str, Any], int]:
    """take_snapshot() without the trace, where this torch can leave it out: the segment map
    needs segments only, and copying the trace ring (8,192 entries) is most of a snapshot's
    cost. An engine's capture phase reads the segments again after most captures (its shared
    pool grows)."""
    import torch

    try:
        segments = torch._C._cuda_memorySnapshot((0, 0, False))["segments"]  # (pool 0 0: all; no trace)
    except (TypeError, RuntimeError, AttributeError, KeyError):
        return take_snapshot()  # a torch whose snapshot always copies the trace
    return {"segments": segments}, torch.cuda.current_device()


def start_trace(max_entries: int = TRACE_ENTRIES, stacks: bool = False) -> None:
    """Record the allocator's alloc/free trace; process-wide. The one place the watch hooks and
    the census start it (calling it again with the same settings keeps what was recorded).

    stacks: each allocation also records its Python stack (context "alloc"): the live blocks of a
    snapshot then carry their "frames" (AllocationStacks), at a stack walk per allocation.
    Without, no entry gathers a stack (cheap).

    Do not call when memory history with stacks is already recording (repro --forensics): that
    recording serves the census as well, and this call would replace its settings.
    """
    import torch

    # stacks="python" is the lighter choice of what a gathered stack holds (context None gathers
    # none): a python stack holds code objects, never frames.
    torch.cuda.memory._record_memory_history(
        enabled="all", context="alloc" if stacks else None, stacks="python", max_entries=max_entries
    )


class AllocationStacks:
    """Address -> the Python stack recorded when the live block holding it was allocated
    (start_trace(stacks=True)), from one read of the allocator's segments, taken at the first
    question: a capture whose storages all had slots already reads nothing.

    Blocks carry their allocation's frames for as long as they stay allocated, whatever the
    bounded trace forgot since; a block allocated before the recording started has none.
    read: () -> (snapshot, device), take_segments by default.
    """

    def __init__(self, read: Callable[[], tuple[dict[str, Any], int]] | None = None):
        self.read = read or take_segments
        self.starts: list[int] | None = None
        self.blocks: list[tuple[int, int, list[dict[str, Any]]]] = []

    def frames_at(self, addr: int) -> list[dict[str, Any]]:
        """Innermost first ({"filename", "line", "name"}); [] where none was recorded."""
        if self.starts is None:
            self.blocks = stacked_blocks(self.read()[0])
            self.starts = [b[0] for b in self.blocks]
        i = bisect.bisect_right(self.starts, addr) - 1
        if i >= 0 and addr < self.blocks[i][1]:
            return self.blocks[i][2]
        return []


def stacked_blocks(snapshot: dict[str, Any]) -> list[tuple[int, int, list[dict[str, Any]]]]:
    """(start, end, frames) of every allocated block with recorded frames, sorted by start.
    Every device's: device addresses are unique in the process (unified addressing)."""
    out = []
    for seg in snapshot.get("segments", []):
        addr = seg["address"]
        for b in seg.get("blocks", []):
            start = b.get("address", addr)
            addr = start + b["size"]
            if b.get("frames") and b.get("state") == BlockState.ACTIVE_ALLOCATED:
                out.append((start, addr, b["frames"]))
    out.sort(key=lambda b: b[0])
    return out


def pool_id(pool: Any) -> tuple[int, int] | None:
    if pool is None:
        return None
    try:
        a, b = pool
        return int(a), int(b)
    except (TypeError, ValueError):
        return None
