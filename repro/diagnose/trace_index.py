"""The allocator's alloc/free trace: where a census's part of it starts, and which entries touch
which captured address.

A census is placed in the trace by a marker (its last few entries, ``marker_of``, or the clock,
``clock_marker``); ``Trace`` finds where that part starts in a later snapshot, or says that the
bounded ring has wrapped past it. forensics.py reads the same entries (``overlaps``).

A census check asks, for every captured word of every graph checked, "what is the first alloc
or free touching this address since that graph's capture?", and for every captured block "which
frees, allocations and segment releases touched it since?". Asked graph by graph, each question
is a pass over the whole trace: 2,211 piecewise graphs x 8,192 entries was most of what
`repro watch` cost an engine-shaped program (docs/PERFORMANCE.md, run 4). Here the trace is
read once per check: every entry that touches a queried address (or block) is listed under it,
in trace order, and each graph then looks up only its own addresses from its own start position.

Pure Python on torch's snapshot format (``device_traces`` entries: action, addr, size,
time_us); no torch, no CUDA.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

FREE_ACTIONS = ("free_requested", "free_completed")
RELEASE_ACTIONS = ("segment_free", "segment_unmap")
ALLOC_ACTIONS = ("alloc",)
POINT_ACTIONS = FREE_ACTIONS + ALLOC_ACTIONS  # what decides a word's captured block
BLOCK_ACTIONS = FREE_ACTIONS + ALLOC_ACTIONS + RELEASE_ACTIONS


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
    return (entry.get("action"), entry.get("addr"), entry.get("size"), entry.get("stream"), entry.get("time_us"))


@dataclass
class Trace:
    """One snapshot's allocator trace, and where each census's part of it starts."""

    entries: list[dict[str, Any]]
    capacity: int | None = None  # the ring's max_entries (None: unknown or unbounded)
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
            if entry_key(trace[i]) == last[-1] and [entry_key(e) for e in trace[i - n + 1 : i + 1]] == last:
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
        if self._times is None:  # once per snapshot, however many censuses ask
            self._times = [e["time_us"] for e in trace]
        return bisect.bisect_right(self._times, time_us)

    def since(self, marker: dict[str, Any] | None) -> list[dict[str, Any]] | None:
        start = self.start(marker)
        return None if start is None else self.entries[start:]


def overlaps(entry: dict[str, Any], start: int, end: int) -> bool:
    """Whether the entry's range [addr, addr + size) overlaps [start, end); an entry without an
    address overlaps nothing."""
    addr = entry.get("addr")
    return addr is not None and addr < end and start < addr + entry.get("size", 0)


def ranges_of(trace: list[dict[str, Any]], actions: tuple[str, ...], begin: int = 0) -> list[tuple[int, int, int]]:
    """(start, end, position) of every entry from position `begin` on with an address and one
    of the actions."""
    out = []
    for i in range(begin, len(trace)):
        e = trace[i]
        addr = e.get("addr")
        if addr is not None and e.get("action") in actions:
            out.append((addr, addr + e.get("size", 0), i))
    return out


def entries_at_points(trace: list[dict[str, Any]], addrs: Iterable[int], begin: int = 0) -> dict[int, list[int]]:
    """address -> trace positions (ascending, from `begin` on) of the allocs and frees whose
    range holds it.

    One pass over the trace with the addresses sorted: O(entries x log addresses + hits)."""
    points = sorted(set(addrs))
    out: dict[int, list[int]] = {}
    if not points:
        return out
    for start, end, i in ranges_of(trace, POINT_ACTIONS, begin):
        lo = bisect.bisect_left(points, start)
        hi = bisect.bisect_left(points, end, lo)
        for a in points[lo:hi]:
            out.setdefault(a, []).append(i)
    return out


def entries_over_blocks(
    trace: list[dict[str, Any]], blocks: Iterable[tuple[int, int]], begin: int = 0
) -> dict[tuple[int, int], list[int]]:
    """(block start, end) -> trace positions (ascending, from `begin` on) of the frees, allocs
    and segment releases whose range overlaps the block. Blocks may overlap each other (graphs captured
    at different times); each is answered on its own."""
    spans = sorted(set(blocks))
    out: dict[tuple[int, int], list[int]] = {}
    if not spans:
        return out
    starts = [s for s, _ in spans]
    longest = max(e - s for s, e in spans)
    for start, end, i in ranges_of(trace, BLOCK_ACTIONS, begin):
        # A block overlaps [start, end) when it begins before end and ends after start; with
        # the longest block known, only starts in (start - longest, end) can.
        lo = bisect.bisect_right(starts, start - longest)
        hi = bisect.bisect_left(starts, end, lo)
        for span in spans[lo:hi]:
            if span[1] > start and span[0] < end:
                out.setdefault(span, []).append(i)
    return out


def first_from(positions: list[int], start: int) -> int | None:
    """The first position >= start in an ascending list, or None."""
    k = bisect.bisect_left(positions, start)
    return positions[k] if k < len(positions) else None


def since(positions: list[int], start: int) -> list[int]:
    """The positions >= start of an ascending list."""
    return positions[bisect.bisect_left(positions, start) :]
