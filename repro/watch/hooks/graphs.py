"""What the hooks know of each graph: a GraphState per CUDAGraph object, from its capture on.

Capture recording fills it in, the checks at replay read and settle it, a reset of it or of
another graph unsettles it. The replay wrapper (patch.py) reads the Gate (is every graph
outside its held set settled as of the drop count now? with nothing held, it stands aside)
and, when the gate is stale, GraphState.fast_at.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from repro.diagnose.drops import DropCount

if TYPE_CHECKING:  # annotations only: nothing here imports torch until the program does
    import torch

    from repro.diagnose.captured import GraphCensus


@dataclass
class GraphState:
    label: str  # "#3 decode.py:41 in capture" (unique per capture)
    site: str
    managed: bool = False  # captured by torch.compile's cudagraph trees: counted only
    recording: Any = None  # the guard's recording context while capturing
    since: dict | None = None  # census clock marker at capture_begin: slots come from the census
    census: GraphCensus | None = None  # taken at capture end
    deep_reason: str | None = "first replay after capture"
    live: tuple[int, ...] | None = None  # storage handles the liveness fast path tests
    # The guard's drop count as of which a replay needs nothing from the hooks: the graph is
    # captured, deep-checked, not torch.compile's, and every storage of `live` was seen alive
    # and tells its death (a drop callback). While the count has not moved, no captured
    # storage died since. -1: the next replay takes the checking path (anything that asks for
    # a check sets it back to -1: see GraphStates.hold).
    fast_at: int = -1
    kept: bool | None = None  # cudaGraph_t kept past capture_end (census): True = forced by us
    captured: bool = False
    pool: tuple[int, int] | None = None  # the graph pool it allocates from (graph.pool())
    key: int = 0  # id() of its graph object


class Mode(IntEnum):
    """How much the replay wrappers test (each keeps it in its own closure: the cheapest test
    Python has; compared there as plain ints)."""

    ASIDE = 0  # nothing held, no captured storage died since every graph settled: no test
    HELD = 1  # no death since every graph outside `held` settled: only held graphs are checked
    STALE = 2  # a captured storage died since: every graph takes the per-graph test


@dataclass
class Gate:
    """What the replay wrappers (patch.py) test before a replay, and when they test nothing.

    Every graph whose id is not in `held` is settled (GraphState.fast_at == at) while the drop
    count is still `at`: its replay needs nothing from the hooks. A graph is held from its
    capture until a check settles it, and again whenever something asks for its check (a reset,
    a storage seen dead); graphs that never settle (torch.compile's, storages without a drop
    callback) stay held. One dead captured storage moves the drop count past `at`: the gate is
    stale and every replay takes the per-graph test (fast_at) until Checks.reopen has tested the
    settled graphs' storages once and moved `at` on.

    The wrappers learn the Mode through their setters (`armers`) whenever it changes (and,
    standing aside, take themselves off the class: patch.py): at a
    death (the drop count's listener, inside the deallocation, so the next replay of the graph
    that lost the storage is checked), a capture, a hold, a settle, a reopen. On a host-bound
    piecewise step (33 replays between eager ops, the wrapper's code and data cold each time)
    the per-graph lookup cost ~2.2-2.6 us a replay, the gate's full test ~1.1-1.4 us, a wrapper
    that only calls torch's replay 0-1.3 us: standing aside, none is on the path
    (docs/PERFORMANCE.md).
    """

    drops: DropCount
    at: int = -1  # the drop count as of which every graph outside `held` is settled
    held: set[int] = field(default_factory=set)  # ids of graphs whose replays are checked
    stale_replays: int = 0  # replays that took the per-graph path since `at` went stale
    mode: Mode = Mode.STALE
    armers: list[Callable[[int], None]] = field(default_factory=list)  # each wrapper's mode setter
    asides: int = 0  # times the wrappers stood aside (replays meanwhile are torch's, uncounted)

    def hold(self, key: int) -> None:
        self.held.add(key)
        self.update()

    def release(self, key: int) -> None:
        self.held.discard(key)
        self.update()

    def update(self) -> None:
        """Tell the wrappers what to test, where that changed."""
        mode = Mode.STALE if self.at != self.drops.n else Mode.HELD if self.held else Mode.ASIDE
        if mode != self.mode:
            self.mode = mode
            self.asides += mode == Mode.ASIDE
            for set_mode in self.armers:
                set_mode(int(mode))


class GraphStates:
    """GraphState per graph object, keyed by id and dropped when the graph dies (a weak
    reference; a graph class without them is held for the process's life)."""

    def __init__(self, drops: DropCount):
        self.by_id: dict[int, tuple[Any, GraphState]] = {}
        self.gate = Gate(drops)
        drops.on_drop = self.gate.update  # a death: the wrappers test every graph again

    def get(self, graph: torch.cuda.CUDAGraph) -> GraphState | None:
        entry = self.by_id.get(id(graph))
        return entry[1] if entry is not None and entry[0]() is graph else None

    def __getitem__(self, graph: torch.cuda.CUDAGraph) -> GraphState:
        state = self.get(graph)
        if state is None:
            raise KeyError(graph)
        return state

    def __setitem__(self, graph: torch.cuda.CUDAGraph, state: GraphState) -> None:
        key = state.key = id(graph)
        try:
            ref = weakref.ref(graph, lambda _, key=key, states=self: states.forget(key))
        except TypeError:
            ref = (lambda g: lambda: g)(graph)
        self.by_id[key] = (ref, state)
        self.gate.hold(key)  # checked until a replay settles it

    def forget(self, key: int) -> None:
        """The graph object died: its id may come back on another object."""
        self.by_id.pop(key, None)
        self.gate.release(key)

    def hold(self, state: GraphState, deep_reason: str | None = None) -> None:
        """Its next replay is checked (deeply, with a reason)."""
        state.fast_at = -1
        if deep_reason is not None:
            state.deep_reason = deep_reason
        self.gate.hold(state.key)

    def settle(self, state: GraphState) -> None:
        """Checked, its storages alive and each telling its death: replays pass until one dies."""
        state.fast_at = self.gate.drops.n
        self.gate.release(state.key)

    def unheld(self) -> list[GraphState]:
        """States of the graphs the gate lets through (while it is not stale)."""
        held = self.gate.held
        return [state for key, (_, state) in list(self.by_id.items()) if key not in held]

    def values(self) -> list[GraphState]:
        return [state for _, state in list(self.by_id.values())]

    def captured(self) -> list[GraphState]:
        """States of the graphs captured and not reset since."""
        return [s for s in self.values() if s.captured]
