"""Capture / replay helpers and the after-free knob.

What happens to freed memory between capture (or reload) and replay decides how a
stale-capture bug shows (BACKGROUND.md §1). `apply_after_free` makes that a reported,
deterministic choice:

  keep     nothing is done; the freed block stays cached and untouched -> replays read stale
           but plausible data: the bug is latent (only the guard sees it)
  release  gc + empty_cache: segments that became empty go back to the driver -> CUDA error 700
  reuse    new tensors take the freed blocks and fill them with plausible values of their dtype
           (random floats, out-of-range integers) -> wrong output, or device asserts on indices
  poison   new tensors take the freed blocks and fill them with 0xFF bytes (NaN in float
           formats) -> non-finite output

The harness's own allocations (oracle, inputs) go to a separate memory pool, so only the knob
decides what lands in the freed blocks.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

# How many same-size allocations to try before giving up on landing on a freed address.
LAND_TRIES = 64


class HarnessMemory:
    """Allocations of the harness itself (oracle, inputs) live in their own pool on CUDA."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = None
        if device.type == "cuda" and hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool"):
            self.pool = torch.cuda.MemPool()

    @property
    def isolated(self) -> bool:
        return self.pool is not None

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        if self.pool is None:
            yield
            return
        with torch.cuda.use_mem_pool(self.pool, device=self.device):
            yield


@dataclass
class Captured:
    """One captured region. On CPU there is no graph: `replay()` returns None and the
    scenario runs its eager path instead."""
    label: str
    graph: Any                        # torch.cuda.CUDAGraph | None
    inputs: tuple[torch.Tensor, ...]  # static inputs, written before each replay
    output: Any                       # static outputs (tensor or tuple), read after replay
    on_replay: Callable[[str], None] | None = None   # told before each real replay starts

    def replay(self) -> Any:
        if self.graph is None:
            return None
        if self.on_replay is not None:
            self.on_replay(self.label)   # on disk before a replay that may kill the process
        self.graph.replay()
        return self.output


def capture(fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...], label: str, guard: Any,
            pool: Any = None, warmup: int = 2, on_replay: Callable[[str], None] | None = None) -> Captured:
    """Warm up on a side stream, then capture fn(*inputs) under the guard's recording.

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
    graph = torch.cuda.CUDAGraph()
    with guard.capture(graph, label, pool=pool):
        out = fn(*inputs)
    return Captured(label=label, graph=graph, inputs=inputs, output=out, on_replay=on_replay)


@dataclass
class AfterFree:
    """What the knob did; kept in the trial record. `holders` keeps the fill tensors alive."""
    knob: str
    blocks: int = 0
    landed: int = 0
    bytes: int = 0
    released_bytes: int = 0
    note: str = ""
    holders: list[torch.Tensor] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        return {"knob": self.knob, "blocks": self.blocks, "landed": self.landed,
                "bytes": self.bytes, "released_bytes": self.released_bytes, "note": self.note}


def apply_after_free(knob: str, freed: list[tuple[int, int, str]], device: torch.device,
                     seed: int = 0) -> AfterFree:
    """Decide what the freed captured blocks hold before the next replay.

    freed: (address, nbytes, dtype) of captured storages the guard found dead.
    """
    result = AfterFree(knob=knob, blocks=len(freed), bytes=sum(n for _, n, _ in freed))
    if device.type != "cuda":
        result.note = "CPU run: host memory is not replayed; the knob has no effect"
        return result
    if knob == "keep":
        result.note = "freed blocks left cached and untouched"
    elif knob == "release":
        before = torch.cuda.memory_reserved(device)
        gc.collect()
        torch.cuda.empty_cache()
        result.released_bytes = before - torch.cuda.memory_reserved(device)
        result.note = "gc.collect(); torch.cuda.empty_cache(): empty segments returned to the driver"
    else:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        for addr, nbytes, dtype in freed:
            holder = land_on(addr, nbytes, device)
            if holder is None:
                continue
            fill(holder, knob, dtype, gen)
            result.holders.append(holder)
            result.landed += 1
        result.note = f"{result.landed}/{result.blocks} freed captured blocks re-allocated and filled ({knob})"
    return result


def land_on(addr: int, nbytes: int, device: torch.device) -> torch.Tensor | None:
    """Allocate byte tensors of the freed block's size until one lands on its address.

    The caching allocator's best fit usually returns the freed block at once; misses are
    released again so they do not pile up.
    """
    misses = []
    try:
        for _ in range(LAND_TRIES):
            t = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if t.data_ptr() == addr:
                return t
            if t.data_ptr() < addr < t.data_ptr() + nbytes:
                return None               # overlaps without matching: a bigger block was split
            misses.append(t)
        return None
    finally:
        del misses


def fill(holder: torch.Tensor, knob: str, dtype: str, gen: torch.Generator) -> None:
    if knob == "poison":
        holder.fill_(0xFF)                # NaN in bf16/fp16/fp32; -1 in signed integers
        return
    torch_dtype = getattr(torch, dtype.replace("torch.", ""), torch.uint8)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    if holder.numel() % itemsize:
        torch_dtype, itemsize = torch.uint8, 1
    view = holder.view(torch_dtype)
    if torch_dtype.is_floating_point:
        # Plausible weights: finite, small, wrong.
        view.copy_(torch.randn(view.shape, generator=gen, device=view.device, dtype=torch.float32) * 0.05)
    else:
        # Integers as another tensor's data would leave them: large, out of any index range.
        high = min(2 ** 30, torch.iinfo(torch_dtype).max)
        view.copy_(torch.randint(high // 2, high, view.shape, generator=gen, device=view.device))
