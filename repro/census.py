"""Graph census: read what a captured CUDA graph really touches, and check it against the allocator.

The stale-capture guard (repro/guard.py) sees tensors at the PyTorch dispatcher. A captured
graph can hold addresses the dispatcher never saw: raw Triton launches, C++/CUDA extensions
that take raw pointers, library-internal buffers (cuBLAS/cuBLASLt workspaces), pointers packed
inside parameter structs. The census reads the graph itself through the CUDA driver API and
matches every address-sized word in it against the caching allocator's blocks.

API (all CUDA work is lazy: importing this module needs neither CUDA nor a driver):

  census_supported() -> (ok, reason)
      CUDA is available, libcuda can be loaded, and this torch has
      ``torch.cuda.CUDAGraph(keep_graph=True)`` / ``raw_cuda_graph()``. reason says what is missing.

  take_census(graph, label, pool=None, snapshot=None) -> GraphCensus
      Call after capture_end on a graph made with ``CUDAGraph(keep_graph=True)`` (before or after
      ``graph.instantiate()``: the raw graph is kept either way). Reads every node: for kernel
      nodes the whole parameter buffer (per-parameter offsets and sizes from
      ``cuFuncGetParamInfo`` / ``cuKernelGetParamInfo``, or the single ``extra`` buffer that
      cuBLASLt's kernels pass), for memcpy/memset nodes their device pointers; child graphs are
      walked. Each 8-byte aligned word is matched against the allocator's blocks of ONE snapshot
      (taken here unless given): kept are kernel name, node index, parameter offset, block start/
      size/pool and whether the block is in the graph's own pool. pool: the graph's private pool
      handle (default ``graph.pool()``).

  check_census(census, when, snapshot=None) -> list[Finding]
      Deep check of the captured blocks against the allocator now: a block freed (cached,
      inactive), its segment returned to the driver ("released"), or freed and allocated again
      since the census ("reused": read from the allocator's alloc/free trace, so reuse at the same
      address is caught). Own-pool blocks and addresses outside the allocator at capture
      (NCCL buffers, static device memory) are not findings; GraphCensus counts them. Each block
      is reported once per status. Nothing here runs per replay.

  CensusBook: the censuses of one process (one per graph label) and the allocator trace they
      share; ``dead_blocks()`` gives the after-free knob its targets, ``check()`` checks several
      graphs against one snapshot, ``merge()`` joins census and guard findings into one list
      (mechanism "guard" | "census" | "both"), naming census findings after the guard's storage
      where the guard knows it and saying where the two disagree.

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
  * a word that happens to equal an address inside a block is counted as a reference: integers
    in parameters can alias (rare for 64-bit device addresses; reported with kernel + offset so
    it can be judged);
  * the trace is bounded (``TRACE_ENTRIES``); when it wrapped past a census's marker, reuse at the
    same address can no longer be told from the block never having been freed, and the check
    says so in GraphCensus.notes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from repro.outcome import Finding

# Allocator trace kept while censuses are live; without stacks an entry is ~100 bytes.
TRACE_ENTRIES = 50_000
WORD = 8                                   # device addresses are 64-bit, naturally aligned


@dataclass
class Block:
    """One caching-allocator block, from a snapshot."""
    start: int
    size: int
    state: str                             # "active_allocated" | "active_awaiting_free" | "inactive"
    pool: tuple[int, int]                  # segment_pool_id; (0, 0) is the default pool
    segment: int                           # start address of its segment


@dataclass
class Reference:
    """One captured word that points into an allocator block."""
    node: int                              # index of the node in the graph (child graphs flattened)
    kind: str                              # "kernel" | "memcpy" | "memset"
    kernel: str                            # kernel name ("" for memcpy/memset)
    where: str                             # "param 3 +8", "extra +1528", "src", "dst"
    offset: int                            # byte offset in the parameter buffer (or 0)
    addr: int                              # the word's value
    block: Block


@dataclass
class GraphCensus:
    """What one captured graph holds, and how it compares with the allocator at capture time."""
    label: str
    pool: tuple[int, int] | None
    nodes: int = 0
    kernels: int = 0
    node_types: dict[str, int] = field(default_factory=dict)
    words: int = 0                         # 8-byte words read from parameters and pointers
    references: list[Reference] = field(default_factory=list)   # outside the graph's own pool
    own_pool: int = 0                      # references into the graph's own pool (safe)
    outside: int = 0                       # device-looking words outside any block (not findings)
    unreadable: list[str] = field(default_factory=list)         # "node 12 kernel foo: why"
    foreign_pools: dict[str, int] = field(default_factory=dict) # "graph 'x'" / "pool (1, 2)" -> refs
    marker: dict[str, Any] | None = None   # last trace entry at census time
    reported: set[tuple[int, str]] = field(default_factory=set)  # (block start, status) already said
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def blocks(self) -> list[Block]:
        """Distinct captured blocks (outside the own pool), by start address."""
        raise NotImplementedError

    def summary(self) -> dict[str, Any]:
        """Counts for the trial record (no addresses of every word)."""
        raise NotImplementedError


def census_supported() -> tuple[bool, str]:
    """(True, "") when a census can be taken here; else (False, what is missing)."""
    raise NotImplementedError


def take_census(graph: Any, label: str, pool: Any = None,
                snapshot: dict[str, Any] | None = None) -> GraphCensus:
    """Census of a graph captured with CUDAGraph(keep_graph=True); see the module docstring."""
    raise NotImplementedError


def check_census(census: GraphCensus, when: str, snapshot: dict[str, Any] | None = None,
                 rank: int = 0) -> list[Finding]:
    """Findings new since the last check of this census; see the module docstring."""
    raise NotImplementedError
