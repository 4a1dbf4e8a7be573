"""What asking the CUDA caching allocator costs, by how much the process holds: the numbers the
graph census's design rests on (a snapshot per capture is O(blocks + trace)).

    PYTHONPATH=. python3 benchmarks/allocator_costs.py [--json OUT] [--part all|snapshots|stacks]

snapshots: for N live blocks (N = 100 .. 10000) with the alloc/free trace recording (no stacks,
8192 entries, as the census records it): a full snapshot, a snapshot of one graph pool
(``memory_snapshot(pool_id)`` where the torch has it), ``memory_stats()``, and the trace
entry fields this torch gives.

stacks: what `repro watch --stacks` costs: one allocation and its free with the history off,
recording without stacks (context None, the census's trace) and with each allocation's Python
stack (context "alloc", --stacks; "state" for comparison), at a shallow and a deep Python
stack (a stack walk costs per frame); and the read of the segments the hooks take once per
capture that makes new slots (blocks with their frames).

GPU only (the caching allocator's history exists only on CUDA): on CPU it says so and exits 3.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402

BLOCKS = (100, 1000, 10000)
CONTEXTS = ("off", None, "state", "alloc")  # "off": no history at all
DEPTHS = (1, 40)  # Python frames above the allocating line
ALLOCS = 10000  # allocations (and frees) per timed loop


def timed(fn, repeats: int = 7) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--part", choices=("all", "snapshots", "stacks"), default="all")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.stderr.write(
            f"allocator_costs: needs a CUDA GPU (torch {torch.__version__} sees none): the allocator "
            "history and its stacks exist only on CUDA; run it on a GPU machine\n"
        )
        return 3
    doc = {"torch": torch.__version__}
    if args.part in ("all", "snapshots"):
        doc.update(snapshot_costs(torch))
    if args.part in ("all", "stacks"):
        doc["stacks"] = stack_costs(torch)
    emit(doc, args.json)
    return 0


def snapshot_costs(torch) -> dict:
    """Snapshot, pool snapshot and stats costs by live blocks; the trace's clock and fields."""
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=8192)
    dev = torch.cuda.current_device()
    pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        in_pool = [torch.empty(4096, device="cuda") for _ in range(64)]
    rows, held = [], []
    for n in BLOCKS:
        while len(held) < n:
            held.append(torch.empty(1024 + 512 * (len(held) % 7), device="cuda"))
        for i in range(9000):  # fill the trace ring
            torch.empty(256, device="cuda")
        snap = torch.cuda.memory._snapshot(dev)
        row = {
            "blocks_held": n,
            "segments": len(snap["segments"]),
            "blocks": sum(len(s["blocks"]) for s in snap["segments"]),
            "trace": len(snap["device_traces"][dev]),
            "snapshot_ms": 1e3 * timed(lambda: torch.cuda.memory._snapshot(dev)),
            "memory_stats_us": 1e6 * timed(lambda: torch.cuda.memory_stats(dev), 50),
            "raw_stats_us": 1e6 * timed(lambda: torch._C._cuda_memoryStats(dev), 50),
        }
        try:
            row["pool_snapshot_ms"] = 1e3 * timed(lambda: torch.cuda.memory.memory_snapshot(pool))
            row["pool_snapshot_segments"] = len(torch.cuda.memory.memory_snapshot(pool))
        except Exception as e:
            row["pool_snapshot"] = f"{type(e).__name__}: {e}"
        rows.append(row)
        sys.stderr.write(f"{row}\n")
    # Do trace stamps (time_us) agree with the host clock? The census places captures by it.
    before = time.time_ns() // 1000
    probe = torch.empty(123457, device="cuda")
    after = time.time_ns() // 1000
    del probe
    stamps = [
        e["time_us"]
        for e in torch.cuda.memory._snapshot(dev)["device_traces"][dev]
        if e.get("action") == "alloc" and e.get("size", 0) >= 123457 * 4
    ]
    clock = {"host_before_us": before, "host_after_us": after, "trace_us": stamps[-1] if stamps else None}
    if stamps:
        clock["offset_us"] = stamps[-1] - before
        clock["within"] = before - 1000 <= stamps[-1] <= after + 1000
    trace = torch.cuda.memory._snapshot(dev)["device_traces"][dev]
    seg = torch.cuda.memory._snapshot(dev)["segments"][0]
    doc = {
        "rows": rows,
        "clock": clock,
        "trace_entry_keys": sorted(trace[-1].keys()) if trace else [],
        "segment_keys": sorted(seg.keys()),
        "block_keys": sorted(seg["blocks"][0].keys()),
        "trace_actions": sorted({e.get("action") for e in trace}),
    }
    del in_pool, graph
    torch.cuda.memory._record_memory_history(enabled=None)
    return doc


def stack_costs(torch) -> dict:
    """Per allocation (+ its free), by history context and stack depth; the segment read."""
    rows = []
    for context in CONTEXTS:
        record_history(torch, context)
        for depth in DEPTHS:
            seconds = timed(lambda: at_depth(depth, lambda: allocate_and_free(torch)), 3)
            rows.append({"context": str(context), "depth": depth, "alloc_free_us": 1e6 * seconds / ALLOCS})
            sys.stderr.write(f"{rows[-1]}\n")
    reads = {context: segment_read_ms(torch, context) for context in ("off", "alloc")}
    torch.cuda.memory._record_memory_history(enabled=None)
    base = {r["depth"]: r["alloc_free_us"] for r in rows if r["context"] == "off"}
    for r in rows:
        r["added_us"] = r["alloc_free_us"] - base[r["depth"]]
    return {"allocs": ALLOCS, "rows": rows, "segment_read_ms": reads}


def record_history(torch, context) -> None:
    """The history as `repro watch` records it: context None is the census's trace, "alloc"
    the one --stacks starts (allocator.start_trace); "off" records nothing."""
    if context == "off":
        torch.cuda.memory._record_memory_history(enabled=None)
        return
    torch.cuda.memory._record_memory_history(enabled="all", context=context, stacks="python", max_entries=8192)


def allocate_and_free(torch) -> None:
    for _ in range(ALLOCS):
        torch.empty(256, device="cuda")  # freed at once: one alloc and one free each


def at_depth(depth: int, fn):
    """fn() called under `depth` more Python frames (the stack walk is per frame)."""
    return fn() if depth <= 1 else at_depth(depth - 1, fn)


def segment_read_ms(torch, context, blocks: int = 5000) -> float:
    """One read of the segments (no trace) with `blocks` live blocks, each with its frames when
    the history records stacks: what the hooks read once per capture that makes new slots."""
    record_history(torch, context)
    held = [torch.empty(1024 + 512 * (i % 7), device="cuda") for i in range(blocks)]
    ms = 1e3 * timed(lambda: torch._C._cuda_memorySnapshot((0, 0, False)))
    del held
    return ms


if __name__ == "__main__":
    sys.exit(main())
