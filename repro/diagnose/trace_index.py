"""The allocator trace, indexed once per check: which entries touch which captured address.

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
from collections.abc import Iterable
from typing import Any

FREE_ACTIONS = ("free_requested", "free_completed")
RELEASE_ACTIONS = ("segment_free", "segment_unmap")
ALLOC_ACTIONS = ("alloc",)
POINT_ACTIONS = FREE_ACTIONS + ALLOC_ACTIONS          # what decides a word's captured block
BLOCK_ACTIONS = FREE_ACTIONS + ALLOC_ACTIONS + RELEASE_ACTIONS


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


def entries_over_blocks(trace: list[dict[str, Any]], blocks: Iterable[tuple[int, int]],
                        begin: int = 0) -> dict[tuple[int, int], list[int]]:
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
    return positions[bisect.bisect_left(positions, start):]
