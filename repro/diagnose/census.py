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
      matches every pending word now. ``merge_findings()`` (repro/diagnose/merge.py) joins census
      and guard findings into one list (mechanism "guard" | "census" | "both"), naming census findings after the
      guard's storage where the guard knows it and saying where the two disagree.

The census's parts, one job each, all beside this module in repro/diagnose/: cuda_driver (libcuda
through ctypes), graph_walk (a graph's nodes into words), words (the words sorted against the
allocator), allocator (its blocks, segments and counters), trace_index (its alloc/free trace),
captured (what a census records) and fates (what became of a captured block, as a Finding).

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

import collections
import time
from enum import StrEnum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from repro.outcome import Finding, Status
from repro.diagnose.allocator import (
    TRACE_ENTRIES,
    BlockIndex,
    PoolMap,
    allocator_events,
    pool_id,
    start_trace,
    take_snapshot,
)
from repro.diagnose.captured import GraphCensus, Reference
from repro.diagnose.cuda_driver import DriverError, load_driver
from repro.diagnose.fates import Fate, census_fates, census_finding
from repro.diagnose.graph_walk import read_graph, sort_words
from repro.diagnose.merge import merge_findings  # noqa: F401  (part of the census's API: the watch hooks call it through it)
from repro.diagnose.trace_index import Trace, clock_marker, entries_at_points, entries_over_blocks, marker_of, trace_of
from repro.diagnose.words import Chunks, Deferred, Matcher, ask_outside, first_touches, match_pending

if TYPE_CHECKING:  # annotations only: CUDA work is lazy, importing this module needs no torch
    import torch


class Tracing(StrEnum):
    """Where a CensusBook's allocator trace comes from."""

    START = "start"  # the book starts recording it (start_trace)
    # The same, each allocation with its Python stack (watch --stacks, which started it at CUDA's
    # initialisation already: the book keeps those settings, and never pauses the trace).
    STACKS = "stacks"
    EXTERNAL = "external"  # the caller already records memory history (with stacks)
    NONE = "none"  # no trace: the checks see state only


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


def take_census(
    graph: torch.cuda.CUDAGraph,
    label: str,
    pool: tuple[int, int] | None = None,
    snapshot: dict[str, Any] | None = None,
    pool_names: dict[tuple[int, int], str] | None = None,
    device: int | None = None,
    traced: bool = True,
    pools: PoolMap | None = None,
    since: dict[str, Any] | None = None,
    after_read: Callable[[GraphCensus], Any] | None = None,
    ask_later: bool = False,
) -> GraphCensus:
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
    after_read(census): called once every node is read, before the words are sorted (host
    work on bytes already read): from there on the census no longer touches the graph, so
    what else needs it (its instantiation) may go on meanwhile.
    ask_later: words outside the allocator are kept in census.unasked, for the driver to be
    asked about many graphs at once (CensusBook does at its next match or count), not now.
    """
    start = time.perf_counter()
    driver = load_driver()
    try:
        raw = graph.raw_cuda_graph()
    except RuntimeError as e:
        raise DriverError(
            f"graph '{label}' has no raw CUDA graph ({e}); create it with torch.cuda.CUDAGraph(keep_graph=True)"
        ) from None
    own = pool_id(pool if pool is not None else graph.pool())
    census = GraphCensus(label=label, pool=own)
    if snapshot is not None:
        match: Any = Matcher(BlockIndex.of(snapshot, device), own, pool_names or {}, driver.is_device_address)
        marker = marker_of(trace_of(snapshot, 0 if device is None else device))
    else:
        pools = pools or PoolMap()
        pools.check()
        match = Deferred(pools, own, driver.is_device_address, ask_later=ask_later)
        marker = since or clock_marker()
    chunks = Chunks()
    read_graph(driver, census, match, raw, chunks=chunks)
    if after_read is not None:
        after_read(census)
    sort_words(census, match, chunks)
    if traced:
        census.marker = marker
    else:
        census.notes.append("no allocator trace: reuse at the same address cannot be seen")
    census.seconds = time.perf_counter() - start
    return census


def check_census(
    census: GraphCensus,
    when: str,
    snapshot: dict[str, Any] | None = None,
    rank: int = 0,
    device: int | None = None,
    capacity: int | None = TRACE_ENTRIES,
) -> list[Finding]:
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


# -- one process's censuses, and the one finding model -------------------------------------------


class CensusBook:
    """The censuses of one process, checked together against one snapshot per check point.

    trace: where the allocator trace comes from (Tracing: START records it here, STACKS with
    each allocation's stack, EXTERNAL is the caller's memory history, NONE checks state only).
    """

    def __init__(self, rank: int = 0, trace: Tracing = Tracing.START, capacity: int = TRACE_ENTRIES):
        self.rank = rank
        started = trace in (Tracing.START, Tracing.STACKS)
        self.capacity = capacity if started else None
        self.stacks = trace == Tracing.STACKS
        self.traced = trace != Tracing.NONE
        self.censuses: dict[str, GraphCensus] = {}
        self.checked: set[str] = set()  # labels checked at least once
        self.errors: list[str] = []
        self.said: dict[int, Status] = {}  # block start -> status, across graphs
        self.pools = PoolMap()
        self.pool_names: dict[tuple[int, int], str] = {}  # pool -> "graph 'first label'"
        self.snapshots = 0  # allocator snapshots the book took
        self.paused = False  # trace stopped by pause_trace()
        self.waiting: collections.deque[GraphCensus] = collections.deque()  # with pending words, oldest first
        if started:
            start_trace(capacity, stacks=self.stacks)

    def add(
        self,
        graph: torch.cuda.CUDAGraph,
        label: str,
        pool: tuple[int, int] | None = None,
        since: dict[str, Any] | None = None,
        after_read: Callable[[GraphCensus], Any] | None = None,
    ) -> GraphCensus | None:
        """Census right after capture; a graph that cannot be read is noted, not raised.
        since, after_read: see take_census."""
        try:
            census = take_census(
                graph,
                label,
                pool,
                traced=self.traced,
                pools=self.pools,
                since=since,
                after_read=after_read,
                ask_later=True,
            )
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
        self.count_outside(list(self.censuses.values()))
        waiting = [c for c in self.censuses.values() if c.pending]
        if waiting:
            snapshot, device = self.snapshot()
            self.match(waiting, snapshot, device)

    def count_outside(self, censuses: list[GraphCensus]) -> None:
        """The words outside the allocator these censuses set aside (unasked), asked of the
        driver for all of them at once: once per 2 MiB page not asked before."""
        waiting = [c for c in censuses if c.unasked]
        if waiting:
            ask_outside(waiting, load_driver().is_device_address)

    def pause_trace(self) -> bool:
        """Stop the allocator trace while no census waits on it (watch, between capture phases):
        recording it costs every allocation the program makes. Reuse at the same address of a
        block only the census sees is then not seen until the next capture resumes it. With
        stacks, never: what is allocated between capture phases would have no stack."""
        if self.capacity is None or self.stacks or self.paused or any(c.pending for c in self.censuses.values()):
            return False
        import torch

        torch.cuda.memory._record_memory_history(enabled=None)
        self.paused = True
        return True

    def resume_trace(self) -> None:
        if self.paused:
            start_trace(self.capacity, stacks=self.stacks)
            self.paused = False

    def snapshot(self) -> tuple[dict[str, Any], int | None]:
        self.snapshots += 1
        snapshot, device = take_snapshot()
        self.pools.refresh(snapshot)
        return snapshot, device

    def match(
        self,
        chosen: list[GraphCensus],
        snapshot: dict[str, Any],
        device: int | None,
        now: BlockIndex | None = None,
        trace: Trace | None = None,
    ) -> None:
        """Match the pending words of the chosen censuses against one snapshot, in one pass
        over its trace for all of them (each from its own capture on); their words outside
        the allocator are counted meanwhile."""
        self.count_outside(chosen)
        waiting = [c for c in chosen if c.pending]
        if not waiting:
            return
        now = now or BlockIndex.of(snapshot, device)
        trace = trace or Trace(trace_of(snapshot, 0 if device is None else device), self.capacity)
        starts = {c.label: trace.start(c.marker) for c in waiting}
        traced = [c for c in waiting if starts[c.label] is not None]
        points = entries_at_points(
            trace.entries,
            (w.addr for c in traced for w in c.pending),
            min((starts[c.label] for c in traced), default=0),
        )
        for census in waiting:
            first = first_touches(census.pending, trace.entries, points, starts[census.label])
            match_pending(census, now, first, self.pool_names)

    def graph_counts(self) -> list[dict[str, Any]]:
        """Each graph's counts (GraphCensus.counts), for the trial record."""
        self.count_outside(list(self.censuses.values()))
        return [c.counts() for c in self.censuses.values()]

    def census_line(self) -> str:
        return census_line(self.graph_counts(), self.errors)

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

    def findings_from(
        self, chosen: list[GraphCensus], snapshot: dict[str, Any], device: int | None, when: str
    ) -> list[Finding]:
        now = BlockIndex.of(snapshot, device)
        trace = Trace(trace_of(snapshot, 0 if device is None else device), self.capacity)
        self.match(chosen, snapshot, device, now, trace)
        # One pass over the trace (from the oldest capture still in it) for every captured
        # block of every graph checked.
        starts = [s for s in (trace.start(c.marker) for c in chosen) if s is not None]
        overlapping = entries_over_blocks(
            trace.entries,
            ((b.start, b.end) for c in chosen for b in c.blocks()),
            min(starts, default=len(trace.entries)),
        )
        by_block: dict[int, tuple[Fate, list[tuple[GraphCensus, list[Reference]]], str]] = {}
        present = {seg["address"] for seg in snapshot.get("segments", [])}
        for census in chosen:
            for start, ref in census.own_segments.items():
                if start not in present and census.reported.get(start) != Status.RELEASED:
                    census.reported[start] = Status.RELEASED
                    fate = Fate(ref.block, Status.RELEASED, None, "allocator state")
                    entry = by_block.setdefault(
                        start, (fate, [], "The graph's own pool segment: its graph still lives.")
                    )
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
                continue  # another graph's check already said it
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
        return [
            (c.label, r)
            for c in self.censuses.values()
            for r in c.references
            if start <= r.addr < end or (r.block.start < end and start < r.block.end)
        ]

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


def census_line(graph_counts: list[dict[str, Any]], errors: list[str]) -> str:
    """One line: what the census read and what it set aside (those are not findings)."""
    total = {
        k: sum(c.get(k, 0) for c in graph_counts)
        for k in ("kernels", "references", "held", "own_pool", "outside_allocator", "free_at_capture", "unreadable")
    }
    held = f" (and {total['held']} in storages the guard names, checked through it)" if total["held"] else ""
    text = (
        f"graph census: {len(graph_counts)} graphs, {total['kernels']} kernels, {total['references']} captured "
        f"addresses outside their graph's pool checked{held}; not findings: {total['own_pool']} in the own "
        f"pool, {total['outside_allocator']} outside the allocator, {total['free_at_capture']} into "
        f"blocks already free at capture; {total['unreadable']} nodes unreadable"
    )
    pools = sorted({p for c in graph_counts for p in c["foreign_pools"]})
    if pools:
        text += f"; addresses in other pools ({', '.join(pools)}): a dependency on them"
    if errors:
        text += f"; not read: {'; '.join(errors)}"
    return text
