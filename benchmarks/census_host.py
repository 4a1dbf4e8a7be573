"""The graph census's host-side work at engine scale, on the CPU: reading parameter words and
matching them at the first check, with no GPU.

    PYTHONPATH=. python3 benchmarks/census_host.py [--graphs 67] [--nodes 1056] [--json OUT]
    PYTHONPATH=. python3 benchmarks/census_host.py --graphs 2211 --nodes 24     # piecewise

What the census does after the driver calls is plain Python over bytes and allocator dicts, so
it can be timed here: kernel nodes are ctypes parameter buffers laid out as torch's kernels
pass them (pointers, a 512-byte TensorInfo-like struct with stale words, small ints), segments
of a shared graph pool and of the default pool as a snapshot lists them, and an allocator trace
of 8,192 entries (the ring's size) since the captures. The driver itself is a stand-in
(answers from memory), so these times leave out the libcuda calls a GPU run adds per node.

Reported: read (census of every graph: reading every node and sorting its words by pool),
check (one check of every graph against one snapshot: pending words matched, block fates), per
graph and per kernel node, and the same check done graph by graph (one pass over the trace per
graph, as before the shared trace index) for contrast.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402

from repro.diagnose import census as C  # noqa: E402
from repro.diagnose.allocator import TRACE_ENTRIES, PoolMap  # noqa: E402
from repro.diagnose.captured import GraphCensus  # noqa: E402
from repro.diagnose.cuda_driver import KernelNodeParams  # noqa: E402
from repro.diagnose.graph_walk import read_graph  # noqa: E402
from repro.diagnose.words import Deferred  # noqa: E402

MiB = 1 << 20
POOL = (1, 7)  # the shared graph pool every graph captures into
BASE = 0x7F00_0000_0000
HOST = 0x5600_0000_0000  # a host heap's addresses: plausible words outside every segment
T0, TRACE_SPAN = 5000, TRACE_ENTRIES - 1  # trace stamps (us); the ring is not full: nothing lost


class StandInDriver:
    """The four driver answers read_graph needs, from host memory (no libcuda)."""

    def __init__(
        self,
        graphs: dict[int, list[int]],
        params: dict[int, KernelNodeParams],
        layouts: dict[int, list[tuple[int, int]]],
    ):
        self.graphs, self.params, self.layouts = graphs, params, layouts
        self.function_cache: dict = {}

    def nodes(self, graph):
        return self.graphs[graph]

    def node_type(self, node):
        return "kernel"

    def kernel_params(self, node):
        return self.params[node]

    def name(self, p):
        return f"kernel_{p.func}"

    def param_layout(self, p):
        return self.layouts[p.func]

    def is_device_address(self, value):
        return False


def segments(n_default: int, n_pool: int) -> list[dict]:
    out, addr = [], BASE
    for i in range(n_default + n_pool):
        pool = POOL if i >= n_default else (0, 0)
        blocks = [{"address": addr + k * MiB, "size": MiB, "state": "active_allocated"} for k in range(16)]
        out.append({"address": addr, "total_size": 16 * MiB, "device": 0, "segment_pool_id": pool, "blocks": blocks})
        addr += 32 * MiB
    return out


def build_graphs(args, segs: list[dict], rng: random.Random):
    default = [s for s in segs if tuple(s["segment_pool_id"]) == (0, 0)]
    pooled = [s for s in segs if tuple(s["segment_pool_id"]) == POOL]
    weights = [b["address"] for s in default for b in s["blocks"]]
    keep, graphs, params, layouts = [], {}, {}, {}
    layouts[1] = [(0, 8), (8, 8), (16, 8), (24, 512), (536, 4), (540, 4)]
    node_id = 0
    for g in range(args.graphs):
        nodes = []
        for _ in range(args.nodes):
            words = [
                rng.choice(weights) + 64 * rng.randrange(8),  # a weight
                rng.choice(pooled)["address"] + rng.randrange(16) * MiB,  # own-pool input
                rng.choice(pooled)["address"] + rng.randrange(16) * MiB,
            ]  # own-pool output
            struct = bytearray(512)
            for k in range(0, 512, 8):
                r = rng.random()
                value = (
                    rng.choice(pooled)["address"] + 4096
                    if r < 0.2
                    # a host pointer (outside the allocator: asked of the driver per page)
                    else HOST + 8 * rng.randrange(1 << 24)
                    if r < 0.2 + args.host_words
                    # stale struct bytes
                    else rng.randrange(1, 4096)
                    if r < 0.6
                    else 0
                )
                struct[k : k + 8] = value.to_bytes(8, "little")
            blob = b"".join(w.to_bytes(8, "little") for w in words) + bytes(struct) + bytes(8)
            buf = ctypes.create_string_buffer(blob, len(blob))
            slots = (ctypes.c_void_p * 6)(*[ctypes.addressof(buf) + off for off, _ in layouts[1]])
            p = KernelNodeParams()
            p.func, p.kernelParams = 1, ctypes.addressof(slots)
            keep += [buf, slots]
            params[node_id] = p
            nodes.append(node_id)
            node_id += 1
        graphs[g] = nodes
    return StandInDriver(graphs, params, layouts), keep


def trace_entries(segs: list[dict], n: int, rng: random.Random, t0: int) -> list[dict]:
    """Eager churn after the captures: allocs and frees of default-pool blocks."""
    blocks = [b for s in segs if tuple(s["segment_pool_id"]) == (0, 0) for b in s["blocks"]]
    out = []
    for i in range(n):
        b = rng.choice(blocks)
        out.append(
            {
                "action": "alloc" if i % 2 == 0 else "free_completed",
                "addr": b["address"] + 8 * MiB,
                "size": 4096,
                "stream": 0,
                "time_us": t0 + i,
            }
        )
    return out


def read_all(driver, pools: PoolMap, n_graphs: int) -> list[GraphCensus]:
    out = []
    for g in range(n_graphs):
        census = GraphCensus(label=f"g{g}", pool=POOL)
        read_graph(driver, census, Deferred(pools, POOL, driver.is_device_address), g)
        census.marker = {"time_us": T0 + g * (TRACE_SPAN // (2 * n_graphs))}  # captures inside the trace
        out.append(census)
    return out


def check_together(censuses: list[GraphCensus], snapshot: dict) -> float:
    book = C.CensusBook(rank=0, trace=C.Tracing.NONE)
    book.capacity = TRACE_ENTRIES
    book.censuses = {c.label: c for c in censuses}
    t0 = time.perf_counter()
    book.findings_from(censuses, snapshot, 0, "bench")
    return time.perf_counter() - t0


def check_one_by_one(censuses: list[GraphCensus], snapshot: dict) -> float:
    t0 = time.perf_counter()
    for census in censuses:
        C.check_census(census, "bench", snapshot, device=0, capacity=TRACE_ENTRIES)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graphs", type=int, default=67)
    p.add_argument("--nodes", type=int, default=1056, help="kernel nodes per graph")
    p.add_argument("--trace", type=int, default=TRACE_SPAN)
    p.add_argument(
        "--host-words",
        type=float,
        default=0.0,
        help="share of each struct's words that are host pointers (a real piece: ~0.2, some 300 words; 0 as before)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rng = random.Random(0)
    segs = segments(n_default=24, n_pool=40)
    driver, keep = build_graphs(args, segs, rng)
    snapshot = {"segments": segs, "device_traces": [trace_entries(segs, args.trace, rng, T0)]}
    pools = PoolMap()
    pools.signature = ("bench",)
    pools.refresh(snapshot)
    pools.check = lambda: None
    import torch  # noqa: F401  (an engine has torch loaded long before its captures: not timed)

    t0 = time.perf_counter()
    censuses = read_all(driver, pools, args.graphs)
    read_s = time.perf_counter() - t0
    pending = sum(len(c.pending) for c in censuses)
    together = check_together(censuses, snapshot)
    again = read_all(driver, pools, args.graphs)
    one_by_one = check_one_by_one(again, snapshot)
    nodes = args.graphs * args.nodes
    doc = {
        "graphs": args.graphs,
        "kernel_nodes": nodes,
        "trace_entries": args.trace,
        "words": sum(c.words for c in censuses),
        "pending_words": pending,
        "read_s": round(read_s, 3),
        "read_ms_per_graph": round(read_s / args.graphs * 1e3, 3),
        "read_us_per_node": round(read_s / nodes * 1e6, 2),
        "check_together_s": round(together, 3),
        "check_one_by_one_s": round(one_by_one, 3),
        "check_together_ms_per_graph": round(together / args.graphs * 1e3, 3),
        "note": "CPU only; the driver is a stand-in (no libcuda calls timed)",
    }
    del keep
    emit(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
