"""What the hooks know of each graph: a GraphState per CUDAGraph object, from its capture on.

Capture recording fills it in, the checks at replay read and settle it (GraphState.fast_at is
what the replay wrapper's fast path tests), a reset of it or of another graph unsettles it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
    replays: int = 0
    live: tuple[int, ...] | None = None  # storage handles the liveness fast path tests
    # The guard's drop count as of which a replay needs nothing from the hooks: the graph is
    # captured, deep-checked, not torch.compile's, and every storage of `live` was seen alive
    # and tells its death (a drop callback). While the count has not moved, no captured
    # storage died since. -1: the next replay takes the checking path (anything that asks for
    # a check sets it back to -1: see `unsettle`).
    fast_at: int = -1
    kept: bool | None = None  # cudaGraph_t kept past capture_end (census): True = forced by us
    captured: bool = False
    pool: tuple[int, int] | None = None  # the graph pool it allocates from (graph.pool())

    def unsettle(self, deep_reason: str | None = None) -> None:
        """The next replay is checked (deeply, with a reason)."""
        self.fast_at = -1
        if deep_reason is not None:
            self.deep_reason = deep_reason


class GraphStates:
    """GraphState per graph object, keyed by id and dropped when the graph dies (a weak
    reference; a graph class without them is held for the process's life)."""

    def __init__(self):
        self.by_id: dict[int, tuple[Any, GraphState]] = {}

    def get(self, graph: torch.cuda.CUDAGraph) -> GraphState | None:
        entry = self.by_id.get(id(graph))
        return entry[1] if entry is not None and entry[0]() is graph else None

    def __getitem__(self, graph: torch.cuda.CUDAGraph) -> GraphState:
        state = self.get(graph)
        if state is None:
            raise KeyError(graph)
        return state

    def __setitem__(self, graph: torch.cuda.CUDAGraph, state: GraphState) -> None:
        key = id(graph)
        try:
            ref = weakref.ref(graph, lambda _, key=key, by_id=self.by_id: by_id.pop(key, None))
        except TypeError:
            ref = (lambda g: lambda: g)(graph)
        self.by_id[key] = (ref, state)

    def values(self) -> list[GraphState]:
        return [state for _, state in list(self.by_id.values())]

    def captured(self) -> list[GraphState]:
        """States of the graphs captured and not reset since."""
        return [s for s in self.values() if s.captured]
