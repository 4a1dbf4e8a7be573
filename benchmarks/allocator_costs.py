"""What asking the CUDA caching allocator costs, by how much the process holds: the numbers the
graph census's design rests on (a snapshot per capture is O(blocks + trace)).

    PYTHONPATH=. python3 benchmarks/allocator_costs.py [--json OUT]

For N live blocks (N = 100 .. 10000) with the alloc/free trace recording (no stacks, 8192
entries, as the census records it): a full snapshot, a snapshot of one graph pool
(``memory_snapshot(pool_id)`` where the torch has it), ``memory_stats()``, and the trace
entry fields this torch gives. GPU only.
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
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.stderr.write("allocator_costs: needs CUDA\n")
        return 3
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
        "torch": torch.__version__,
        "rows": rows,
        "clock": clock,
        "trace_entry_keys": sorted(trace[-1].keys()) if trace else [],
        "segment_keys": sorted(seg.keys()),
        "block_keys": sorted(seg["blocks"][0].keys()),
        "trace_actions": sorted({e.get("action") for e in trace}),
    }
    del in_pool, graph
    emit(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
