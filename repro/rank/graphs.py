"""Capture / replay helpers and the after-free knob.

What happens to freed memory between capture (or reload) and replay decides how a
stale-capture bug shows (docs/BACKGROUND.md §1). `apply_after_free` makes that a reported,
deterministic choice:

  keep     nothing is written; the freed blocks stay cached and untouched -> replays read stale
           but plausible data: the bug is latent (the guard and the census still report it)
  release  gc.collect() + torch.cuda.empty_cache(): segments that became empty go back to the
           driver -> CUDA error 700 on the replay that reads them
  reuse    byte tensors take the free regions holding freed captured blocks and are filled as a
           bf16 activation or KV-cache tensor would leave them: N(0, 0.05) bf16 values, whatever
           dtype the graph reads them as -> wrong but finite floats; integer index tensors read
           those bytes as huge values (out of range -> device-side assert); fp8 scales can
           read NaN bytes
  poison   byte tensors take the same regions and are filled with 0xFF bytes (NaN in bf16/fp16/
           fp32 and e4m3, -1 in signed integers) -> non-finite output

Which blocks are "freed captured blocks" comes from the graph census (repro/diagnose/census.py): the
addresses the captured kernels really hold, matched to the allocator. It never comes from the
stale-capture guard, so `--guard off` leaves every knob value doing the same thing. The
harness's own allocations (oracle, inputs) go to a separate memory pool, so only the knob
decides what lands in the freed blocks.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from repro.outcome import AfterFreeKnob

if TYPE_CHECKING:  # the guard and the census are the caller's; this module needs neither to run
    from repro.diagnose.census import CensusBook
    from repro.diagnose.guard import CaptureGuard

# How many same-size allocations to try before giving up on landing on a freed address.
LAND_TRIES = 64
# The caching allocator serves a request of up to 1 MiB from its small pool (2 MiB segments) and
# a larger one from its large pool. Free neighbours coalesce, so a free region of a small segment
# can exceed 1 MiB, and a request of its size then goes to the other pool and never reaches it.
SMALL_REQUEST = 1 << 20


class HarnessMemory:
    """Allocations of the harness itself (oracle, inputs) live in their own pool on CUDA."""

    def __init__(self, device: torch.device):
        if device.type == "cuda" and device.index is None:  # use_mem_pool wants an index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.pool = None
        self.depth = 0  # use() blocks open: inner ones are already in the pool
        if device.type == "cuda" and hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool"):
            self.pool = torch.cuda.MemPool()

    @property
    def isolated(self) -> bool:
        return self.pool is not None

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """Allocate in the harness's pool. Re-entrant: the guard's checks (which allocate here)
        run inside a scenario's own use() blocks too, and torch refuses to begin allocating to
        a pool it already allocates to ("already recording to mempool_id")."""
        if self.pool is None or self.depth:
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
            return
        with torch.cuda.use_mem_pool(self.pool, device=self.device):
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1


@dataclass
class Captured:
    """One captured region. On CPU there is no graph: `replay()` returns None and the
    scenario runs its eager path instead."""

    label: str
    graph: torch.cuda.CUDAGraph | None
    inputs: tuple[torch.Tensor, ...]  # static inputs, written before each replay
    output: Any  # static outputs (tensor or tuple), read after replay
    on_replay: Callable[[str], None] | None = None  # told before each real replay starts
    guard: CaptureGuard | None = None  # brackets the first replay
    replays: int = 0

    def replay(self) -> Any:
        if self.graph is None:
            return None
        if self.on_replay is not None:
            self.on_replay(self.label)  # on disk before a replay that may kill the process
        if self.replays == 0 and self.guard is not None:
            with self.guard.replaying(self.label):  # what the graph writes is not a lost input
                self.graph.replay()
        else:
            self.graph.replay()
        self.replays += 1
        return self.output


def capture(
    fn: Callable[..., Any],
    inputs: tuple[torch.Tensor, ...],
    label: str,
    guard: CaptureGuard,
    pool: tuple[int, int] | None = None,
    warmup: int = 2,
    on_replay: Callable[[str], None] | None = None,
    census: CensusBook | None = None,
) -> Captured:
    """Warm up on a side stream, then capture fn(*inputs) under the guard's recording.

    census: a repro.diagnose.census.CensusBook. The graph is then made with keep_graph=True, read right
    after capture_end and instantiated at once, so the first replay costs what it always did.
    On CPU the same function runs once under the guard (a dry run): the guard records the
    tensors a graph would have baked in, which is what its verdict needs.
    on_replay(label) runs before every real replay (the worker records that replays ran).
    """
    device = inputs[0].device
    if device.type != "cuda":
        with guard.recording(label):
            out = fn(*inputs)
        return Captured(label=label, graph=None, inputs=inputs, output=out, on_replay=on_replay)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(*inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=True) if census is not None else torch.cuda.CUDAGraph()
    with guard.capture(graph, label, pool=pool, fingerprint=False):
        out = fn(*inputs)
    if census is not None:
        census.add(graph, label, pool)
        graph.instantiate()
    guard.fingerprint(label)  # after the census read the graph: nothing allocated before
    return Captured(label=label, graph=graph, inputs=inputs, output=out, on_replay=on_replay, guard=guard)


@dataclass
class AfterFree:
    """What the knob did; kept in the trial record. `holders` keeps the fill tensors alive."""

    knob: str
    blocks: int = 0  # free regions holding freed captured blocks (from the census)
    landed: int = 0
    bytes: int = 0
    released_bytes: int = 0
    note: str = ""
    holders: list[torch.Tensor] = field(default_factory=list, repr=False)

    def as_record(self) -> dict[str, Any]:
        """The trial record's after_free detail: what the knob wrote and where (no tensors)."""
        return {
            "knob": self.knob,
            "blocks": self.blocks,
            "landed": self.landed,
            "bytes": self.bytes,
            "released_bytes": self.released_bytes,
            "note": self.note,
            "writes": KNOB_WRITES[self.knob],
        }


KNOB_WRITES = {
    AfterFreeKnob.KEEP: "nothing: freed captured blocks stay cached and untouched",
    AfterFreeKnob.RELEASE: "nothing: gc.collect() + torch.cuda.empty_cache() return empty segments to the driver",
    AfterFreeKnob.REUSE: "N(0, 0.05) bf16 values over each freed captured block (index tensors read them as huge "
    "integers)",
    AfterFreeKnob.POISON: "0xFF bytes over each freed captured block (NaN in float formats, -1 in integers)",
}


def apply_after_free(
    knob: str, regions: list[tuple[int, int]], device: torch.device, seed: int = 0, census_note: str = ""
) -> AfterFree:
    """Decide what the freed captured blocks hold before the next replay.

    regions: (address, nbytes) of the free allocator blocks that hold freed captured blocks,
    from CensusBook.dead_blocks(). census_note: why there are none to target, when the census
    could not run.
    """
    result = AfterFree(knob=knob, blocks=len(regions), bytes=sum(n for _, n in regions))
    if device.type != "cuda":
        result.note = "CPU run: host memory is not replayed; the knob has no effect"
        return result
    if knob == AfterFreeKnob.KEEP:
        result.note = "freed captured blocks left cached and untouched"
    elif knob == AfterFreeKnob.RELEASE:
        before = torch.cuda.memory_reserved(device)
        gc.collect()
        torch.cuda.empty_cache()
        result.released_bytes = before - torch.cuda.memory_reserved(device)
        result.note = "gc.collect(); torch.cuda.empty_cache(): empty segments returned to the driver"
    else:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        for addr, nbytes in regions:
            holders = land_over(addr, nbytes, device)
            if not holders:
                continue
            for holder in holders:
                fill(holder, knob, gen)
            result.holders.extend(holders)
            result.landed += 1
        result.note = (
            f"{result.landed}/{result.blocks} free regions holding captured blocks re-allocated and filled ({knob})"
        )
    if census_note:
        result.note += f"; {census_note}"
    return result


def land_over(addr: int, nbytes: int, device: torch.device) -> list[torch.Tensor]:
    """Byte tensors covering the free region [addr, addr + nbytes): one of its size, or, where a
    request of that size goes to the other pool (a small segment's region above 1 MiB), pieces
    of at most 1 MiB from its start. [] when it cannot be covered (then nothing is kept)."""
    whole = land_on(addr, nbytes, device)
    if whole is not None:
        return [whole]
    if nbytes <= SMALL_REQUEST:
        return []
    pieces = []
    for start in range(addr, addr + nbytes, SMALL_REQUEST):
        piece = land_on(start, min(SMALL_REQUEST, addr + nbytes - start), device)
        if piece is None:
            return []
        pieces.append(piece)
    return pieces


def land_on(addr: int, nbytes: int, device: torch.device) -> torch.Tensor | None:
    """Allocate byte tensors of the free block's size until one lands on its address.

    The caching allocator's best fit usually returns the free block at once; misses are
    released again so they do not pile up.
    """
    misses = []
    try:
        for _ in range(LAND_TRIES):
            t = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if t.data_ptr() == addr:
                return t
            if t.data_ptr() < addr < t.data_ptr() + nbytes:
                return None  # overlaps without matching: a bigger block was split
            misses.append(t)
        return None
    finally:
        del misses


def fill(holder: torch.Tensor, knob: str, gen: torch.Generator) -> None:
    """What another tensor would leave behind; dtype-blind, since the census sees bytes."""
    if knob == AfterFreeKnob.POISON:
        holder.fill_(0xFF)
        return
    # Plausible activations: finite, small, wrong; an odd byte count keeps its last byte.
    # In place: a temporary could itself land on another freed captured block.
    holder[: holder.numel() // 2 * 2].view(torch.bfloat16).normal_(0.0, 0.05, generator=gen)
