"""Graph census: read what a captured CUDA graph really touches, and check it against the allocator.

The stale-capture guard (repro/diagnose/guard.py) sees tensors at the PyTorch dispatcher. A captured
graph can hold addresses the dispatcher never saw: raw Triton launches, C++/CUDA extensions
that take raw pointers, library-internal buffers (cuBLAS/cuBLASLt workspaces), pointers packed
inside parameter structs. The census reads the graph itself through the CUDA driver API and
matches every address-sized word in it against the caching allocator's blocks.

API (all CUDA work is lazy: importing this module needs neither CUDA nor a driver):

  census_supported() -> (ok, reason)
      CUDA is available, libcuda can be loaded, and this torch has
      ``torch.cuda.CUDAGraph(keep_graph=True)`` / ``raw_cuda_graph()``. reason says what is missing.

  take_census(graph, label, pool=None, snapshot=None, pools=None) -> GraphCensus
      Call after capture_end on a graph made with ``CUDAGraph(keep_graph=True)`` (before or after
      ``graph.instantiate()``: the raw graph is kept either way). Reads every node: for kernel
      nodes the whole parameter buffer (per-parameter offsets and sizes from
      ``cuFuncGetParamInfo`` / ``cuKernelGetParamInfo``, or the single ``extra`` buffer that
      cuBLASLt's kernels pass), for memcpy/memset nodes their device pointers; child graphs are
      walked. Each 8-byte aligned word is sorted by the pool of its allocator segment (a
      ``PoolMap``, read again only when the allocator's counters say segments changed): words in
      the graph's own pool are counted (the pool's business), words outside the allocator
      counted, the rest kept as ``pending`` and matched to their blocks at the first check, from
      the allocator then and its trace since the census (no snapshot per capture: an engine
      captures thousands of graphs). Given ``snapshot``, every word is matched at once instead.
      pool: the graph's pool handle (default ``graph.pool()``).

  check_census(census, when, snapshot=None) -> list[Finding]
      Deep check of the captured blocks against the allocator now: a block freed (cached,
      inactive), its segment returned to the driver ("released"), or freed and allocated again
      since the census ("reused": read from the allocator's alloc/free trace, so reuse at the same
      address is caught). Own-pool blocks and addresses outside the allocator at capture
      (NCCL buffers, static device memory) are not findings; GraphCensus counts them. Each block
      is reported once per status. Nothing here runs per replay.

  CensusBook: the censuses of one process (one per graph label), the allocator trace and the
      segment map they share; ``dead_blocks()`` gives the after-free knob its targets,
      ``check()`` / ``check_graphs()`` check several graphs against one snapshot and one pass
      over its trace (repro/diagnose/trace_index.py: each graph from its own capture on), ``resolve()``
      matches every pending word now; ``merge_findings()`` joins census and guard findings into
      one list (mechanism "guard" | "census" | "both"), naming census findings after the guard's
      storage where the guard knows it and saying where the two disagree.

Driver access: ctypes on libcuda, not cuda-bindings. The parameter buffers are raw host memory
(``void** kernelParams``, the ``extra`` key/value array and the buffer it points to) that must be
read by address anyway; ctypes does that directly, needs no package (CPU CI and images without
cuda-bindings import this module fine), and the four structs read here are small and stable in
the driver ABI (CUDA_KERNEL_NODE_PARAMS_v2, CUDA_MEMCPY3D, CUDA_MEMSET_NODE_PARAMS).

Limits (also in README.md):
  * pointers stored in device memory (grouped-GEMM pointer arrays, CUTLASS argument tables in
    global memory) are invisible: the census reads parameters, not what they point to;
  * a kernel node whose parameter layout cannot be read (no param info for its function, no
    readable ``extra``) is reported "unreadable" and counted, never guessed;
  * a word that happens to equal an address inside a live block is counted as a reference:
    integers, and stale host bytes in unused slots of a struct parameter (torch's TensorInfo
    passes fixed-size size/stride arrays), can alias one; findings name kernel + offset so they
    can be judged. Words into blocks already free when the census is taken cannot be pointers
    the graph was given and are only counted (``free_at_capture``): a tensor freed inside the
    capture block itself is therefore left to the guard;
  * the trace is bounded (``TRACE_ENTRIES``); when it wrapped past a census's marker, reuse at the
    same address can no longer be told from the block never having been freed, and the check
    says so in GraphCensus.notes.
"""
from __future__ import annotations

import bisect
import collections
import ctypes
import functools
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple

from repro.outcome import Finding, Mechanism, Status
from repro.diagnose.trace_index import (ALLOC_ACTIONS, FREE_ACTIONS, RELEASE_ACTIONS, entries_at_points,
                               entries_over_blocks, first_from, since)

if TYPE_CHECKING:       # annotations only: CUDA work is lazy, importing this module needs no torch
    import torch

# Allocator trace kept while censuses are live. Without stacks an entry is small, but every
# snapshot copies the whole ring, so it is bounded to keep a check within milliseconds.
TRACE_ENTRIES = 8192
WORD = 8                                   # device addresses are 64-bit, naturally aligned
DEFAULT_POOL = (0, 0)
# User-space virtual addresses on x86-64/aarch64 Linux: a word outside this range is no pointer.
MIN_ADDR, MAX_ADDR = 1 << 32, 1 << 48
MAX_PARAMS = 4096                          # a launch's parameter buffer is at most 32 KiB
MAX_EXTRA_PAIRS = 16
SEEN_LIMIT = 1 << 20                       # addresses PoolMap remembers between refreshes
SMALL_GRAPH_WORDS = 8192                   # up to this, a graph's words are sorted one by one


class BlockState(StrEnum):
    """A caching-allocator block's "state" in torch's memory snapshot."""
    ACTIVE_ALLOCATED = "active_allocated"          # used by a tensor
    ACTIVE_PENDING_FREE = "active_pending_free"    # freed, waiting for its streams' events
    ACTIVE_AWAITING_FREE = "active_awaiting_free"  # the same, as torch's memory.py documents it
    INACTIVE = "inactive"                          # free, cached


# States whose memory no tensor holds any more.
INACTIVE_STATES = frozenset((BlockState.INACTIVE, BlockState.ACTIVE_PENDING_FREE, BlockState.ACTIVE_AWAITING_FREE))
# torch's word -> member by a dict lookup (a snapshot has thousands of blocks; BlockState(word)
# costs ten times as much). A state this module does not know stays torch's word, and is live.
_BLOCK_STATES = {s.value: s for s in BlockState}


class NodeKind(StrEnum):
    """A CUDA graph node's type: CUgraphNodeType (cuda.h), its members in the driver's order (0-13)."""
    KERNEL = "kernel"
    MEMCPY = "memcpy"
    MEMSET = "memset"
    HOST = "host"
    GRAPH = "graph"                        # a child graph: walked as part of its parent
    EMPTY = "empty"
    WAIT_EVENT = "wait_event"
    EVENT_RECORD = "event_record"
    EXT_SEMAS_SIGNAL = "ext_semas_signal"
    EXT_SEMAS_WAIT = "ext_semas_wait"
    MEM_ALLOC = "mem_alloc"
    MEM_FREE = "mem_free"
    BATCH_MEM_OP = "batch_mem_op"
    CONDITIONAL = "conditional"


class Tracing(StrEnum):
    """Where a CensusBook's allocator trace comes from."""
    START = "start"                        # the book starts recording it (start_trace)
    EXTERNAL = "external"                  # the caller already records memory history (with stacks)
    NONE = "none"                          # no trace: the checks see state only


# -- records ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    """One caching-allocator block, from a snapshot."""
    start: int
    size: int
    state: BlockState | str                # torch's word; one BlockState does not know stays a str
    pool: tuple[int, int]                  # segment_pool_id; (0, 0) is the default pool
    segment: int                           # start address of its segment

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def live(self) -> bool:
        return self.state not in INACTIVE_STATES


@dataclass
class Reference:
    """One captured word that points into an allocator block."""
    node: int                              # index of the node in the graph (child graphs flattened)
    kind: NodeKind                         # KERNEL, MEMCPY or MEMSET: the nodes whose words are read
    kernel: str                            # kernel name ("" for memcpy/memset)
    where: str                             # "param 3 +8", "extra +1528", "src", "dst"
    offset: int                            # byte offset in the parameter buffer (0 for memcpy/memset)
    addr: int                              # the word's value
    block: Block

    def describe(self) -> str:
        return describe_site(self.node, self.kind, self.kernel, self.where)


def describe_site(node: int, kind: NodeKind, kernel: str, where: str) -> str:
    """'node 12 kernel gemv param 3 +0': where in a graph a captured word sits."""
    what = f"kernel {short_name(kernel)}" if kind == NodeKind.KERNEL else kind
    return f"node {node} {what} {where}"


class Word(NamedTuple):
    """A captured word that may point into allocator memory; matched to a block later (a
    tuple: a full decoder graph holds thousands)."""
    node: int
    kind: NodeKind
    kernel: str
    where: str
    offset: int
    addr: int
    pool: tuple[int, int]                  # the pool of its segment when read

    def describe(self) -> str:
        return describe_site(self.node, self.kind, self.kernel, self.where)


@dataclass
class GraphCensus:
    """What one captured graph holds, and how it compares with the allocator at capture time."""
    label: str
    pool: tuple[int, int] | None
    nodes: int = 0
    kernels: int = 0
    node_types: dict[str, int] = field(default_factory=dict)   # NodeKind (or "type N") -> nodes
    words: int = 0                         # 8-byte words read from parameters and pointers
    references: list[Reference] = field(default_factory=list)   # outside the graph's own pool
    own_pool: int = 0                      # references into the graph's own pool (safe)
    outside: int = 0                       # device addresses outside any allocator block
    free_at_capture: int = 0               # words into blocks already free at census time
    unreadable: list[str] = field(default_factory=list)         # "node 12 kernel foo: why"
    foreign_pools: dict[str, int] = field(default_factory=dict) # "pool (1, 2)" -> references
    marker: dict[str, Any] | None = None   # trace position at census time
    reported: dict[int, Status] = field(default_factory=dict)   # block start -> status said
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # Words into memory of the default or another pool, not yet matched to allocator blocks:
    # matched at the first check, against the allocator then and its trace since the census
    # (no snapshot per capture: an engine captures thousands of graphs).
    pending: list[Word] = field(default_factory=list)
    # Segments of the own pool the graph reads (start -> its first word there): while the graph
    # lives its pool keeps them; one returned to the driver is a finding.
    own_segments: dict[int, Reference] = field(default_factory=dict)
    events_at: int | None = None           # allocator_events() at census time
    # Addresses of words the guard took (CaptureGuard.adopt): inside storages it names and holds
    # a weak reference to, so their lifetime is checked through it, not through the trace.
    held: list[int] = field(default_factory=list)
    _grouped: tuple[int, dict[int, list[Reference]]] | None = field(default=None, repr=False, compare=False)

    def blocks(self) -> list[Block]:
        """Distinct captured blocks (outside the own pool), by start address."""
        return [refs[0].block for _, refs in sorted(self.refs_by_block().items())]

    def refs_of(self, block: Block) -> list[Reference]:
        return self.refs_by_block().get(block.start, [])

    def refs_by_block(self) -> dict[int, list[Reference]]:
        """block start -> its references, grouped once per set of references (a check asks
        for the references of each block it found dead)."""
        if self._grouped is None or self._grouped[0] != len(self.references):
            grouped: dict[int, list[Reference]] = {}
            for r in self.references:
                grouped.setdefault(r.block.start, []).append(r)
            self._grouped = (len(self.references), grouped)
        return self._grouped[1]

    def summary(self) -> dict[str, Any]:
        """Counts for the trial record (no addresses of every word)."""
        return {"graph": self.label, "nodes": self.nodes, "kernels": self.kernels,
                "node_types": dict(self.node_types), "words": self.words,
                "references": len(self.references), "blocks": len(self.blocks()),
                "own_pool": self.own_pool, "outside_allocator": self.outside,
                "free_at_capture": self.free_at_capture,
                "unreadable": len(self.unreadable), "foreign_pools": dict(self.foreign_pools),
                "unmatched": len(self.pending), "held": len(self.held),
                "seconds": round(self.seconds, 6), "notes": list(self.notes)}


@dataclass
class Fate:
    """What happened to one captured block since the census."""
    block: Block
    status: Status                         # FREED, RELEASED or REUSED
    current: Block | None                  # the block at its address now (None: released)
    how: str                               # "allocator state" | "allocator trace"


# -- allocator snapshots (plain dicts in torch's documented format; no torch needed) ----------

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
            out.append(Block(start=start, size=b["size"], state=_BLOCK_STATES.get(state, state),
                             pool=(int(pool[0]), int(pool[1])), segment=seg["address"]))
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


def trace_of(snapshot: dict[str, Any], device: int = 0) -> list[dict[str, Any]]:
    traces = snapshot.get("device_traces") or []
    return traces[device] if device < len(traces) else []


MARKER_ENTRIES = 4


def marker_of(trace: list[dict[str, Any]]) -> dict[str, Any]:
    """The trace position at census time: its last few entries (one alone can repeat exactly
    when a same-size block is freed and taken again and the trace has no timestamps)."""
    tail = [entry_key(e) for e in trace[-MARKER_ENTRIES:]]
    return {"length": len(trace), "last": tail or None}


def clock_marker() -> dict[str, Any]:
    """The trace position at census time by the clock, with no snapshot taken: torch stamps
    every trace entry with Unix time in microseconds (``time_us``)."""
    return {"time_us": time.time_ns() // 1000}


def entry_key(entry: dict[str, Any]) -> tuple:
    return (entry.get("action"), entry.get("addr"), entry.get("size"), entry.get("stream"),
            entry.get("time_us"))


@dataclass
class Trace:
    """One snapshot's allocator trace, and where each census's part of it starts."""
    entries: list[dict[str, Any]]
    capacity: int | None = None            # the ring's max_entries (None: unknown or unbounded)
    _times: list[int] | None = None

    def start(self, marker: dict[str, Any] | None) -> int | None:
        """Position of the first entry recorded after the marker; None when the ring has
        wrapped past it (or there is no marker). A trace shorter than its capacity never
        dropped an entry, so an empty marker (no entry at census time) means "from 0"."""
        if marker is None:
            return None
        if "time_us" in marker:
            return self.start_after(marker["time_us"])
        last = marker.get("last")
        trace = self.entries
        if last is None:
            return None if self.capacity is not None and len(trace) >= self.capacity else 0
        # Search backwards: the marker is usually near the end.
        n = len(last)
        for i in range(len(trace) - 1, n - 2, -1):
            if entry_key(trace[i]) == last[-1] and [entry_key(e) for e in trace[i - n + 1:i + 1]] == last:
                return i + 1
        return None

    def start_after(self, time_us: int) -> int | None:
        """Position of the first entry stamped after time_us; None when the ring (full) no
        longer reaches back to it, or the entries carry no stamps (an old torch)."""
        trace = self.entries
        if not trace:
            return 0
        if "time_us" not in trace[0]:
            return None
        if self.capacity is not None and len(trace) >= self.capacity and trace[0]["time_us"] > time_us:
            return None
        if self._times is None:            # once per snapshot, however many censuses ask
            self._times = [e["time_us"] for e in trace]
        return bisect.bisect_right(self._times, time_us)

    def since(self, marker: dict[str, Any] | None) -> list[dict[str, Any]] | None:
        start = self.start(marker)
        return None if start is None else self.entries[start:]


def events_since(trace: list[dict[str, Any]], marker: dict[str, Any] | None,
                 capacity: int | None = None) -> list[dict[str, Any]] | None:
    """Trace entries recorded after the marker; None when the ring has wrapped past it."""
    return Trace(trace, capacity).since(marker)


def overlaps(entry: dict[str, Any], block: Block) -> bool:
    addr = entry.get("addr")
    return addr is not None and addr < block.end and block.start < addr + entry.get("size", 0)


def traced_fate(block: Block, events: list[dict[str, Any]]) -> Status | None:
    """From the events since the census: REUSED (freed, then allocated again), RELEASED or FREED.

    Only a free of an allocation overlapping the block starts its fate; an alloc counts only
    after such a free (before it, the block was ours), a segment release likewise.
    """
    fate = None
    for e in events:
        action = e.get("action")
        if action in FREE_ACTIONS and overlaps(e, block):
            fate = fate or Status.FREED
        elif fate is not None and action in RELEASE_ACTIONS and overlaps(e, block):
            fate = Status.RELEASED
        elif fate is not None and action in ALLOC_ACTIONS and overlaps(e, block):
            fate = Status.REUSED
    return fate


def fate_of(block: Block, now: BlockIndex, events: list[dict[str, Any]] | None) -> Fate | None:
    """The block's fate, from the allocator now and (where it still reaches) the trace.

    The current state decides freed / released; reuse at the same address looks like an
    untouched block in the state, so for a live block the trace decides. When the trace no
    longer reaches the census (events is None), a changed block layout still proves reuse.
    """
    current = now.find(block.start)
    if current is None:
        return Fate(block, Status.RELEASED, None, "allocator state")
    if not current.live:
        return Fate(block, Status.FREED, current, "allocator state")
    if events is not None:
        traced = traced_fate(block, events)
        if traced is not None:
            return Fate(block, Status.REUSED, current, "allocator trace")
        return None
    if (current.start, current.size, current.pool) != (block.start, block.size, block.pool):
        return Fate(block, Status.REUSED, current, "allocator state")
    return None


# -- matching words to blocks -------------------------------------------------------------------

def aligned_words(buf: bytes, base: int) -> list[tuple[int, int]]:
    """(offset, value) of every 8-byte word of buf that is 8-byte aligned in the parameter
    buffer; base is buf's offset in that buffer."""
    first = -base % WORD
    n = (len(buf) - first) // WORD
    if n <= 0:
        return []
    values = memoryview(buf)[first:first + n * WORD].cast("Q")     # little-endian hosts only
    return list(zip(range(base + first, base + first + n * WORD, WORD), values))


def plausible_words(buf: bytes, base: int) -> tuple[int, list[tuple[int, int]]]:
    """(how many aligned words buf holds, (offset, value) of those that may be device
    addresses): the filter runs over every word of every kernel of every graph, so it is one
    comprehension over a memoryview, and only the survivors become tuples."""
    first = -base % WORD
    n = (len(buf) - first) // WORD
    if n <= 0:
        return 0, []
    values = memoryview(buf)[first:first + n * WORD].cast("Q")     # little-endian hosts only
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
        self.starts: list[int] = []        # index of each chunk's first word in the whole
        self.meta: list[tuple[int, str, int, Any]] = []   # (node, kernel, offset of its first word, where_of)
        self.words = 0

    def add(self, node: int, kernel: str, buf: bytes, base: int, where_of: Any) -> int:
        """buf: parameter bytes at offset base of the node's parameter buffer; returns how many
        aligned words it holds."""
        first = -base % WORD
        n = (len(buf) - first) // WORD
        if n <= 0:
            return 0
        self.bufs.append(buf[first:first + n * WORD] if first or len(buf) != n * WORD else buf)
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
    is_device_address: Any = None          # callable(int) -> bool, or None: count nothing outside

    def add(self, census: GraphCensus, node: int, kind: NodeKind, kernel: str, where: str,
            offset: int, value: int) -> None:
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
        census.references.append(Reference(node=node, kind=kind, kernel=kernel, where=where,
                                           offset=offset, addr=value, block=block))

    def add_words(self, census: GraphCensus, node: int, kind: NodeKind, kernel: str,
                  words: list[tuple[int, int]], where_of: Any) -> None:
        for offset, value in words:
            self.add(census, node, kind, kernel, where_of(offset), offset, value)

    def add_chunks(self, census: GraphCensus, chunks: Chunks) -> None:
        for node, kernel, where_of, words in chunks.each():
            self.add_words(census, node, NodeKind.KERNEL, kernel, words, where_of)


class PoolMap:
    """Address -> graph pool of its segment, from the allocator's segments: a segment belongs
    to one pool for its whole life, so the map is read again only when segments came or went
    (the allocator's own counters say so) or an address falls outside every known segment."""

    def __init__(self, device: int | None = None):
        self.device = device
        self.starts: list[int] = []
        self.segments: list[tuple[int, int, tuple[int, int]]] = []   # (start, end, pool)
        self.signature: tuple | None = None
        self.refreshes = 0
        self.events: int | None = None     # allocator_events() as of the last check()
        self.seen: dict[int, Any] = {}     # address -> its segment (or None), until the next refresh
        self._arrays: tuple | None = None  # the segments as tensors (Deferred.add_chunks)

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
            self.seen[addr] = found     # graphs of one engine read the same weights, again and again
        return found

    def check(self) -> None:
        """Before a census: read the segments again if the allocator says they changed. One
        read of the allocator's counters serves both (and sets self.events)."""
        signature, self.events = allocator_counters(self.device)
        if self.signature is None or signature is None or signature != self.signature:
            self.refresh(signature=signature)

    def stale(self) -> bool:
        return segment_signature(self.device) != self.signature

    def refresh(self, snapshot: dict[str, Any] | None = None, signature: tuple | None = None) -> None:
        self.signature = signature or segment_signature(self.device)
        if snapshot is None:
            snapshot, self.device = take_segments()
        self.segments = sorted(
            (seg["address"], seg["address"] + seg["total_size"],
             tuple(int(x) for x in (seg.get("segment_pool_id") or DEFAULT_POOL)))
            for seg in snapshot.get("segments", [])
            if self.device is None or seg.get("device", self.device) == self.device)
        self.starts = [seg[0] for seg in self.segments]
        self.seen = {}
        self._arrays = None
        self.refreshes += 1

    def arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
        """(segment starts, ends, pool index of each, the pools) as int64 tensors, sorted by
        start: the segments to sort a graph's words by in one search."""
        if self._arrays is None:
            import torch
            pools = sorted({seg[2] for seg in self.segments})
            self._arrays = (torch.tensor([seg[0] for seg in self.segments], dtype=torch.int64),
                            torch.tensor([seg[1] for seg in self.segments], dtype=torch.int64),
                            torch.tensor([pools.index(seg[2]) for seg in self.segments], dtype=torch.int64),
                            pools)
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
        return None, None                  # unknown: every check reads the segments again
    return ((seg["allocated"], seg["freed"], reserved["current"], reserved["allocated"], reserved["freed"]),
            alloc["allocated"] + 2 * alloc["freed"] + seg["allocated"] + seg["freed"])


def allocator_events(device: int | None = None) -> int | None:
    return allocator_counters(device)[1]


def segment_signature(device: int | None) -> tuple | None:
    return allocator_counters(device)[0]


# Past a size torch spreads a host op over its thread pool (elementwise ops and nonzero: 32,768
# elements, at::internal::GRAIN_SIZE in ATen/Parallel.h; searchsorted: 200 searches,
# SEARCHSORTED_GRAIN_SIZE in ATen/native/Bucketization.cpp). Inside an engine's capture phase that cost milliseconds
# per op (a 75,000-word mask and nonzero: 7 ms per graph in the watched engine, 0.4 ms alone; in
# 16,384-word slices 0.9 ms), so the census's arrays go through in slices below those sizes,
# on the calling thread.
SERIAL_ELEMENTS = 16384
SERIAL_SEARCHES = 128


def segment_positions(torch: Any, starts: Any, v: Any) -> Any:
    """searchsorted(starts, v, right=True), in slices."""
    if v.numel() <= SERIAL_SEARCHES:
        return torch.searchsorted(starts, v, right=True)
    return torch.cat([torch.searchsorted(starts, v[i:i + SERIAL_SEARCHES], right=True)
                      for i in range(0, v.numel(), SERIAL_SEARCHES)])


@dataclass
class Deferred:
    """Sorts captured words by pool at capture time, with no snapshot: own-pool words are
    counted, words outside the allocator counted, the rest kept to match at the first check."""
    pools: PoolMap
    own_pool: tuple[int, int] | None
    is_device_address: Any = None          # callable(int) -> bool, or None: count nothing outside
    small: int = SMALL_GRAPH_WORDS         # graphs of up to this many words: sorted word by word

    def add(self, census: GraphCensus, node: int, kind: NodeKind, kernel: str, where: str,
            offset: int, value: int) -> None:
        if plausible_address(value):
            self.sort(census, node, kind, kernel, offset, value, lambda _: where)

    def sort(self, census: GraphCensus, node: int, kind: NodeKind, kernel: str, offset: int, value: int,
             where_of: Any) -> None:
        """One plausible word: counted (own pool, outside the allocator) or kept as pending;
        where_of(offset) -> "param 3 +8" is made only for the words kept."""
        seg = self.pools.find(value)            # the map is current: take_census checked it
        if seg is None:
            if self.is_device_address is not None and self.is_device_address(value):
                census.outside += 1
            return
        if self.own_pool is not None and seg[2] == self.own_pool:
            census.own_pool += 1
            if seg[0] not in census.own_segments:
                block = Block(start=seg[0], size=seg[1] - seg[0], state=BlockState.ACTIVE_ALLOCATED, pool=seg[2], segment=seg[0])
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
            at = ((values >= MIN_ADDR) & (values < MAX_ADDR)).nonzero().squeeze(1)
            self.sort_each(census, chunks, at.tolist(), values[at].tolist())
            return
        for first in range(0, chunks.words, SERIAL_ELEMENTS):
            self.sort_slice(torch, census, chunks, values[first:first + SERIAL_ELEMENTS], first)

    def sort_slice(self, torch: Any, census: GraphCensus, chunks: Chunks, values: Any, first: int) -> None:
        """The array path for the graph's words from index first on (values: at most
        SERIAL_ELEMENTS of them)."""
        at = ((values >= MIN_ADDR) & (values < MAX_ADDR)).nonzero().squeeze(1)
        if not at.numel():
            return
        v = values[at]
        at = at + first                   # positions in the whole graph's words
        starts, ends, pool_ix, pools = self.pools.arrays()
        if starts.numel():
            seg = segment_positions(torch, starts, v) - 1
            seg_c = seg.clamp(min=0)
            inside = (seg >= 0) & (v < ends[seg_c])
        else:
            seg_c = torch.zeros_like(v)
            inside = torch.zeros(v.shape, dtype=torch.bool)
        own = torch.zeros_like(inside)
        if self.own_pool is not None and self.own_pool in pools:
            own = inside & (pool_ix[seg_c] == pools.index(self.own_pool))
            census.own_pool += int(own.sum())
            self.note_own_segments(census, chunks, at, v, seg_c, own)
        if self.is_device_address is not None:
            census.outside += self.count_device_addresses(v[~inside])
        rest = (inside & ~own).nonzero().squeeze(1)
        pool_of_seg = self.pools.segments
        pending = census.pending
        for word, value, s in zip(at[rest].tolist(), v[rest].tolist(), seg_c[rest].tolist()):
            node, kernel, offset, where_of = chunks.locate(word)
            pending.append(Word(node, NodeKind.KERNEL, kernel, where_of(offset), offset, value, pool_of_seg[s][2]))

    def sort_each(self, census: GraphCensus, chunks: Chunks, at: list[int], values: list[int]) -> None:
        """sort() each plausible word (at: its index in the graph's words); the common one (own
        pool, in a segment already noted) is counted inline."""
        find, own_pool, noted, own = self.pools.find, self.own_pool, census.own_segments, 0
        is_device = self.is_device_address
        for i, value in zip(at, values):
            seg = find(value)
            if seg is None:              # most plausible words: host pointers, stale bytes
                if is_device is not None and is_device(value):
                    census.outside += 1
            elif seg[2] == own_pool and seg[0] in noted:
                own += 1
            else:
                node, kernel, offset, where_of = chunks.locate(i)
                self.sort(census, node, NodeKind.KERNEL, kernel, offset, value, where_of)
        census.own_pool += own

    def count_device_addresses(self, values: torch.Tensor) -> int:
        """How many of these words the driver knows as device addresses: asked once per 2 MiB
        page (as is_device_address caches), with the page's lowest word, not once per word (a
        decoder graph holds thousands of int pairs that look like addresses)."""
        if not values.numel():
            return 0
        import torch
        pages, which, counts = torch.unique(values >> 21, return_inverse=True, return_counts=True)
        lowest = torch.full(pages.shape, MAX_ADDR, dtype=torch.int64).scatter_reduce_(0, which, values, reduce="amin")
        return sum(n for value, n in zip(lowest.tolist(), counts.tolist()) if self.is_device_address(value))

    def note_own_segments(self, census: GraphCensus, chunks: Chunks, at: torch.Tensor, v: torch.Tensor,
                          seg: torch.Tensor, own: torch.Tensor) -> None:
        """The first word of each own-pool segment the graph reads (a segment released while
        the graph lives is a finding)."""
        import torch
        own_at = own.nonzero().squeeze(1)
        segs, which = torch.unique(seg[own_at], return_inverse=True)
        # The first own word of each segment: the least position among the words in it.
        first = torch.full(segs.shape, len(own_at), dtype=torch.int64).scatter_reduce_(
            0, which, torch.arange(len(own_at)), reduce="amin")
        # Indexing a tensor from Python costs microseconds: pick the rows with tensors, then read
        # them as lists (a piecewise engine makes thousands of small graphs).
        rows = own_at[first]
        for s, word, value in zip(segs.tolist(), at[rows].tolist(), v[rows].tolist()):
            start, end, pool = self.pools.segments[s]
            if start in census.own_segments:
                continue
            node, kernel, offset, where_of = chunks.locate(word)
            block = Block(start=start, size=end - start, state=BlockState.ACTIVE_ALLOCATED, pool=pool, segment=start)
            census.own_segments[start] = Reference(node, NodeKind.KERNEL, kernel, where_of(offset), offset, value, block)


def match_pending(census: GraphCensus, now: BlockIndex, first: dict[int, dict[str, Any]] | None,
                  pool_names: dict[tuple[int, int], str]) -> None:
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
        census.references.append(Reference(node=w.node, kind=w.kind, kernel=w.kernel, where=w.where,
                                           offset=w.offset, addr=w.addr, block=block))
    census.pending = []
    if lost:
        census.notes.append(f"The allocator trace no longer reaches the capture: {lost} captured words "
                            "into free blocks could not be told from stale struct bytes (not checked).")


def first_touches(words: list[Word], trace: list[dict[str, Any]], points: dict[int, list[int]],
                  start: int | None) -> dict[int, dict[str, Any]] | None:
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
        return Block(start=first["addr"], size=first.get("size", 0), state=BlockState.ACTIVE_ALLOCATED,
                     pool=w.pool, segment=current.segment if current else first["addr"])
    if first is not None or current is None or not current.live:
        return None
    return current


def short_name(name: str, limit: int = 96) -> str:
    return name if len(name) <= limit else name[: limit - 3] + "..."


# -- findings ---------------------------------------------------------------------------------

def census_finding(label: str, fate: Fate, refs: list[Reference], when: str, rank: int,
                   trace_note: str = "") -> Finding:
    """A census finding: kernel + parameter + block; the guard's name is added by merge."""
    block, first = fate.block, refs[0]
    name = f"<block {block.start:#x} read by {first.describe()}>"
    detail = {
        "block_start": block.start, "block_size": block.size, "block_pool": list(block.pool),
        "status": fate.status, "how": fate.how, "references": len(refs),
        "kernel": first.kernel, "node": first.node, "where": first.where, "offset": first.offset,
        "addr": first.addr, "sites": [r.describe() for r in refs[:8]],
    }
    if fate.current is not None:
        detail["now"] = {"start": fate.current.start, "size": fate.current.size,
                         "state": fate.current.state, "pool": list(fate.current.pool)}
    return Finding(slot=name, graph=label, status=fate.status, when=when, rank=rank, shape=[],
                   dtype="", nbytes=block.size, old_ptr=first.addr, new_ptr=None,
                   message=census_message(label, fate, refs, trace_note), mechanism=Mechanism.CENSUS,
                   census=detail)


CENSUS_FIX = {
    Status.FREED: "The block is cached but free: the next allocation of its size takes it and the replay "
           "reads that tensor's data. Keep the owner alive for the graph's lifetime or re-capture.",
    Status.RELEASED: "Its segment went back to the driver: replaying faults with an illegal memory access "
              "(error 700). Keep the owner alive for the graph's lifetime or re-capture.",
    Status.REUSED: "Another allocation now lives at that address: the replay reads and writes it. Keep the "
            "owner alive for the graph's lifetime or re-capture.",
}


def census_message(label: str, fate: Fate, refs: list[Reference], trace_note: str = "") -> str:
    block = fate.block
    said = {Status.FREED: "has been freed (cached, inactive)", Status.RELEASED: "has been returned to the driver",
            Status.REUSED: "was freed and allocated again"}[fate.status]
    sites = "; ".join(r.describe() for r in refs[:3]) + (f" and {len(refs) - 3} more" if len(refs) > 3 else "")
    text = (f"graph '{label}' holds {refs[0].addr:#x} in {sites}; the allocator block "
            f"{block.start:#x} ({block.size} bytes, pool {block.pool}) {said} "
            f"(seen in the {fate.how}). {CENSUS_FIX[fate.status]}")
    return text + (f" {trace_note}" if trace_note else "")


def census_fates(census: GraphCensus, now: BlockIndex, trace: Trace,
                 overlapping: dict[tuple[int, int], list[int]] | None = None) -> tuple[list[Fate], str]:
    """Fates of the census's blocks not reported yet, and a note when the trace was lost.
    overlapping: entries_over_blocks over (at least) this census's blocks, shared by every
    census of one check; computed here when not given."""
    start = trace.start(census.marker)
    note = "" if start is not None or census.marker is None else (
        "The allocator trace no longer reaches the capture: reuse at the same address cannot be "
        "seen, only freed and released blocks.")
    blocks = [b for b in census.blocks() if b.start not in census.reported]
    if overlapping is None and start is not None:
        overlapping = entries_over_blocks(trace.entries, ((b.start, b.end) for b in blocks), start)
    fates = []
    for block in blocks:
        events = None if start is None else [
            trace.entries[p] for p in since((overlapping or {}).get((block.start, block.end), []), start)]
        fate = fate_of(block, now, events)
        if fate is not None:
            fates.append(fate)
    return fates, note


def check_census(census: GraphCensus, when: str, snapshot: dict[str, Any] | None = None,
                 rank: int = 0, device: int | None = None, capacity: int | None = TRACE_ENTRIES) -> list[Finding]:
    """Findings new since the last check of this census; each block is reported once.

    snapshot: an allocator snapshot taken now (one is taken when None). Own-pool blocks were
    never references, so they cannot be findings.
    """
    if snapshot is None:
        snapshot, device = take_snapshot()
    dev = 0 if device is None else device
    now, trace = BlockIndex.of(snapshot, device), Trace(trace_of(snapshot, dev), capacity)
    start = trace.start(census.marker)
    if census.pending:
        points = {} if start is None else entries_at_points(trace.entries, (w.addr for w in census.pending), start)
        match_pending(census, now, first_touches(census.pending, trace.entries, points, start), {})
    fates, note = census_fates(census, now, trace)
    if note and note not in census.notes:
        census.notes.append(note)
    findings = []
    for fate in fates:
        census.reported[fate.block.start] = fate.status
        findings.append(census_finding(census.label, fate, census.refs_of(fate.block), when, rank, note))
    return findings


# -- the CUDA driver, through ctypes ------------------------------------------------------------

CU_GRAPH_NODE_TYPES = dict(enumerate(NodeKind))   # CUgraphNodeType: NodeKind lists them in the driver's order
CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE = 0, 1
CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED = 2, 4
CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_LAUNCH_PARAM_END, CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h, CUDA >= 12.0)."""
    _fields_ = [("func", ctypes.c_void_p),
                ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class Memcpy3D(ctypes.Structure):
    """CUDA_MEMCPY3D (cuda.h)."""
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcZ", ctypes.c_size_t),
                ("srcLOD", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
                ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p), ("reserved0", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("srcHeight", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstZ", ctypes.c_size_t),
                ("dstLOD", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p),
                ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p), ("reserved1", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t), ("dstHeight", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t), ("Depth", ctypes.c_size_t)]


class MemsetParams(ctypes.Structure):
    """CUDA_MEMSET_NODE_PARAMS (cuda.h)."""
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("elementSize", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


class DriverError(RuntimeError):
    pass


class Driver:
    """The few libcuda entry points the census reads a graph with."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self.get_params = self.optional("cuGraphKernelNodeGetParams_v2", "cuGraphKernelNodeGetParams")
        self.func_param_info = self.optional("cuFuncGetParamInfo")
        self.kernel_param_info = self.optional("cuKernelGetParamInfo")
        self.func_name = self.optional("cuFuncGetName")
        self.kernel_name = self.optional("cuKernelGetName")
        self.address_cache: dict[int, bool] = {}
        self.function_cache: dict[int, tuple[str, Any]] = {}
        # One parameter struct for every node (kernel_node fills it; its caller reads it before
        # the next call): a struct and a byref per node cost ~1 us of the ~10 us a node took.
        self.scratch = KernelNodeParams()
        self.scratch_ref = ctypes.byref(self.scratch)
        # Declared argument types let the per-node calls take plain ints (half their cost: an
        # engine's graphs hold ~70,000 kernel nodes).
        node = ctypes.c_void_p
        for fn, out in ((getattr(lib, "cuGraphNodeGetType", None), ctypes.POINTER(ctypes.c_int)),
                        (self.get_params, ctypes.POINTER(KernelNodeParams)),
                        (getattr(lib, "cuGraphMemcpyNodeGetParams", None), ctypes.POINTER(Memcpy3D)),
                        (getattr(lib, "cuGraphMemsetNodeGetParams", None), ctypes.POINTER(MemsetParams)),
                        (getattr(lib, "cuGraphChildGraphNodeGetGraph", None), ctypes.POINTER(ctypes.c_void_p))):
            if fn is not None:
                fn.argtypes, fn.restype = [node, out], ctypes.c_int

    def optional(self, *names: str) -> Any:
        for name in names:
            fn = getattr(self.lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                return fn
        return None

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self.lib.cuGetErrorName(code, ctypes.byref(name)) == CUDA_SUCCESS and name.value:
            return name.value.decode()
        return f"CUresult {code}"

    def call(self, what: str, fn: Any, *args: Any) -> None:
        code = fn(*args)
        if code:
            raise DriverError(f"{what}: {self.error_name(code)}")

    def nodes(self, graph: int) -> list[int]:
        count = ctypes.c_size_t(0)
        self.call("cuGraphGetNodes", self.lib.cuGraphGetNodes, ctypes.c_void_p(graph), None, ctypes.byref(count))
        arr = (ctypes.c_void_p * max(count.value, 1))()
        self.call("cuGraphGetNodes", self.lib.cuGraphGetNodes, ctypes.c_void_p(graph), arr, ctypes.byref(count))
        return [arr[i] for i in range(count.value)]

    def node_type(self, node: int) -> NodeKind | str:
        """The node's NodeKind; "type N" for a type this module does not know."""
        t = ctypes.c_int(-1)
        self.call("cuGraphNodeGetType", self.lib.cuGraphNodeGetType, node, ctypes.byref(t))
        return CU_GRAPH_NODE_TYPES.get(t.value, f"type {t.value}")

    def child_graph(self, node: int) -> int:
        g = ctypes.c_void_p()
        self.call("cuGraphChildGraphNodeGetGraph", self.lib.cuGraphChildGraphNodeGetGraph,
                  node, ctypes.byref(g))
        return g.value or 0

    def kernel_params(self, node: int) -> KernelNodeParams:
        if self.get_params is None:
            raise DriverError("cuGraphKernelNodeGetParams_v2 is not in this libcuda")
        p = KernelNodeParams()
        self.call("cuGraphKernelNodeGetParams_v2", self.get_params, node, ctypes.byref(p))
        return p

    def kernel_node(self, node: int) -> KernelNodeParams | None:
        """The node's kernel parameters, or None when the node is no kernel node (or the driver
        will not say: node_type tells which). One driver call for a kernel node, the usual
        kind, where node_type then kernel_params took two. The struct is the driver's scratch:
        read it before the next call."""
        if self.get_params is None or self.get_params(node, self.scratch_ref):
            return None
        return self.scratch

    def memcpy_params(self, node: int) -> Memcpy3D:
        p = Memcpy3D()
        self.call("cuGraphMemcpyNodeGetParams", self.lib.cuGraphMemcpyNodeGetParams, node, ctypes.byref(p))
        return p

    def memset_params(self, node: int) -> MemsetParams:
        p = MemsetParams()
        self.call("cuGraphMemsetNodeGetParams", self.lib.cuGraphMemsetNodeGetParams, node, ctypes.byref(p))
        return p

    def name(self, p: KernelNodeParams) -> str:
        out = ctypes.c_char_p()
        for fn, handle in ((self.func_name, p.func), (self.kernel_name, p.kern)):
            if fn is not None and handle and fn(ctypes.byref(out), ctypes.c_void_p(handle)) == CUDA_SUCCESS:
                return (out.value or b"").decode(errors="replace")
        return "<unnamed kernel>"

    def param_layout(self, p: KernelNodeParams) -> list[tuple[int, int]]:
        """[(offset, size)] of each parameter, from the function or the library kernel handle."""
        for fn, handle, what in ((self.func_param_info, p.func, "cuFuncGetParamInfo"),
                                 (self.kernel_param_info, p.kern, "cuKernelGetParamInfo")):
            if fn is None or not handle:
                continue
            layout, code = [], CUDA_SUCCESS
            for i in range(MAX_PARAMS):
                off, size = ctypes.c_size_t(), ctypes.c_size_t()
                code = fn(ctypes.c_void_p(handle), ctypes.c_size_t(i), ctypes.byref(off), ctypes.byref(size))
                if code != CUDA_SUCCESS:
                    break
                layout.append((off.value, size.value))
            if code in (CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE):
                return layout   # INVALID_VALUE past the last parameter ends the list
            raise DriverError(f"{what}: {self.error_name(code)}")
        raise DriverError("no parameter layout: neither cuFuncGetParamInfo nor cuKernelGetParamInfo "
                          "applies (driver older than CUDA 12.4, or no function handle)")

    def is_device_address(self, value: int) -> bool:
        """Whether the driver knows value as a device (or managed) address; cached per 2 MiB page."""
        page = value >> 21
        known = self.address_cache.get(page)
        if known is None:
            mem = ctypes.c_uint(0)
            ok = self.lib.cuPointerGetAttribute(ctypes.byref(mem), CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                                ctypes.c_uint64(value)) == CUDA_SUCCESS
            known = self.address_cache[page] = ok and mem.value in (CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED)
        return known


@functools.lru_cache(maxsize=1)
def load_driver() -> Driver:
    """libcuda through ctypes (see the module docstring for why not cuda-bindings)."""
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            return Driver(ctypes.CDLL(name))
        except OSError:
            continue
    raise DriverError("libcuda.so.1 cannot be loaded (no NVIDIA driver on this machine)")


# -- reading a graph ----------------------------------------------------------------------------

def function_info(driver: Driver, p: KernelNodeParams) -> tuple[str, ParamLayout | DriverError]:
    """(name, parameter layout or the error reading it) of a node's function, read once per
    function: an engine's graphs launch the same few dozen kernels tens of thousands of times."""
    key = p.func or p.kern
    cache = getattr(driver, "function_cache", None)
    if key and cache is not None and key in cache:
        return cache[key]
    name = driver.name(p)
    try:
        layout: ParamLayout | DriverError = param_layout(driver.param_layout(p) if p.kernelParams else ())
    except DriverError as e:
        layout = e
    if key and cache is not None:
        cache[key] = (name, layout)
    return name, layout


class ParamLayout(NamedTuple):
    """A function's parameters as the driver lays them out, with what reading them needs,
    derived once per function."""
    pairs: tuple[tuple[int, int], ...]     # (offset, size) of each parameter
    starts: tuple[int, ...]                # offset of each parameter
    rel: tuple[int, ...]                   # offset of each parameter from the first
    first: int                             # offset of the first parameter
    end: int                               # end of the last parameter
    slots: Any                             # ctypes array type of the kernelParams pointers

    def where(self, offset: int) -> str:
        """'param 3 +8': the parameter holding the word at offset, and the offset in it."""
        i = bisect.bisect_right(self.starts, offset) - 1
        return f"param {i} +{offset - self.starts[i]}"


def param_layout(pairs: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> ParamLayout:
    pairs = tuple((int(off), int(size)) for off, size in pairs)
    starts = tuple(off for off, _ in pairs)
    first = starts[0] if starts else 0
    return ParamLayout(pairs, starts, tuple(off - first for off in starts), first,
                       max((off + size for off, size in pairs), default=0), ctypes.c_void_p * max(len(pairs), 1))


def param_chunks(slots: Any, layout: ParamLayout) -> tuple[list[tuple[bytes, int]], str | None]:
    """(the parameters' bytes as (buffer, its offset in the parameter buffer) chunks, the first
    parameter that cannot be read or None).

    The driver hands a graph node's parameters back as pointers into one buffer laid out as
    the layout says; where they are (the usual case), one read gets them all."""
    n = len(layout.pairs)
    if not n:
        return [], None
    got = slots[:n]
    base = got[0]
    # Contiguous when every pointer sits at its offset from the first (map runs in C: this
    # check is made for every kernel node of every graph).
    if base and tuple(map(base.__rsub__, got)) == layout.rel:
        return [(ctypes.string_at(base, layout.end - layout.first), layout.first)], None
    chunks = []
    for i, (off, size) in enumerate(layout.pairs):
        if not got[i]:
            return chunks, f"parameter {i} has no value"
        chunks.append((ctypes.string_at(got[i], size), off))
    return chunks, None


def read_kernel(driver: Driver, census: GraphCensus, match: Matcher, index: int, node: int,
                chunks: Chunks | None = None) -> None:
    """One kernel node's parameter bytes into chunks (the graph's, sorted by pool once read_graph
    has read every node); without chunks, sorted now."""
    now = chunks is None
    chunks = Chunks() if now else chunks
    read_kernel_params(driver, census, index, driver.kernel_params(node), chunks)
    if now:
        match.add_chunks(census, chunks)


def read_kernel_params(driver: Driver, census: GraphCensus, index: int, p: KernelNodeParams,
                       chunks: Chunks) -> None:
    """read_kernel for parameters already read from the driver."""
    name, layout = function_info(driver, p)
    census.kernels += 1
    if p.kernelParams:
        if isinstance(layout, DriverError):
            census.unreadable.append(f"node {index} kernel {short_name(name)}: {layout}")
            return
        got, missing = param_chunks(layout.slots.from_address(p.kernelParams), layout)
        if missing:
            census.unreadable.append(f"node {index} kernel {short_name(name)}: {missing}")
        for buf, base in got:
            census.words += chunks.add(index, name, buf, base, layout.where)
    elif p.extra:
        buf = read_extra(p.extra)
        if buf is None:
            census.unreadable.append(f"node {index} kernel {short_name(name)}: 'extra' holds no "
                                     "CU_LAUNCH_PARAM_BUFFER_POINTER/SIZE pair")
            return
        census.words += chunks.add(index, name, buf, 0, extra_where)
    else:
        try:
            pairs = driver.param_layout(p)
        except DriverError:
            pairs = []
        if pairs:
            census.unreadable.append(f"node {index} kernel {short_name(name)}: {len(pairs)} parameters "
                                     "but neither kernelParams nor extra")


def extra_where(offset: int) -> str:
    return f"extra +{offset}"


def read_extra(extra: int) -> bytes | None:
    """The parameter buffer of a launch that passed CU_LAUNCH_PARAM_BUFFER_POINTER/SIZE."""
    pairs = (ctypes.c_void_p * (2 * MAX_EXTRA_PAIRS)).from_address(extra)
    ptr = size_ptr = None
    for i in range(0, 2 * MAX_EXTRA_PAIRS, 2):
        key = pairs[i] or CU_LAUNCH_PARAM_END
        if key == CU_LAUNCH_PARAM_END:
            break
        if key == CU_LAUNCH_PARAM_BUFFER_POINTER:
            ptr = pairs[i + 1]
        elif key == CU_LAUNCH_PARAM_BUFFER_SIZE:
            size_ptr = pairs[i + 1]
    if not ptr or not size_ptr:
        return None
    size = ctypes.c_size_t.from_address(size_ptr).value
    return ctypes.string_at(ptr, size)


def memcpy_address(base: int, x: int, y: int, z: int, pitch: int, height: int) -> int:
    return base + x + y * pitch + z * pitch * height


def read_memcpy(driver: Driver, census: GraphCensus, match: Matcher, index: int, node: int) -> None:
    p = driver.memcpy_params(node)
    census.words += 2
    if p.srcMemoryType in (CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED):
        match.add(census, index, NodeKind.MEMCPY, "", "src", 0, memcpy_address(
            p.srcDevice, p.srcXInBytes, p.srcY, p.srcZ, p.srcPitch, p.srcHeight))
    if p.dstMemoryType in (CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED):
        match.add(census, index, NodeKind.MEMCPY, "", "dst", 0, memcpy_address(
            p.dstDevice, p.dstXInBytes, p.dstY, p.dstZ, p.dstPitch, p.dstHeight))


def read_memset(driver: Driver, census: GraphCensus, match: Matcher, index: int, node: int) -> None:
    census.words += 1
    match.add(census, index, NodeKind.MEMSET, "", "dst", 0, driver.memset_params(node).dst)


READERS = {NodeKind.KERNEL: read_kernel, NodeKind.MEMCPY: read_memcpy, NodeKind.MEMSET: read_memset}


def read_graph(driver: Driver, census: GraphCensus, match: Matcher, graph: int, depth: int = 0,
               chunks: Chunks | None = None) -> None:
    """Every node of the graph, child graphs flattened into the same node numbering; the
    kernels' words are sorted by pool once, after the last node (one pass, not one per node)."""
    top = chunks is None
    chunks = Chunks() if top else chunks
    kernel_node = getattr(driver, "kernel_node", None)   # stand-in drivers may lack it
    types = census.node_types
    for node in driver.nodes(graph):
        index = census.nodes
        census.nodes += 1
        try:
            p = kernel_node(node) if kernel_node is not None else None
            if p is not None:         # most nodes: a kernel, read with one driver call
                types[NodeKind.KERNEL] = types.get(NodeKind.KERNEL, 0) + 1
                read_kernel_params(driver, census, index, p, chunks)
                continue
            kind = driver.node_type(node)
            types[kind] = types.get(kind, 0) + 1
            if kind == NodeKind.GRAPH and depth < 8:
                read_graph(driver, census, match, driver.child_graph(node), depth + 1, chunks)
            elif kind == NodeKind.KERNEL:
                read_kernel(driver, census, match, index, node, chunks)
            elif kind in READERS:
                READERS[kind](driver, census, match, index, node)
        except DriverError as e:
            census.unreadable.append(f"node {index}: {e}")
    if top:
        match.add_chunks(census, chunks)


# -- torch side (lazy) --------------------------------------------------------------------------

def census_supported() -> tuple[bool, str]:
    """(True, "") when a census can be taken here; else (False, what is missing)."""
    try:
        import torch
    except ImportError as e:
        return False, f"torch is not importable: {e}"
    if not torch.cuda.is_available():
        return False, f"CUDA is not available (torch {torch.__version__})"
    if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph"):
        return False, f"torch {torch.__version__} has no CUDAGraph(keep_graph=True).raw_cuda_graph()"
    try:
        driver = load_driver()
    except DriverError as e:
        return False, str(e)
    if driver.get_params is None:
        return False, "this libcuda has no cuGraphKernelNodeGetParams_v2 (driver older than CUDA 12.0)"
    return True, ""


def start_trace(max_entries: int = TRACE_ENTRIES) -> None:
    """Record the allocator's alloc/free trace without stacks (cheap); process-wide.

    Do not call when memory history with stacks is already recording (repro --forensics): that
    recording serves the census as well, and this call would replace its settings.
    """
    import torch
    # context=None: no entry gathers a stack (stacks only says what one would hold; "python" is
    # the lighter choice). A gathered python stack holds code objects, never frames.
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             max_entries=max_entries)


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
        segments = torch._C._cuda_memorySnapshot((0, 0, False))["segments"]   # (pool 0 0: all; no trace)
    except (TypeError, RuntimeError, AttributeError, KeyError):
        return take_snapshot()             # a torch whose snapshot always copies the trace
    return {"segments": segments}, torch.cuda.current_device()


def pool_id(pool: Any) -> tuple[int, int] | None:
    if pool is None:
        return None
    try:
        a, b = pool
        return int(a), int(b)
    except (TypeError, ValueError):
        return None


def take_census(graph: torch.cuda.CUDAGraph, label: str, pool: tuple[int, int] | None = None,
                snapshot: dict[str, Any] | None = None,
                pool_names: dict[tuple[int, int], str] | None = None,
                device: int | None = None, traced: bool = True, pools: PoolMap | None = None,
                since: dict[str, Any] | None = None) -> GraphCensus:
    """Census of a graph captured with CUDAGraph(keep_graph=True); see the module docstring.

    snapshot: an allocator snapshot taken right after the capture: every word is matched to
    its block now. Without one (the usual way) no snapshot is taken: words are sorted by the
    pool of their segment (``pools``, read again only when segments changed) and the rest are
    matched at the first check, from the allocator then and its trace since this census; so a
    census costs what the graph holds, not what the process allocated before it.
    traced: the allocator trace is recording (``start_trace()`` or memory history); without it
    the checks see freed and released blocks but not reuse at the same address.
    since: a clock_marker() taken when the capture began (no snapshot): the trace is then read
    from there, so a block freed during the capture itself still counts as captured (with
    nothing recording at the dispatcher, only the trace can tell).
    Raises DriverError when the graph cannot be read at all (then nothing can be said about it);
    single nodes that cannot be read are listed in ``unreadable``.
    """
    start = time.perf_counter()
    driver = load_driver()
    try:
        raw = graph.raw_cuda_graph()
    except RuntimeError as e:
        raise DriverError(f"graph '{label}' has no raw CUDA graph ({e}); create it with "
                          "torch.cuda.CUDAGraph(keep_graph=True)") from None
    own = pool_id(pool if pool is not None else graph.pool())
    census = GraphCensus(label=label, pool=own)
    if snapshot is not None:
        match: Any = Matcher(BlockIndex.of(snapshot, device), own, pool_names or {}, driver.is_device_address)
        marker = marker_of(trace_of(snapshot, 0 if device is None else device))
    else:
        pools = pools or PoolMap()
        pools.check()
        match = Deferred(pools, own, driver.is_device_address)
        marker = since or clock_marker()
    read_graph(driver, census, match, raw)
    if traced:
        census.marker = marker
    else:
        census.notes.append("no allocator trace: reuse at the same address cannot be seen")
    census.seconds = time.perf_counter() - start
    return census


# -- one process's censuses, and the one finding model -------------------------------------------

class CensusBook:
    """The censuses of one process, checked together against one snapshot per check point.

    trace: where the allocator trace comes from (Tracing: START records it here, EXTERNAL is
    the caller's memory history, NONE checks state only).
    """

    def __init__(self, rank: int = 0, trace: Tracing = Tracing.START, capacity: int = TRACE_ENTRIES):
        self.rank = rank
        self.capacity = capacity if trace == Tracing.START else None
        self.traced = trace != Tracing.NONE
        self.censuses: dict[str, GraphCensus] = {}
        self.checked: set[str] = set()             # labels checked at least once
        self.errors: list[str] = []
        self.said: dict[int, Status] = {}          # block start -> status, across graphs
        self.pools = PoolMap()
        self.pool_names: dict[tuple[int, int], str] = {}   # pool -> "graph 'first label'"
        self.snapshots = 0                         # allocator snapshots the book took
        self.paused = False                        # trace stopped by pause_trace()
        self.waiting: collections.deque[GraphCensus] = collections.deque()   # with pending words, oldest first
        if trace == Tracing.START:
            start_trace(capacity)

    def add(self, graph: torch.cuda.CUDAGraph, label: str, pool: tuple[int, int] | None = None,
            since: dict[str, Any] | None = None) -> GraphCensus | None:
        """Census right after capture; a graph that cannot be read is noted, not raised.
        since: clock_marker() at the capture's start (see take_census)."""
        try:
            census = take_census(graph, label, pool, traced=self.traced, pools=self.pools, since=since)
        except DriverError as e:
            self.errors.append(f"graph '{label}': {e}")
            return None
        self.censuses[label] = census
        if census.pool is not None:
            self.pool_names.setdefault(census.pool, f"graph '{label}'")
        self.match_before_the_trace_forgets(census)
        return census

    def match_before_the_trace_forgets(self, census: GraphCensus) -> None:
        """Pending words are matched at the first check; when the allocator has been so busy
        since the oldest pending capture that its trace (capacity entries) is half gone, match
        them now, against one snapshot (a long capture phase takes one every few thousand
        allocations, not one per graph)."""
        census.events_at = self.pools.events if self.pools.events is not None else allocator_events()
        if not self.capacity or census.events_at is None:
            return
        if census.pending:
            self.waiting.append(census)
        # Censuses come in capture order, so the oldest still pending is the first of the queue
        # whose words are not all matched or handed over (a scan of every census per capture
        # was quadratic: 2,211 piecewise graphs).
        while self.waiting and not self.still_waiting(self.waiting[0]):
            self.waiting.popleft()
        if self.waiting and census.events_at - self.waiting[0].events_at > self.capacity // 2:
            snapshot, device = self.snapshot()
            self.match([c for c in self.waiting if self.still_waiting(c)], snapshot, device)

    def still_waiting(self, census: GraphCensus) -> bool:
        """Has words to match, and is still the census of its label (not replaced by a
        capture again under that label)."""
        return bool(census.pending) and self.censuses.get(census.label) is census

    def resolve(self) -> None:
        """Match every pending word now, against one snapshot (then each census's references
        are complete; a check does this itself)."""
        waiting = [c for c in self.censuses.values() if c.pending]
        if waiting:
            snapshot, device = self.snapshot()
            self.match(waiting, snapshot, device)

    def pause_trace(self) -> bool:
        """Stop the allocator trace while no census waits on it (watch, between capture phases):
        recording it costs every allocation the program makes. Reuse at the same address of a
        block only the census sees is then not seen until the next capture resumes it."""
        if self.capacity is None or self.paused or any(c.pending for c in self.censuses.values()):
            return False
        import torch
        torch.cuda.memory._record_memory_history(enabled=None)
        self.paused = True
        return True

    def resume_trace(self) -> None:
        if self.paused:
            start_trace(self.capacity)
            self.paused = False

    def snapshot(self) -> tuple[dict[str, Any], int | None]:
        self.snapshots += 1
        snapshot, device = take_snapshot()
        self.pools.refresh(snapshot)
        return snapshot, device

    def match(self, chosen: list[GraphCensus], snapshot: dict[str, Any], device: int | None,
              now: BlockIndex | None = None, trace: Trace | None = None) -> None:
        """Match the pending words of the chosen censuses against one snapshot, in one pass
        over its trace for all of them (each from its own capture on)."""
        waiting = [c for c in chosen if c.pending]
        if not waiting:
            return
        now = now or BlockIndex.of(snapshot, device)
        trace = trace or Trace(trace_of(snapshot, 0 if device is None else device), self.capacity)
        starts = {c.label: trace.start(c.marker) for c in waiting}
        traced = [c for c in waiting if starts[c.label] is not None]
        points = entries_at_points(trace.entries, (w.addr for c in traced for w in c.pending),
                                   min((starts[c.label] for c in traced), default=0))
        for census in waiting:
            first = first_touches(census.pending, trace.entries, points, starts[census.label])
            match_pending(census, now, first, self.pool_names)

    def summary(self) -> list[dict[str, Any]]:
        return [c.summary() for c in self.censuses.values()]

    def census_line(self) -> str:
        return census_line(self.summary(), self.errors)

    def check(self, when: str, graph: str | None = None) -> list[Finding]:
        """One finding per captured block and status, listing every graph that holds it."""
        return self.check_graphs(when, [label for label in self.censuses if graph is None or label == graph])

    def check_graphs(self, when: str, labels: list[str]) -> list[Finding]:
        """Check several graphs against one snapshot (watch: every graph captured since the
        last check, at the first replay after them)."""
        chosen = [self.censuses[label] for label in labels if label in self.censuses]
        if not chosen:
            return []
        snapshot, device = self.snapshot()
        self.checked.update(c.label for c in chosen)
        return self.findings_from(chosen, snapshot, device, when)

    def findings_from(self, chosen: list[GraphCensus], snapshot: dict[str, Any], device: int | None,
                      when: str) -> list[Finding]:
        now = BlockIndex.of(snapshot, device)
        trace = Trace(trace_of(snapshot, 0 if device is None else device), self.capacity)
        self.match(chosen, snapshot, device, now, trace)
        # One pass over the trace (from the oldest capture still in it) for every captured
        # block of every graph checked.
        starts = [s for s in (trace.start(c.marker) for c in chosen) if s is not None]
        overlapping = entries_over_blocks(trace.entries, ((b.start, b.end) for c in chosen for b in c.blocks()),
                                          min(starts, default=len(trace.entries)))
        by_block: dict[int, tuple[Fate, list[tuple[GraphCensus, list[Reference]]], str]] = {}
        present = {seg["address"] for seg in snapshot.get("segments", [])}
        for census in chosen:
            for start, ref in census.own_segments.items():
                if start not in present and census.reported.get(start) != Status.RELEASED:
                    census.reported[start] = Status.RELEASED
                    fate = Fate(ref.block, Status.RELEASED, None, "allocator state")
                    entry = by_block.setdefault(start, (fate, [], "The graph's own pool segment: "
                                                        "its graph still lives."))
                    entry[1].append((census, [ref]))
            fates, note = census_fates(census, now, trace, overlapping)
            if note and note not in census.notes:
                census.notes.append(note)
            for fate in fates:
                census.reported[fate.block.start] = fate.status
                entry = by_block.setdefault(fate.block.start, (fate, [], note))
                entry[1].append((census, census.refs_of(fate.block)))
        findings = []
        for start, (fate, holders, note) in sorted(by_block.items()):
            if self.said.get(start) == fate.status:
                continue   # another graph's check already said it
            self.said[start] = fate.status
            refs = [r for _, rs in holders for r in rs]
            labels = ", ".join(c.label for c, _ in holders)
            finding = census_finding(holders[0][0].label, fate, refs, when, self.rank, note)
            finding.graph = labels
            finding.census["graphs"] = [c.label for c, _ in holders]
            findings.append(finding)
        return findings

    def dead_blocks(self, when: str) -> tuple[list[Finding], list[tuple[int, int]]]:
        """Findings of a full check, and the regions to fill for the after-free knob.

        A region is the free block that now holds a freed captured block (neighbouring free
        blocks coalesce, so it may be larger); released and reused blocks cannot be landed on.
        """
        if not self.censuses:
            return [], []
        snapshot, device = self.snapshot()
        self.checked.update(self.censuses)
        findings = self.findings_from(list(self.censuses.values()), snapshot, device, when)
        now = BlockIndex.of(snapshot, device)
        regions: dict[int, int] = {}
        for census in self.censuses.values():
            for block in census.blocks():
                current = now.find(block.start)
                if current is not None and not current.live and census.reported.get(block.start) == Status.FREED:
                    regions[current.start] = current.size
        return findings, sorted(regions.items())

    def references_in(self, start: int, end: int) -> list[tuple[str, Reference]]:
        return [(c.label, r) for c in self.censuses.values() for r in c.references
                if start <= r.addr < end or (r.block.start < end and start < r.block.end)]

    def held_in(self, start: int, end: int) -> bool:
        """Whether a census handed a word inside [start, end) to the guard (adopt)."""
        return any(start <= a < end for c in self.censuses.values() for a in c.held)

    def hand_over(self, census: GraphCensus, left: list[Any]) -> None:
        """The guard took every word of census.pending and census.references but `left`: those
        it took are checked through its storages from now on (counted in census.held)."""
        kept = {id(w) for w in left}
        for name in ("pending", "references"):
            words = getattr(census, name)
            census.held.extend(w.addr for w in words if id(w) not in kept)
            setattr(census, name, [w for w in words if id(w) in kept])
        census._grouped = None


def census_line(summary: list[dict[str, Any]], errors: list[str]) -> str:
    """One line: what the census read and what it set aside (those are not findings)."""
    total = {k: sum(c.get(k, 0) for c in summary) for k in
             ("kernels", "references", "held", "own_pool", "outside_allocator", "free_at_capture", "unreadable")}
    held = f" (and {total['held']} in storages the guard names, checked through it)" if total["held"] else ""
    text = (f"graph census: {len(summary)} graphs, {total['kernels']} kernels, {total['references']} captured "
            f"addresses outside their graph's pool checked{held}; not findings: {total['own_pool']} in the own "
            f"pool, {total['outside_allocator']} outside the allocator, {total['free_at_capture']} into "
            f"blocks already free at capture; {total['unreadable']} nodes unreadable")
    pools = sorted({p for c in summary for p in c["foreign_pools"]})
    if pools:
        text += f"; addresses in other pools ({', '.join(pools)}): a dependency on them"
    if errors:
        text += f"; not read: {'; '.join(errors)}"
    return text


def merge_findings(guard: list[Finding], census: list[Finding], slots: list[Any], guard_on: bool,
                   book: CensusBook | None) -> list[Finding]:
    """One list from both mechanisms; a storage both saw becomes one finding ("both").

    slots: the guard's recorded storages (name, storage_ptr, storage_nbytes, reported), so a
    census finding in a storage the guard knows carries its readable name. Where one mechanism
    saw something the other did not, ``disagreement`` says what the other one said.
    """
    out, used = [], set()
    for c in census:
        start, end = c.census["block_start"], c.census["block_start"] + c.census["block_size"]
        g = next((i for i, g in enumerate(guard) if i not in used and g.old_ptr < end and start < g.old_ptr + max(g.nbytes, 1)), None)
        if g is not None:
            used.add(g)
            merged = guard[g]
            merged.mechanism, merged.census = Mechanism.BOTH, c.census
            out.append(merged)
            continue
        if guard_on:
            slot = next((s for s in slots if s.storage_ptr < end and start < s.storage_ptr + max(s.storage_nbytes, 1)), None)
            if slot is None:
                c.disagreement = "the guard did not see this storage (it never passed the dispatcher)"
            elif slot.reported:
                c.slot, c.mechanism = slot.name, Mechanism.BOTH   # the guard said it at an earlier check
                c.census["guard_reported"] = sorted(slot.reported)
            else:
                c.slot = slot.name
                c.disagreement = f"the guard recorded this storage as {slot.name} and sees it alive"
        out.append(c)
    for i, g in enumerate(guard):
        if i in used:
            continue
        if book is not None and book.censuses:
            refs = book.references_in(g.old_ptr, g.old_ptr + max(g.nbytes, 1))
            if not refs and book.held_in(g.old_ptr, g.old_ptr + max(g.nbytes, 1)):
                pass     # the census handed this storage to the guard: one mechanism, no disagreement
            elif not refs:
                g.disagreement = "the census found no captured address in this storage"
            elif g.status == Status.REBOUND:
                g.disagreement = "the census sees the captured block still allocated (a rebinding is visible only to the guard)"
            elif g.status == Status.CONTENTS_CHANGED:
                g.disagreement = ("the census sees the captured block still allocated (changed bytes at the same "
                                  "address are visible only to the guard's fingerprint)")
            else:
                said = {book.said.get(r.block.start) for _, r in refs} - {None}
                g.disagreement = (f"the census reported this block earlier ({', '.join(sorted(said))})" if said
                                  else "the census sees the captured block still allocated")
        out.append(g)
    return out
