"""What became of a captured block since its census, and the Finding that says so.

A block is freed (cached, inactive), released (its segment went back to the driver) or reused
(freed and allocated again: at the same address only the allocator trace shows it). fate_of
reads the allocator now first, and the trace since the census for reuse; census_fates asks it
for every block of a census not reported yet. census_finding names kernel, parameter and block;
merge.merge_findings adds the guard's name where it knows one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from repro.outcome import Finding, Mechanism, Status
from repro.diagnose.allocator import Block, BlockIndex
from repro.diagnose.captured import GraphCensus, Reference
from repro.diagnose.trace_index import (
    ALLOC_ACTIONS,
    FREE_ACTIONS,
    RELEASE_ACTIONS,
    Trace,
    entries_over_blocks,
    overlaps,
    since,
)


@dataclass
class Fate:
    """What happened to one captured block since the census."""

    block: Block
    status: Status  # FREED, RELEASED or REUSED
    current: Block | None  # the block at its address now (None: released)
    how: str  # "allocator state" | "allocator trace"


def traced_fate(block: Block, events: list[dict[str, Any]]) -> Status | None:
    """From the events since the census: REUSED (freed, then allocated again), RELEASED or FREED.

    Only a free of an allocation overlapping the block starts its fate; an alloc counts only
    after such a free (before it, the block was ours), a segment release likewise.
    """
    fate = None
    for e in events:
        action = e.get("action")
        if action in FREE_ACTIONS and overlaps(e, block.start, block.end):
            fate = fate or Status.FREED
        elif fate is not None and action in RELEASE_ACTIONS and overlaps(e, block.start, block.end):
            fate = Status.RELEASED
        elif fate is not None and action in ALLOC_ACTIONS and overlaps(e, block.start, block.end):
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


def census_fates(
    census: GraphCensus, now: BlockIndex, trace: Trace, overlapping: dict[tuple[int, int], list[int]] | None = None
) -> tuple[list[Fate], str]:
    """Fates of the census's blocks not reported yet, and a note when the trace was lost.
    overlapping: entries_over_blocks over (at least) this census's blocks, shared by every
    census of one check; computed here when not given."""
    start = trace.start(census.marker)
    note = (
        ""
        if start is not None or census.marker is None
        else (
            "The allocator trace no longer reaches the capture: reuse at the same address cannot be "
            "seen, only freed and released blocks."
        )
    )
    blocks = [b for b in census.blocks() if b.start not in census.reported]
    if overlapping is None and start is not None:
        overlapping = entries_over_blocks(trace.entries, ((b.start, b.end) for b in blocks), start)
    fates = []
    for block in blocks:
        events = (
            None
            if start is None
            else [trace.entries[p] for p in since((overlapping or {}).get((block.start, block.end), []), start)]
        )
        fate = fate_of(block, now, events)
        if fate is not None:
            fates.append(fate)
    return fates, note


def census_finding(
    label: str, fate: Fate, refs: list[Reference], when: str, rank: int, trace_note: str = ""
) -> Finding:
    """A census finding: kernel + parameter + block; the guard's name is added by merge."""
    block, first = fate.block, refs[0]
    name = f"<block {block.start:#x} read by {first.describe()}>"
    detail = {
        "block_start": block.start,
        "block_size": block.size,
        "block_pool": list(block.pool),
        "status": fate.status,
        "how": fate.how,
        "references": len(refs),
        "kernel": first.kernel,
        "node": first.node,
        "where": first.where,
        "offset": first.offset,
        "addr": first.addr,
        "sites": [r.describe() for r in refs[:8]],
    }
    if fate.current is not None:
        detail["now"] = {
            "start": fate.current.start,
            "size": fate.current.size,
            "state": fate.current.state,
            "pool": list(fate.current.pool),
        }
    return Finding(
        slot=name,
        graph=label,
        status=fate.status,
        when=when,
        rank=rank,
        shape=[],
        dtype="",
        nbytes=block.size,
        old_ptr=first.addr,
        new_ptr=None,
        message=census_message(label, fate, refs, trace_note),
        mechanism=Mechanism.CENSUS,
        census=detail,
    )


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
    said = {
        Status.FREED: "has been freed (cached, inactive)",
        Status.RELEASED: "has been returned to the driver",
        Status.REUSED: "was freed and allocated again",
    }[fate.status]
    sites = "; ".join(r.describe() for r in refs[:3]) + (f" and {len(refs) - 3} more" if len(refs) > 3 else "")
    text = (
        f"graph '{label}' holds {refs[0].addr:#x} in {sites}; the allocator block "
        f"{block.start:#x} ({block.size} bytes, pool {block.pool}) {said} "
        f"(seen in the {fate.how}). {CENSUS_FIX[fate.status]}"
    )
    return text + (f" {trace_note}" if trace_note else "")
