"""What a census records of one captured graph: its words, those matched to allocator blocks, and
the counts of what it set aside.

Word: a captured word that may point into allocator memory, not matched to a block yet.
Reference: a captured word and the block it pointed into at capture. GraphCensus: one graph's
words and references, with what is not a finding (own-pool words, addresses outside the
allocator, blocks already free at capture, unreadable nodes) counted. Plain data: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from repro.outcome import Status
from repro.diagnose.allocator import Block
from repro.diagnose.cuda_driver import NodeKind


@dataclass
class Reference:
    """One captured word that points into an allocator block."""

    node: int  # index of the node in the graph (child graphs flattened)
    kind: NodeKind  # KERNEL, MEMCPY or MEMSET: the nodes whose words are read
    kernel: str  # kernel name ("" for memcpy/memset)
    where: str  # "param 3 +8", "extra +1528", "src", "dst"
    offset: int  # byte offset in the parameter buffer (0 for memcpy/memset)
    addr: int  # the word's value
    block: Block

    def describe(self) -> str:
        return describe_site(self.node, self.kind, self.kernel, self.where)


def describe_site(node: int, kind: NodeKind, kernel: str, where: str) -> str:
    """'node 12 kernel gemv param 3 +0': where in a graph a captured word sits."""
    what = f"kernel {short_name(kernel)}" if kind == NodeKind.KERNEL else kind
    return f"node {node} {what} {where}"


def short_name(name: str, limit: int = 96) -> str:
    return name if len(name) <= limit else name[: limit - 3] + "..."


class Word(NamedTuple):
    """A captured word that may point into allocator memory; matched to a block later (a
    tuple: a full decoder graph holds thousands)."""

    node: int
    kind: NodeKind
    kernel: str
    where: str
    offset: int
    addr: int
    pool: tuple[int, int]  # the pool of its segment when read

    def describe(self) -> str:
        return describe_site(self.node, self.kind, self.kernel, self.where)


@dataclass
class GraphCensus:
    """What one captured graph holds, and how it compares with the allocator at capture time."""

    label: str
    pool: tuple[int, int] | None
    nodes: int = 0
    kernels: int = 0
    node_types: dict[str, int] = field(default_factory=dict)  # NodeKind (or "type N") -> nodes
    words: int = 0  # 8-byte words read from parameters and pointers
    references: list[Reference] = field(default_factory=list)  # outside the graph's own pool
    own_pool: int = 0  # references into the graph's own pool (safe)
    outside: int = 0  # device addresses outside any allocator block
    free_at_capture: int = 0  # words into blocks already free at census time
    unreadable: list[str] = field(default_factory=list)  # "node 12 kernel foo: why"
    foreign_pools: dict[str, int] = field(default_factory=dict)  # "pool (1, 2)" -> references
    marker: dict[str, Any] | None = None  # trace position at census time
    reported: dict[int, Status] = field(default_factory=dict)  # block start -> status said
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    sort_seconds: float = 0.0  # of seconds: sorting the words read (the rest: reading the nodes)
    # Words into memory of the default or another pool, not yet matched to allocator blocks:
    # matched at the first check, against the allocator then and its trace since the census
    # (no snapshot per capture: an engine captures thousands of graphs).
    pending: list[Word] = field(default_factory=list)
    # Segments of the own pool the graph reads (start -> its first word there): while the graph
    # lives its pool keeps them; one returned to the driver is a finding.
    own_segments: dict[int, Reference] = field(default_factory=dict)
    events_at: int | None = None  # allocator_events() at census time
    # Addresses of words the guard took (CaptureGuard.adopt): inside storages it names and holds
    # a weak reference to, so their lifetime is checked through it, not through the trace.
    held: list[int] = field(default_factory=list)
    # Words outside every allocator segment not yet asked of the driver (int64 tensors): a
    # CensusBook asks for all its graphs at once, at its next match or count (words.ask_outside),
    # and adds those it knows as device addresses to outside.
    unasked: list[Any] = field(default_factory=list)
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

    def counts(self) -> dict[str, Any]:
        """Counts for the trial record (no addresses of every word)."""
        return {
            "graph": self.label,
            "nodes": self.nodes,
            "kernels": self.kernels,
            "node_types": dict(self.node_types),
            "words": self.words,
            "references": len(self.references),
            "blocks": len(self.blocks()),
            "own_pool": self.own_pool,
            "outside_allocator": self.outside,
            "free_at_capture": self.free_at_capture,
            "unreadable": len(self.unreadable),
            "foreign_pools": dict(self.foreign_pools),
            "unmatched": len(self.pending),
            "held": len(self.held),
            "seconds": round(self.seconds, 6),
            "notes": list(self.notes),
        }
