"""Capture recording: what each capture holds, learnt while the program captures.

At capture_begin the capture gets its GraphState and its site, the owners the capturing code
holds are named for the guard (owners.py), and either the census clock is noted (the census makes the
guard's slots at capture end) or the guard records every op at the dispatcher until
capture_end. At capture_end the census reads the graph, and every captured storage is placed
in a graph pool (the pool contract, cross-pool dependencies).
"""

from __future__ import annotations

import os
import time
import weakref
from types import FrameType
from typing import TYPE_CHECKING, Any

from repro.watch.hooks.graphs import GraphState
from repro.watch.hooks.instantiate import Instantiation
from repro.watch.hooks.owners import Owners
from repro.watch.hooks.part import Part
from repro.watch.settings import Record, WatchSettings

if TYPE_CHECKING:  # annotations only: nothing here imports torch until the program does
    import torch

    from repro.diagnose.allocator import PoolMap
    from repro.watch.hooks.graphs import GraphStates
    from repro.watch.hooks.records import Log
    from repro.watch.hooks.tools import Tools

# cudagraph trees (torch.compile mode="reduce-overhead") reuse their pool's memory for outputs
# whose Python tensors died, by design, and check their own invariants: their graphs are
# counted as managed and not checked, or every dead intermediate would read as a finding.
MANAGED_CALLERS = (os.path.join("_inductor", "cudagraph_trees.py"),)


class Captures(Part):
    """The capture hooks of one process."""

    def __init__(self, settings: WatchSettings, log: Log, graphs: GraphStates, tools: Tools):
        super().__init__(settings, log, graphs, tools)
        # graphs whose cudaGraph_t outlives capture_end (for the census): True where we forced it
        self.kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.owners = Owners()
        self.pools: PoolMap | None = None  # which graph pool an address is in
        self.cross_pool = 0  # captured storages in another graph's pool (checked)

    def prepare(self) -> None:
        """Before the capture begins: imports happen here, not inside it."""
        try:
            self.tools.ensure_guard()
            book = self.tools.census.book  # made with the guard
            if book is not None:
                book.resume_trace()  # a capture phase: the census needs the trace
        except Exception as e:
            self.log.internal("loading the guard", e)

    def begin(self, graph: torch.cuda.CUDAGraph, frame: FrameType | None, pool: Any = None) -> None:
        """pool: what the program passed to capture_begin (a shared pool's id); None means a
        fresh private pool, which holds nothing made before this capture."""
        t0 = time.perf_counter()
        try:
            guard = self.tools.ensure_guard()
            self.log.counters.captures += 1
            site, managed = capture_site(frame, guard.plumbing)
            state = GraphState(label=f"#{self.log.counters.captures} {site}", site=site, managed=managed)
            state.kept = self.kept.get(graph)
            state.pool = pool_id(pool)  # torch answers graph.pool() only after the capture
            self.graphs[graph] = state
            if managed:
                self.log.counters.managed += 1
                return
            self.owners.watch(guard, frame)
            if self.by_census(state):
                state.since = self.tools.census.module.clock_marker()
            else:
                state.recording = guard.recording(
                    state.label, state.pool, self.pools.graph_pool_of if self.pools is not None else None
                )
                state.recording.__enter__()
        except Exception as e:
            self.log.internal("capture_begin", e)
        self.log.seconds.capture_begin += time.perf_counter() - t0

    def stop_recording(self, graph: torch.cuda.CUDAGraph) -> None:
        """Before torch ends the capture: the guard's recording, if any, stops."""
        state = self.graphs.get(graph)
        if state is None or state.recording is None:
            return
        recording, state.recording = state.recording, None
        try:
            recording.__exit__(None, None, None)
        except Exception as e:
            self.log.internal("capture_end (recording)", e)

    def by_census(self, state: GraphState) -> bool:
        """Whether this capture's slots come from its census (no per-op recording)."""
        return state.kept is not None and self.tools.census.book is not None and self.settings.record == Record.GRAPH

    def end(self, graph: torch.cuda.CUDAGraph, frame: FrameType | None = None) -> None:
        """frame: the frame that ended the capture (its locals name what the graph holds)."""
        state = self.graphs.get(graph)
        if state is None:
            return
        state.captured = True
        state.pool = graph_pool(graph) or state.pool
        book = self.tools.census.book
        # Ours to instantiate (keep_graph forced): on a thread while the census sorts what it read.
        instantiation = Instantiation(graph) if state.kept else None
        t0 = time.perf_counter()
        try:
            if state.kept is not None and not state.managed and book is not None:
                state.census = book.add(  # None: unreadable (noted)
                    graph,
                    state.label,
                    state.pool,
                    since=state.since,
                    after_read=instantiation.start if instantiation is not None else None,
                )
                if state.census is not None:
                    census = state.census
                    self.log.seconds.census_read += census.seconds - census.sort_seconds
                    self.log.seconds.census_sort += census.sort_seconds
                    self.tools.census.due.append(state.label)
                    if state.since is not None:
                        t2 = time.perf_counter()
                        words = [*census.pending, *census.references]
                        sites = self.tools.allocation_sites()
                        left = self.tools.guard.adopt(state.label, words, frame, sites)
                        book.hand_over(census, left)
                        self.log.seconds.census_names += time.perf_counter() - t2
        except Exception as e:
            self.log.internal("census at capture end", e)
        t1 = time.perf_counter()
        self.log.seconds.census += t1 - t0
        self.assign_pools(state, checked=state.census is not None)
        if instantiation is not None:
            instantiation.finish()  # where torch instantiates a graph without keep_graph
        try:
            rank = self.log.current_rank()
            self.log.write(
                {
                    "kind": "capture",
                    "graph": state.label,
                    "managed": state.managed,
                    "rank": rank,
                    "pool": list(state.pool) if state.pool else None,
                    "census": state.census is not None,
                    "slots": len(self.tools.guard.slots_of(state.label)),
                }
            )
        except Exception as e:
            self.log.internal("capture_end", e)
        self.log.seconds.capture_end += time.perf_counter() - t1

    def assign_pools(self, state: GraphState, checked: bool = False) -> None:
        """Which captured storages live in a graph pool: in the graph's own pool they are the
        pool's business (not checked); in another graph's pool, a cross-pool dependency.
        checked: the census just brought the segment map up to date (nothing allocated since)."""
        if state.managed or state.pool is None:
            return
        try:
            if self.pools is None:
                from repro.diagnose.allocator import PoolMap

                book = self.tools.census.book
                self.pools = book.pools if book is not None else PoolMap()
            if not checked:
                self.pools.check()
            cross = self.tools.guard.assign_pools(state.label, state.pool, self.pools.graph_pool_of)
            self.cross_pool += len(cross)
            if cross:
                self.log.write(
                    {
                        "kind": "cross_pool",
                        "graph": state.label,
                        "storages": [{"slot": s.name, "pool": list(s.pool)} for s in cross[:8]],
                        "count": len(cross),
                    }
                )
        except Exception as e:
            self.log.internal("assigning graph pools", e)


def capture_site(frame, plumbing: frozenset[str] = frozenset()) -> tuple[str, bool]:
    """'file:line in func' of the code that asked for the capture, and whether that code is
    torch.compile's cudagraph trees (the first frame above torch/cuda/graphs.py)."""
    graphs_file = os.path.join("torch", "cuda", "graphs.py")
    while frame is not None and frame.f_code.co_filename.endswith(graphs_file):
        frame = frame.f_back
    if frame is None:
        return "<unknown>", False
    managed = frame.f_code.co_filename.endswith(MANAGED_CALLERS)
    from repro.diagnose.sites import frame_site, user_frame

    return frame_site(user_frame(frame, plumbing) or frame), managed


def graph_pool(graph: torch.cuda.CUDAGraph) -> tuple[int, int] | None:
    """The id of the pool a captured graph allocates from (torch answers once the capture ended)."""
    try:
        return pool_id(graph.pool())
    except Exception:
        return None


def pool_id(pool) -> tuple[int, int] | None:
    try:
        a, b = pool
        return int(a), int(b)
    except (TypeError, ValueError):
        return None
