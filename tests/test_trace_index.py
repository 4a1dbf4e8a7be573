"""The shared trace index answers what a pass over the trace per graph answered.

A check of many graphs reads the allocator trace once (repro/diagnose/trace_index.py); these tests hold
its answers against a plain oracle written here from the definitions (the first alloc or free
holding an address since a graph's capture; the frees, allocs and segment releases overlapping a
block since then), over random traces, and check the census's findings against that oracle.
"""

from __future__ import annotations

import random

from repro.diagnose import census as C
from repro.diagnose import trace_index as T
from repro.diagnose.captured import GraphCensus, Word

KiB = 1 << 10
BASE = 0x7F00_0000_0000


def random_trace(rng: random.Random, n: int) -> list[dict]:
    actions = ["alloc", "free_requested", "free_completed", "segment_free", "segment_map", "oom"]
    out = []
    for t in range(n):
        entry = {
            "action": rng.choice(actions),
            "size": rng.choice([512, 4 * KiB, 64 * KiB]),
            "stream": 0,
            "time_us": 10 * t,
        }
        if entry["action"] != "oom":
            entry["addr"] = BASE + rng.randrange(0, 256) * 512
        out.append(entry)
    return out


def first_holding(trace, addr, start):
    for e in trace[start:]:
        if (
            e.get("action") in T.POINT_ACTIONS
            and e.get("addr") is not None
            and e["addr"] <= addr < e["addr"] + e["size"]
        ):
            return e
    return None


def overlapping(trace, block, start):
    lo, hi = block
    return [
        i
        for i in range(start, len(trace))
        if trace[i].get("action") in T.BLOCK_ACTIONS
        and trace[i].get("addr") is not None
        and trace[i]["addr"] < hi
        and lo < trace[i]["addr"] + trace[i]["size"]
    ]


def test_points_and_blocks_match_a_pass_per_question_over_random_traces():
    rng = random.Random(7)
    for _ in range(40):
        trace = random_trace(rng, rng.randrange(0, 300))
        addrs = [BASE + rng.randrange(0, 300 * 512) for _ in range(30)]
        begin = rng.randrange(0, len(trace) + 1)
        points = T.entries_at_points(trace, addrs, begin)
        for a in addrs:
            for start in (begin, begin + 5):
                p = T.first_from(points.get(a, []), start)
                assert (trace[p] if p is not None else None) is first_holding(trace, a, start)
        blocks = [(a, a + rng.choice([256, 8 * KiB, 200 * KiB])) for a in addrs]
        over = T.entries_over_blocks(trace, blocks, begin)
        for b in blocks:
            assert over.get(b, []) == overlapping(trace, b, begin)


def test_one_check_of_many_graphs_finds_what_checking_each_alone_finds():
    """Censuses captured at different points of one trace, with pending words: the book's one
    pass gives each graph the references and findings a check of that graph alone gives."""
    rng = random.Random(3)
    seen = {"references": 0, "reported": 0}
    seg = {
        "device": 0,
        "address": BASE,
        "total_size": 256 * 512,
        "segment_pool_id": (0, 0),
        "blocks": [
            {"address": BASE + i * 4 * KiB, "size": 4 * KiB, "state": rng.choice(["active_allocated", "inactive"])}
            for i in range(32)
        ],
    }
    for _ in range(15):
        trace = random_trace(rng, 200)
        snap = {"segments": [seg], "device_traces": [trace]}

        def censuses():
            out = []
            for g in range(6):
                c = GraphCensus(label=f"g{g}", pool=(1, g))
                rng_g = random.Random(g)
                c.pending = [
                    Word(i, "kernel", "k", f"param {i} +0", 0, BASE + rng_g.randrange(0, 32 * 4 * KiB), (0, 0))
                    for i in range(12)
                ]
                c.marker = {"time_us": 10 * (g * 30)}
                out.append(c)
            return out

        together = censuses()
        book = C.CensusBook(rank=0, trace=C.Tracing.NONE)
        book.capacity = 10_000
        book.censuses = {c.label: c for c in together}
        book.findings_from(together, snap, 0, "x")
        for alone, joint in zip(censuses(), together):
            C.check_census(alone, "x", snap, device=0, capacity=10_000)
            assert [(r.addr, r.block.start, r.block.size) for r in alone.references] == [
                (r.addr, r.block.start, r.block.size) for r in joint.references
            ]
            assert (alone.free_at_capture, alone.outside) == (joint.free_at_capture, joint.outside)
            assert alone.reported == joint.reported
            seen["references"] += len(joint.references)
            seen["reported"] += len(joint.reported)
    assert seen["references"] > 0 and seen["reported"] > 0  # the cases compared say something
