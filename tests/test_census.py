"""Graph census without a GPU: block matching, trace logic, parameter reading, finding merge.

Snapshots are plain dicts in torch's documented `torch.cuda.memory._snapshot()` format
(segments with blocks, device_traces with alloc/free entries); kernel parameters are real
ctypes buffers laid out the way the driver hands them back.
"""

from __future__ import annotations

import ctypes
import dataclasses
import types

import pytest

from repro.diagnose import census as C
from repro.diagnose.allocator import Block, BlockIndex, PoolMap, blocks_of, segment_signature
from repro.diagnose.captured import GraphCensus, Reference
from repro.diagnose.cuda_driver import (
    CU_LAUNCH_PARAM_BUFFER_POINTER,
    CU_LAUNCH_PARAM_BUFFER_SIZE,
    CU_LAUNCH_PARAM_END,
    Driver,
    DriverError,
    KernelNodeParams,
    Memcpy3D,
    MemsetParams,
    function_info,
    param_chunks,
    param_layout,
)
from repro.diagnose.fates import fate_of, traced_fate
from repro.diagnose.graph_walk import read_graph, read_kernel
from repro.diagnose.merge import merge_findings
from repro.diagnose.trace_index import Trace, marker_of, trace_of
from repro.diagnose.words import (
    MAX_ADDR,
    MIN_ADDR,
    ask_outside,
    SERIAL_ELEMENTS,
    SERIAL_GATHERS,
    SERIAL_SEARCHES,
    SMALL_GRAPH_WORDS,
    Chunks,
    Deferred,
    Matcher,
    plausible_address,
    plausible_words,
    positions,
    segment_positions,
    take,
)
from repro.outcome import Finding, Status, finding_from_dict

MiB = 1 << 20


@dataclasses.dataclass
class GuardSlot:
    """What merge_findings reads of a guard slot (repro.diagnose.guard.Slot has these attributes)."""

    name: str
    storage_ptr: int
    storage_nbytes: int
    reported: set = dataclasses.field(default_factory=set)


SEG = 0x7F00_0000_0000  # a default-pool segment
POOL_SEG = 0x7F10_0000_0000  # a graph-private-pool segment
GRAPH_POOL = (1, 7)


def segment(address, blocks, pool=(0, 0), with_addresses=True, device=0):
    out, addr = [], address
    for size, state in blocks:
        b = {"size": size, "requested_size": size, "state": state, "frames": []}
        if with_addresses:
            b["address"] = addr
        out.append(b)
        addr += size
    return {
        "device": device,
        "address": address,
        "total_size": addr - address,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": pool,
        "allocated_size": 0,
        "active_size": 0,
        "blocks": out,
    }


def snapshot(segments, trace=()):
    return {"segments": list(segments), "device_traces": [list(trace)]}


def ev(action, addr, size, t):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": []}


# A 4 MiB default segment: [weight 2 MiB active][local 1 MiB active][free 1 MiB]
AT_CAPTURE = snapshot(
    [
        segment(SEG, [(2 * MiB, "active_allocated"), (MiB, "active_allocated"), (MiB, "inactive")]),
        segment(POOL_SEG, [(MiB, "active_allocated"), (MiB, "inactive")], pool=GRAPH_POOL),
    ],
    trace=[ev("alloc", SEG, 2 * MiB, 1), ev("alloc", SEG + 2 * MiB, MiB, 2)],
)
LOCAL = SEG + 2 * MiB


# ------------------------------------------------------------------ snapshot -> blocks


def test_blocks_take_addresses_from_the_snapshot_or_from_running_sizes():
    with_addr = blocks_of(AT_CAPTURE)
    without = blocks_of(
        snapshot(
            [
                segment(
                    SEG,
                    [(2 * MiB, "active_allocated"), (MiB, "active_allocated"), (MiB, "inactive")],
                    with_addresses=False,
                ),
                segment(
                    POOL_SEG, [(MiB, "active_allocated"), (MiB, "inactive")], pool=GRAPH_POOL, with_addresses=False
                ),
            ]
        )
    )
    assert with_addr == without
    assert [(b.start - SEG, b.size) for b in with_addr[:3]] == [(0, 2 * MiB), (2 * MiB, MiB), (3 * MiB, MiB)]
    assert with_addr[3].pool == GRAPH_POOL and with_addr[0].pool == (0, 0)


def test_block_index_finds_the_block_containing_an_address_and_nothing_outside():
    index = BlockIndex.of(AT_CAPTURE)
    assert index.find(SEG).start == SEG
    assert index.find(SEG + 2 * MiB - 1).start == SEG  # last byte of the weight
    assert index.find(LOCAL).start == LOCAL  # first byte of the next block
    assert index.find(SEG + 4 * MiB) is None  # one past the segment
    assert index.find(SEG - 1) is None
    assert index.find(POOL_SEG + 5).pool == GRAPH_POOL


def test_blocks_of_one_device_only():
    snap = snapshot(
        [
            segment(SEG, [(MiB, "active_allocated")], device=0),
            segment(SEG + 8 * MiB, [(MiB, "active_allocated")], device=1),
        ]
    )
    assert [b.start for b in blocks_of(snap, 1)] == [SEG + 8 * MiB]
    assert len(blocks_of(snap)) == 2


# ------------------------------------------------------------------ words -> references


def test_plausible_words_follow_the_parameter_buffer_alignment():
    # Three words that all look like device addresses, as raw little-endian bytes.
    values = [0x7F00_0000_0000 + i for i in range(3)]
    buf = b"".join(v.to_bytes(8, "little") for v in values)
    # A parameter at buffer offset 0: every word aligned, every one plausible.
    assert plausible_words(buf, 0) == (3, [(0, values[0]), (8, values[1]), (16, values[2])])
    # At buffer offset 4 the first aligned word starts 4 bytes in (offset 8): two words, and
    # straddling bytes are no address.
    n, words = plausible_words(buf, 4)
    assert n == 2 and [off for off, _ in words] == [8, 16]
    assert [v for _, v in words] == [int.from_bytes(buf[4:12], "little"), int.from_bytes(buf[12:20], "little")]
    assert plausible_words(b"\x01\x02\x03", 0) == (0, [])


def matcher(snap=AT_CAPTURE, own=GRAPH_POOL, names=None, outside=None):
    return Matcher(BlockIndex.of(snap), own, names or {}, outside)


def test_matcher_sorts_words_into_references_own_pool_and_outside():
    census = GraphCensus(label="g", pool=GRAPH_POOL)
    m = matcher(outside=lambda v: v == 0x7E00_0000_0000)
    m.add(census, 0, "kernel", "k", "param 0 +0", 0, LOCAL + 64)  # inside the local
    m.add(census, 0, "kernel", "k", "param 1 +0", 8, POOL_SEG + 16)  # own pool: safe
    m.add(census, 0, "kernel", "k", "param 2 +0", 16, 0x7E00_0000_0000)  # e.g. an NCCL buffer
    m.add(census, 0, "kernel", "k", "param 3 +0", 24, 4096)  # an integer, no pointer
    m.add(census, 1, "memcpy", "", "dst", 0, SEG + 4 * MiB + 8)  # past the segment
    m.add(census, 1, "kernel", "k", "param 4 +88", 88, SEG + 3 * MiB + 64)  # a block free at capture
    assert [(r.block.start, r.offset) for r in census.references] == [(LOCAL, 0)]
    assert (census.own_pool, census.outside, census.free_at_capture) == (1, 1, 1)
    assert census.blocks() == [census.references[0].block]


def test_matcher_names_another_graphs_pool():
    census = GraphCensus(label="B", pool=(1, 9))
    matcher(own=(1, 9), names={GRAPH_POOL: "graph 'A'"}).add(census, 3, "kernel", "gemm", "extra +40", 40, POOL_SEG)
    assert census.foreign_pools == {"graph 'A'": 1}
    assert census.references[0].block.pool == GRAPH_POOL


# ------------------------------------------------------------------ trace logic


def test_trace_since_finds_the_marker_or_says_the_ring_wrapped():
    trace = [ev("alloc", 1 << 33, 512, t) for t in range(5)]
    marker = marker_of(trace[:3])
    assert Trace(trace).since(marker) == trace[3:]
    assert Trace(trace[3:]).since(marker) is None  # the marker fell off the ring
    empty = marker_of([])
    assert Trace(trace, 100).since(empty) == trace  # nothing dropped yet
    assert Trace(trace, 5).since(empty) is None  # full ring: entries may be lost
    assert Trace(trace).since(None) is None  # no trace recorded at census


def test_traced_fate_needs_a_free_before_an_alloc_counts_as_reuse():
    block = Block(LOCAL, MiB, "active_allocated", (0, 0), SEG)
    assert traced_fate(block, [ev("alloc", LOCAL, MiB, 3)]) is None  # ours, not reuse
    assert traced_fate(block, [ev("free_requested", LOCAL, MiB, 3)]) == Status.FREED
    assert (
        traced_fate(block, [ev("free_completed", LOCAL, MiB, 3), ev("alloc", LOCAL + 512, 512, 4)]) == Status.REUSED
    )  # part of it taken
    assert (
        traced_fate(block, [ev("free_completed", LOCAL, MiB, 3), ev("segment_free", SEG, 4 * MiB, 4)])
        == Status.RELEASED
    )
    assert (
        traced_fate(block, [ev("free_completed", SEG, 2 * MiB, 3), ev("alloc", SEG, 2 * MiB, 4)]) is None
    )  # the neighbour's life


def test_fate_reads_state_first_and_the_trace_for_reuse_at_the_same_address():
    block = BlockIndex.of(AT_CAPTURE).find(LOCAL)
    # Same layout, block active again: only the trace can tell it was freed and taken.
    same = snapshot(AT_CAPTURE["segments"])
    now = BlockIndex.of(same)
    reuse = [ev("free_completed", LOCAL, MiB, 3), ev("alloc", LOCAL, MiB, 4)]
    assert fate_of(block, now, []) is None
    fate = fate_of(block, now, reuse)
    assert (fate.status, fate.how) == (Status.REUSED, "allocator trace")
    assert fate_of(block, now, None) is None  # trace lost, layout unchanged
    freed = BlockIndex.of(snapshot([segment(SEG, [(2 * MiB, "active_allocated"), (2 * MiB, "inactive")])]))
    assert fate_of(block, freed, []).status == Status.FREED  # merged with its free neighbour
    released = BlockIndex.of(snapshot([segment(SEG + 64 * MiB, [(MiB, "active_allocated")])]))
    fate = fate_of(block, released, [])
    assert (fate.status, fate.current) == (Status.RELEASED, None)
    moved = BlockIndex.of(
        snapshot([segment(SEG, [(2 * MiB + 512, "active_allocated"), (2 * MiB - 512, "active_allocated")])])
    )
    assert fate_of(block, moved, None).status == Status.REUSED  # layout changed: proof without trace


# ------------------------------------------------------------------ check_census


def census_of_local(label="g"):
    census = GraphCensus(label=label, pool=GRAPH_POOL)
    m = matcher()
    m.add(census, 2, "kernel", "gather_kernel", "param 4 +0", 32, LOCAL)
    m.add(census, 5, "kernel", "gather_kernel", "param 4 +0", 32, LOCAL + 4096)
    m.add(census, 6, "kernel", "mul_kernel", "param 0 +0", 0, SEG)  # the live weight
    census.marker = marker_of(trace_of(AT_CAPTURE))
    return census


def test_check_census_reports_the_freed_local_once_with_its_kernel_and_offset():
    census = census_of_local()
    later = snapshot(
        [segment(SEG, [(2 * MiB, "active_allocated"), (2 * MiB, "inactive")])],
        trace=AT_CAPTURE["device_traces"][0] + [ev("free_completed", LOCAL, MiB, 9)],
    )
    findings = C.check_census(census, "after set-up", later, rank=1, device=0)
    assert len(findings) == 1
    f = findings[0]
    assert (f.status, f.mechanism, f.when, f.rank, f.graph) == ("freed", "census", "after set-up", 1, "g")
    assert f.census["block_start"] == LOCAL and f.census["block_size"] == MiB
    assert (f.census["kernel"], f.census["node"], f.census["offset"], f.census["references"]) == (
        "gather_kernel",
        2,
        32,
        2,
    )
    assert "gather_kernel" in f.message and "param 4" in f.message
    assert C.check_census(census, "before replay", later, device=0) == []  # said once


def test_check_census_sees_reuse_at_the_same_address_only_through_the_trace():
    census = census_of_local()
    trace = AT_CAPTURE["device_traces"][0] + [ev("free_completed", LOCAL, MiB, 9), ev("alloc", LOCAL, MiB, 10)]
    findings = C.check_census(census, "after reload 0", snapshot(AT_CAPTURE["segments"], trace), device=0)
    assert [(f.status, f.census["how"]) for f in findings] == [("reused", "allocator trace")]


def test_check_census_says_when_the_trace_no_longer_reaches_the_capture():
    census = census_of_local()
    wrapped = [ev("alloc", 1 << 40, 512, 100 + i) for i in range(3)]
    assert C.check_census(census, "x", snapshot(AT_CAPTURE["segments"], wrapped), device=0, capacity=3) == []
    assert any("no longer reaches" in n for n in census.notes)


def test_own_pool_blocks_are_never_findings():
    census = GraphCensus(label="g", pool=GRAPH_POOL)
    matcher().add(census, 0, "kernel", "k", "param 0 +0", 0, POOL_SEG + 8)
    gone = snapshot([segment(SEG, [(4 * MiB, "inactive")])])  # the pool segment is gone
    assert C.check_census(census, "x", gone, device=0) == [] and census.own_pool == 1


# ------------------------------------------------------------------ CensusBook and merge


def book_with(*labels):
    book = C.CensusBook(rank=0, trace=C.Tracing.NONE)
    for label in labels:
        book.censuses[label] = census_of_local(label)
    return book


FREED_NOW = snapshot([segment(SEG, [(2 * MiB, "active_allocated"), (2 * MiB, "inactive")])])


def test_book_reports_a_block_held_by_several_graphs_once_naming_all(monkeypatch):
    book = book_with("bs=1", "bs=2")
    monkeypatch.setattr(C, "take_snapshot", lambda: (FREED_NOW, 0))
    findings, regions = book.dead_blocks("after set-up")
    assert len(findings) == 1 and findings[0].graph == "bs=1, bs=2"
    assert findings[0].census["graphs"] == ["bs=1", "bs=2"]
    assert regions == [(LOCAL, 2 * MiB)]  # the free region that now holds the block
    assert book.check("before replay, step 0", "bs=2") == []
    assert book.checked == {"bs=1", "bs=2"}


def test_book_gives_no_region_for_released_or_reused_blocks(monkeypatch):
    book = book_with("g")
    monkeypatch.setattr(C, "take_snapshot", lambda: (snapshot([segment(SEG, [(2 * MiB, "active_allocated")])]), 0))
    findings, regions = book.dead_blocks("after set-up")
    assert [f.status for f in findings] == ["released"] and regions == []


def guard_finding(ptr=LOCAL, nbytes=MiB, status="freed"):
    return Finding(
        slot="drafter.<local lm_head_weight>",
        graph="g",
        status=status,
        when="after set-up",
        rank=0,
        shape=[4, 4],
        dtype="bfloat16",
        nbytes=nbytes,
        old_ptr=ptr,
    )


def census_finding(monkeypatch, book):
    monkeypatch.setattr(C, "take_snapshot", lambda: (FREED_NOW, 0))
    return book.check("after set-up")


def test_merge_joins_guard_and_census_on_the_same_storage(monkeypatch):
    book = book_with("g")
    merged = merge_findings([guard_finding()], census_finding(monkeypatch, book), [], True, book)
    assert len(merged) == 1
    f = merged[0]
    assert (f.mechanism, f.slot, f.disagreement) == ("both", "drafter.<local lm_head_weight>", "")
    assert f.census["kernel"] == "gather_kernel"


def test_merge_shows_a_blind_guard_and_names_storages_the_guard_knows(monkeypatch):
    book = book_with("g")
    blind = merge_findings([], census_finding(monkeypatch, book), [], True, book)
    assert blind[0].mechanism == "census" and "did not see" in blind[0].disagreement
    book = book_with("g")
    slot = GuardSlot("moe.moe_kernel.workspace13", LOCAL, MiB)
    named = merge_findings([], census_finding(monkeypatch, book), [slot], True, book)
    assert named[0].slot == "moe.moe_kernel.workspace13" and "sees it alive" in named[0].disagreement
    book = book_with("g")
    slot.reported = {"freed"}
    earlier = merge_findings([], census_finding(monkeypatch, book), [slot], True, book)
    assert (earlier[0].mechanism, earlier[0].disagreement) == ("both", "")
    book = book_with("g")
    off = merge_findings([], census_finding(monkeypatch, book), [], False, book)
    assert off[0].mechanism == "census" and off[0].disagreement == ""


def test_merge_shows_what_the_census_says_of_a_guard_only_finding():
    book = book_with("g")
    elsewhere = merge_findings([guard_finding(ptr=0x7E00_0000_0000)], [], [], True, book)
    assert elsewhere[0].mechanism == "guard" and "no captured address" in elsewhere[0].disagreement
    rebound = merge_findings([guard_finding(status="rebound")], [], [], True, book)
    assert "visible only to the guard" in rebound[0].disagreement
    assert merge_findings([guard_finding()], [], [], True, None)[0].disagreement == ""


def test_merge_says_changed_bytes_at_a_live_block_are_the_fingerprints_alone():
    book = book_with("g")
    changed = merge_findings([guard_finding(status="contents-changed")], [], [], True, book)
    assert changed[0].mechanism == "guard" and "only to the guard's fingerprint" in changed[0].disagreement


# ------------------------------------------------------------------ reading parameter buffers


class FakeDriver:
    """kernel_params/name/param_layout as the driver answers them, over real ctypes memory."""

    def __init__(self, params, layout, name="k"):
        self.params, self.layout, self.kname = params, layout, name

    def kernel_params(self, node):
        return self.params

    def name(self, p):
        return self.kname

    def param_layout(self, p):
        if isinstance(self.layout, Exception):
            raise self.layout
        return self.layout


def kernel_node(values: list[bytes]):
    """kernelParams: an array of pointers to each parameter's bytes."""
    bufs = [ctypes.create_string_buffer(v, len(v)) for v in values]
    arr = (ctypes.c_void_p * len(bufs))(*[ctypes.addressof(b) for b in bufs])
    p = KernelNodeParams()
    p.kernelParams = ctypes.addressof(arr)
    return p, (bufs, arr)


def test_read_kernel_finds_a_pointer_inside_a_struct_parameter():
    # param 0: int32 n (offset 0); param 1: struct {int64 len; float* data; int64 stride} (offset 8)
    struct = (7).to_bytes(8, "little") + (LOCAL + 256).to_bytes(8, "little") + (1).to_bytes(8, "little")
    p, keep = kernel_node([(5).to_bytes(4, "little"), struct])
    census = GraphCensus(label="g", pool=GRAPH_POOL)
    read_kernel(FakeDriver(p, [(0, 4), (8, 24)], "struct_kernel"), census, matcher(), 3, 0)
    assert census.kernels == 1 and census.words == 3
    [ref] = census.references
    assert (ref.node, ref.where, ref.offset, ref.kernel) == (3, "param 1 +8", 16, "struct_kernel")
    del keep


class GraphDriver(FakeDriver):
    """A two-node graph: node 0 a kernel, node 1 an event node (read by type only)."""

    def __init__(self, *args, one_call: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.typed: list[int] = []
        if one_call:
            self.kernel_node = lambda node: self.params if node == 0 else None

    def nodes(self, graph):
        return [0, 1]

    def node_type(self, node):
        self.typed.append(node)
        return "kernel" if node == 0 else "event"


def test_read_graph_reads_a_kernel_node_with_one_call_and_the_same_census():
    """With kernel_node (one driver call), a kernel node is never asked its type; the census is
    the one node_type + kernel_params give."""
    struct = (7).to_bytes(8, "little") + (LOCAL + 256).to_bytes(8, "little") + (1).to_bytes(8, "little")
    p, keep = kernel_node([(5).to_bytes(4, "little"), struct])
    got = {}
    for one_call in (False, True):
        driver = GraphDriver(p, [(0, 4), (8, 24)], "struct_kernel", one_call=one_call)
        census = GraphCensus(label="g", pool=GRAPH_POOL)
        read_graph(driver, census, matcher(), 0)
        got[one_call] = (
            census.nodes,
            census.kernels,
            dict(census.node_types),
            census.words,
            [(r.addr, r.where) for r in census.references],
            driver.typed,
        )
    assert got[False][:5] == got[True][:5]
    assert got[True][2] == {"kernel": 1, "event": 1} and got[True][4] == [(LOCAL + 256, "param 1 +8")]
    assert got[False][5] == [0, 1] and got[True][5] == [1]


def test_read_kernel_reads_the_extra_buffer_as_cublaslt_passes_it():
    buf = bytearray(64)
    buf[40:48] = (LOCAL + 8).to_bytes(8, "little")
    data = ctypes.create_string_buffer(bytes(buf), len(buf))
    size = ctypes.c_size_t(len(buf))
    extra = (ctypes.c_void_p * 5)(
        CU_LAUNCH_PARAM_BUFFER_POINTER,
        ctypes.addressof(data),
        CU_LAUNCH_PARAM_BUFFER_SIZE,
        ctypes.addressof(size),
        CU_LAUNCH_PARAM_END,
    )
    p = KernelNodeParams()
    p.extra = ctypes.addressof(extra)
    census = GraphCensus(label="g", pool=None)
    read_kernel(FakeDriver(p, []), census, matcher(own=None), 0, 0)
    assert [(r.where, r.offset) for r in census.references] == [("extra +40", 40)]
    assert census.words == 8


def test_unreadable_layouts_are_reported_never_guessed():
    p, keep = kernel_node([(LOCAL).to_bytes(8, "little")])
    census = GraphCensus(label="g", pool=None)
    read_kernel(
        FakeDriver(p, DriverError("cuFuncGetParamInfo: CUDA_ERROR_NOT_SUPPORTED"), "opaque"),
        census,
        matcher(own=None),
        4,
        0,
    )
    assert census.references == [] and census.words == 0
    assert census.unreadable == ["node 4 kernel opaque: cuFuncGetParamInfo: CUDA_ERROR_NOT_SUPPORTED"]
    bad_extra = (ctypes.c_void_p * 2)(7, CU_LAUNCH_PARAM_END)
    q = KernelNodeParams()
    q.extra = ctypes.addressof(bad_extra)
    read_kernel(FakeDriver(q, []), census, matcher(own=None), 5, 0)
    assert "no CU_LAUNCH_PARAM_BUFFER_POINTER" in census.unreadable[1]
    del keep


def test_kernel_node_params_struct_has_the_driver_layout():
    # CUDA_KERNEL_NODE_PARAMS_v2: func, 7 x uint, pad, kernelParams @40, extra @48, kern, ctx
    assert ctypes.sizeof(KernelNodeParams) == 72
    assert KernelNodeParams.kernelParams.offset == 40 and KernelNodeParams.extra.offset == 48
    assert ctypes.sizeof(Memcpy3D) == 200 and Memcpy3D.dstDevice.offset == 136
    assert ctypes.sizeof(MemsetParams) == 40


# ------------------------------------------------------------------ finding model


def test_old_finding_json_still_loads_as_a_guard_finding():
    old = {
        k: v for k, v in dataclasses.asdict(guard_finding()).items() if k not in ("mechanism", "census", "disagreement")
    }
    f = finding_from_dict(old)
    assert (f.mechanism, f.census, f.disagreement) == ("guard", None, "")


def test_census_is_unsupported_without_cuda_and_says_why():
    ok, reason = C.census_supported()
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        assert not ok and "CUDA is not available" in reason


# ------------------------------------------------------------------ a snapshot pair recorded on an H200


def test_recorded_h200_snapshots_give_the_verdicts_seen_on_the_gpu():
    """Two real allocator snapshots (torch 2.11): `local` freed and its block taken by a new
    tensor at the same address (only the trace shows it), `local2` freed; `keep` and `x` live."""
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parent / "data" / "census_snapshot_h200.json").read_text())
    census = GraphCensus(label="probe", pool=tuple(data["own_pool"]))
    m = Matcher(BlockIndex.of(data["at_capture"], 0), census.pool, {})
    for r in data["references"]:
        m.add(census, r["node"], "kernel", r["kernel"], r["where"], r["offset"], r["addr"])
    census.marker = marker_of(trace_of(data["at_capture"], 0))
    ptr = data["pointers"]
    assert {r.addr for r in census.references} == {ptr["keep"], ptr["local"], ptr["local2"], ptr["x"]}
    findings = C.check_census(census, "probe", data["later"], device=0)
    got = [[f.status, f.census["block_start"], f.census["how"]] for f in findings]
    assert got == data["findings"]
    assert got == [["reused", ptr["local"], "allocator trace"], ["freed", ptr["local2"], "allocator state"]]
    # Without the trace, reuse at the same address is invisible: the state alone looks untouched.
    census.reported.clear()
    census.marker = None
    assert [f.status for f in C.check_census(census, "probe", data["later"], device=0)] == ["freed"]


def test_census_line_counts_what_is_not_a_finding():
    a = GraphCensus(label="A", pool=GRAPH_POOL, kernels=3, own_pool=4, outside=1, free_at_capture=2)
    a.references.append(Reference(0, "kernel", "k", "param 0 +0", 0, LOCAL, BlockIndex.of(AT_CAPTURE).find(LOCAL)))
    a.foreign_pools["graph 'B'"] = 1
    line = C.census_line([a.counts()], ["graph 'C': no raw CUDA graph"])
    assert "1 graphs, 3 kernels, 1 captured addresses" in line
    assert "4 in the own pool, 1 outside the allocator, 2 into blocks already free at capture" in line
    assert "other pools (graph 'B')" in line and "not read: graph 'C'" in line


# ------------------------------------------------------------------ no snapshot per capture


def pools_of(snap):
    pools = PoolMap(device=0)
    pools.refresh(snap)
    return pools


def deferred_census(snap, words, own=GRAPH_POOL, capture_us=5):
    """A census taken the fast way: words sorted by segment pool, the rest pending."""
    census = GraphCensus(label="g", pool=own)
    d = Deferred(pools_of(snap), own, is_device_address=lambda v: v == 0x7E00_0000_0000)
    for i, value in enumerate(words):
        d.add(census, 0, "kernel", "k", f"param {i} +0", 8 * i, value)
    census.marker = {"time_us": capture_us}
    return census


def test_pool_map_names_the_pool_of_a_segment_and_nothing_outside():
    pools = pools_of(AT_CAPTURE)
    assert pools.pool_of(LOCAL + 8) == (0, 0)
    assert pools.pool_of(POOL_SEG + MiB + 8) == GRAPH_POOL  # a free block: still the pool's segment
    pools.signature = segment_signature(0)  # nothing changed: a miss stays a miss
    assert pools.pool_of(0x7E00_0000_0000) is None


def test_deferred_census_counts_own_pool_and_outside_and_keeps_the_rest_pending():
    census = deferred_census(AT_CAPTURE, [LOCAL + 64, POOL_SEG + 16, 0x7E00_0000_0000, 4096])
    assert (census.own_pool, census.outside, len(census.pending)) == (1, 1, 1)
    assert census.pending[0].addr == LOCAL + 64 and census.pending[0].pool == (0, 0)
    assert list(census.own_segments) == [POOL_SEG]


def test_pending_words_are_matched_as_the_allocator_saw_them_at_capture():
    # After the capture (t > 5): the local is freed; a block that was free at capture gets taken.
    later = snapshot(
        [
            segment(SEG, [(2 * MiB, "active_allocated"), (MiB, "inactive"), (MiB, "active_allocated")]),
            segment(POOL_SEG, [(MiB, "active_allocated"), (MiB, "inactive")], pool=GRAPH_POOL),
        ],
        trace=[
            ev("alloc", SEG, 2 * MiB, 1),
            ev("alloc", LOCAL, MiB, 2),
            ev("free_completed", LOCAL, MiB, 7),
            ev("alloc", SEG + 3 * MiB, MiB, 8),
        ],
    )
    weight, stale = SEG + 128, SEG + 3 * MiB + 64  # stale: a struct's old bytes into a then-free block
    census = deferred_census(AT_CAPTURE, [weight, LOCAL + 64, stale])
    [finding] = C.check_census(census, "before replay", later, device=0, capacity=None)
    assert (finding.status, finding.census["block_start"], finding.census["block_size"]) == ("freed", LOCAL, MiB)
    assert sorted(r.block.start for r in census.references) == [SEG, LOCAL]
    assert census.free_at_capture == 1 and census.pending == []


def test_pending_words_into_free_blocks_are_not_findings_when_the_trace_is_lost():
    later = snapshot(
        [segment(SEG, [(2 * MiB, "active_allocated"), (2 * MiB, "inactive")])],
        trace=[ev("alloc", SEG, 64, 100 + i) for i in range(4)],
    )  # full ring, all after capture
    census = deferred_census(AT_CAPTURE, [LOCAL + 64])
    assert C.check_census(census, "x", later, device=0, capacity=4) == []
    assert census.free_at_capture == 1 and "could not be told" in census.notes[0]


def test_trace_since_places_the_census_by_the_clock():
    trace = [ev("alloc", SEG, 64, t) for t in (1, 2, 3, 9)]
    assert [e["time_us"] for e in Trace(trace, None).since({"time_us": 2})] == [3, 9]
    assert Trace(trace, 4).since({"time_us": 0}) is None  # the ring wrapped past it
    assert Trace(trace, 8).since({"time_us": 0}) == trace


def test_own_pool_segment_returned_to_the_driver_is_a_finding(monkeypatch):
    book = C.CensusBook(rank=0, trace=C.Tracing.NONE)
    book.censuses["g"] = deferred_census(AT_CAPTURE, [POOL_SEG + 16])
    gone = snapshot([segment(SEG, [(4 * MiB, "inactive")])])
    monkeypatch.setattr(C, "take_snapshot", lambda: (gone, 0))
    [finding] = book.check("before replay")
    assert finding.status == "released" and finding.census["block_start"] == POOL_SEG
    assert book.check("again") == []  # said once


def test_function_info_is_read_once_per_function():
    class Driver:
        function_cache: dict = {}
        calls = 0

        def name(self, p):
            Driver.calls += 1
            return "k"

        def param_layout(self, p):
            Driver.calls += 1
            return [(0, 8)]

    p = KernelNodeParams()
    p.func, p.kernelParams = 0x1234, 0x10
    d = Driver()
    first, again = function_info(d, p), function_info(d, p)
    assert first == again and first[0] == "k" and first[1].pairs == ((0, 8),)
    assert Driver.calls == 2


def test_param_chunks_read_one_contiguous_buffer_or_each_parameter():
    layout = param_layout([(0, 4), (8, 8)])
    raw = (7).to_bytes(4, "little") + bytes(4) + (LOCAL).to_bytes(8, "little")
    buf = ctypes.create_string_buffer(raw, 16)
    base = ctypes.addressof(buf)
    contiguous = (ctypes.c_void_p * 2)(base, base + 8)
    assert param_chunks(contiguous, layout) == ([(raw, 0)], None)
    apart = ctypes.create_string_buffer((LOCAL + 8).to_bytes(8, "little"), 8)
    scattered = (ctypes.c_void_p * 2)(base, ctypes.addressof(apart))
    assert param_chunks(scattered, layout) == ([(raw[:4], 0), ((LOCAL + 8).to_bytes(8, "little"), 8)], None)
    missing = (ctypes.c_void_p * 2)(base, None)
    assert param_chunks(missing, layout)[1] == "parameter 1 has no value"


def test_chunks_keep_words_aligned_to_the_parameter_buffer_and_locate_them():
    chunks = Chunks()
    assert chunks.add(3, "k", bytes(4) + (LOCAL).to_bytes(8, "little") + bytes(3), 4, str) == 1  # buf[4:12] is aligned
    assert chunks.add(4, "j", (LOCAL + 8).to_bytes(8, "little") * 2, 16, str) == 2
    assert chunks.add(5, "i", bytes(5), 0, str) == 0
    assert chunks.words == 3 and [c[:2] for c in chunks.meta] == [(3, "k"), (4, "j")]
    assert [chunks.locate(i)[:3] for i in range(3)] == [(3, "k", 8), (4, "j", 16), (4, "j", 24)]
    assert [(n, words) for n, _, _, words in chunks.each()] == [
        (3, [(8, LOCAL)]),
        (4, [(16, LOCAL + 8), (24, LOCAL + 8)]),
    ]


@pytest.mark.parametrize(
    "small,serial,gathers",
    [
        (0, SERIAL_ELEMENTS, SERIAL_GATHERS),
        (0, 50, SERIAL_GATHERS),
        (0, SERIAL_ELEMENTS, 7),
        (SMALL_GRAPH_WORDS, SERIAL_ELEMENTS, SERIAL_GATHERS),
        (SMALL_GRAPH_WORDS, SERIAL_ELEMENTS, 7),
    ],
    ids=["arrays", "arrays-in-slices", "arrays-gathers-in-slices", "word-by-word", "word-by-word-gathers-in-slices"],
)
def test_deferred_sorts_a_graphs_words_at_once_as_one_by_one(small, serial, gathers, monkeypatch):
    """Every path of add_chunks (a large graph's words in one search, or in slices of `serial`
    words, its gathers whole or in slices of `gathers` positions; a small graph's one by one)
    against add(), word by word: the same own-pool and outside counts, own segments and
    pending words, on random words."""
    import random

    monkeypatch.setattr("repro.diagnose.words.SERIAL_ELEMENTS", serial)  # the global Deferred reads
    monkeypatch.setattr("repro.diagnose.words.SERIAL_GATHERS", gathers)
    rng = random.Random(7)
    pools = pools_of(AT_CAPTURE)
    outside = 0x7E00_0000_0000

    def value():
        if rng.random() < 0.6:  # in or near a segment (either pool)
            start, end, _ = rng.choice(pools.segments)
            return rng.randrange(start - 4096, end + 4096) & ~7
        return rng.choice([0, 5, 1 << 50, outside, outside + 64, rng.randrange(1 << 64)])

    chunks, one = Chunks(), GraphCensus(label="g", pool=GRAPH_POOL)
    d = Deferred(pools, GRAPH_POOL, is_device_address=lambda v: v >> 21 == outside >> 21, small=small)
    layout = param_layout([(0, 8), (8, 64), (72, 4)])
    for node in range(40):
        words = [value() for _ in range(9)]
        raw = b"".join(w.to_bytes(8, "little") for w in words) + bytes(4)
        chunks.add(node, f"k{node % 3}", raw, 0, layout.where)
        for i, w in enumerate(words):
            if plausible_address(w):
                d.add(one, node, "kernel", f"k{node % 3}", layout.where(8 * i), 8 * i, w)
    many = GraphCensus(label="g", pool=GRAPH_POOL)
    d.add_chunks(many, chunks)
    assert (many.own_pool, many.outside) == (one.own_pool, one.outside) and one.own_pool and one.outside
    assert many.pending == one.pending and len(one.pending) > 10
    assert {k: v.describe() for k, v in many.own_segments.items()} == {
        k: v.describe() for k, v in one.own_segments.items()
    }
    assert many.own_segments == one.own_segments and list(many.own_segments) == list(one.own_segments)
    assert many.own_segments
    # Asked later (a CensusBook's way): the outside words wait in unasked, then two censuses are
    # counted at once, one query per page, to what asking at once gave.
    asked = []

    def is_device_address(v):
        asked.append(v)
        return v >> 21 == outside >> 21

    later = [GraphCensus(label=f"g{i}", pool=GRAPH_POOL) for i in range(2)]
    d_later = dataclasses.replace(d, is_device_address=is_device_address, ask_later=True)
    for census in later:
        d_later.add_chunks(census, chunks)
    assert [c.outside for c in later] == [0, 0] and all(c.unasked for c in later) and asked == []
    ask_outside(later, is_device_address)
    assert [c.outside for c in later] == [one.outside] * 2 and [c.unasked for c in later] == [[], []]
    assert len(asked) == len({v >> 21 for v in asked})  # each page asked once, both graphs together
    assert [c.pending for c in later] == [one.pending] * 2 and later[0].own_pool == one.own_pool


def test_param_layout_names_the_parameter_of_an_offset():
    layout = param_layout([(0, 4), (8, 24), (32, 8)])
    assert (layout.first, layout.end, layout.rel) == (0, 40, (0, 8, 32))
    assert [layout.where(o) for o in (0, 16, 32)] == ["param 0 +0", "param 1 +8", "param 2 +0"]
    # Asked again (every node launching the function): the same name, made once.
    assert layout.where(16) is layout.where(16) and set(layout.names) == {0, 16, 32}
    assert param_layout([(0, 4)]).names == {}  # each layout its own names


def edge_addresses(pools, rng):
    """Around every segment: below it, its start, inside, its last byte, its end (the next
    segment's start or a gap), and random words; some twice."""
    out = []
    for start, end, _ in pools.segments:
        out += [start - 8, start - 1, start, start + 8, rng.randrange(start, end), end - 8, end - 1, end, end + 8]
    out += [0, 5, MIN_ADDR, MAX_ADDR - 8, pools.segments[-1][1] + MiB] + [rng.randrange(1 << 48) for _ in range(50)]
    return out + rng.sample(out, 20)


def random_pools(rng):
    """40 segments of random sizes in three pools, some adjacent, some with gaps between."""
    segs, addr = [], SEG
    for _ in range(40):
        size = rng.choice([2 * MiB, 20 * MiB, rng.randrange(1, 64) * 4096])
        segs.append(segment(addr, [(size, "active_allocated")], pool=rng.choice([(0, 0), GRAPH_POOL, (2, 3)])))
        addr += size + rng.choice([0, 0, 4096, 64 * MiB])
    return pools_of(snapshot(segs))


def test_find_all_and_the_array_search_answer_as_find_does_at_segment_edges():
    """PoolMap.find_all (remembered addresses in one pass, the rest through find) and the
    census's array search (segment_positions over PoolMap.arrays(), then the end check) give
    find()'s segment for every address: starts, last bytes, ends, gaps, repeats."""
    import random

    import torch

    rng = random.Random(3)
    pools = random_pools(rng)
    addrs = edge_addresses(pools, rng)
    expected = [pools.find(a) for a in addrs]
    fresh = random_pools(random.Random(3))
    for a in addrs[::3]:  # a third of them remembered already
        fresh.find(a)
    assert fresh.find_all(addrs) == expected
    assert fresh.find_all(addrs) == expected  # now all remembered
    assert fresh.find_all([]) == []
    starts, ends, pool_ix, pool_list = pools.arrays()
    v = torch.tensor(addrs, dtype=torch.int64)
    seg = segment_positions(torch, starts, v) - 1
    inside = (seg >= 0) & (v < take(torch, ends, seg.clamp(min=0)))
    got = [pools.segments[s] if ok else None for s, ok in zip(seg.tolist(), inside.tolist())]
    assert got == expected and None in expected and any(e is not None for e in expected)


def test_segment_block_is_the_segment_as_one_allocated_block_until_a_refresh():
    pools = pools_of(AT_CAPTURE)
    seg = pools.find(POOL_SEG + 8)
    block = pools.segment_block(seg)
    assert block == Block(start=POOL_SEG, size=2 * MiB, state="active_allocated", pool=GRAPH_POOL, segment=POOL_SEG)
    assert pools.segment_block(seg) is block  # one per segment, for every graph
    pools.refresh(AT_CAPTURE)
    assert pools.segment_block(pools.find(POOL_SEG + 8)) is not block
    assert pools.segment_block(pools.find(POOL_SEG + 8)) == block


def test_plausible_words_keep_only_what_may_be_an_address_and_count_every_word():
    buf = b"".join(v.to_bytes(8, "little") for v in (5, LOCAL, 1 << 50, 0, LOCAL + 8))
    assert plausible_words(buf, 0) == (5, [(8, LOCAL), (32, LOCAL + 8)])
    assert plausible_words(b"\x00" * 4 + buf, 4) == (5, [(16, LOCAL), (40, LOCAL + 8)])  # buf[4:] is aligned


# ------------------------------------------------------------------ words the guard takes


def test_words_handed_to_the_guard_leave_the_census_and_are_counted_held():
    book = C.CensusBook(trace=C.Tracing.NONE)
    census = deferred_census(AT_CAPTURE, [LOCAL + 64, LOCAL + 72, POOL_SEG + 16])
    book.censuses["g"] = census
    taken, left = census.pending
    book.hand_over(census, [left])
    assert census.pending == [left] and census.held == [taken.addr]
    assert census.counts()["held"] == 1 and book.held_in(LOCAL, LOCAL + 65) and not book.held_in(LOCAL, LOCAL + 64)
    assert "(and 1 in storages the guard names, checked through it)" in book.census_line()
    # A guard finding in a storage the census handed over is one mechanism's, with no
    # disagreement; one the census never saw still says so.
    held = guard_finding(ptr=LOCAL + 64, nbytes=8)
    unseen = guard_finding(ptr=LOCAL + 4 * MiB, nbytes=8)
    merged = merge_findings([held, unseen], [], [], True, book)
    assert [f.disagreement for f in merged] == ["", "the census found no captured address in this storage"]


@pytest.mark.parametrize("n", [0, 7, SERIAL_GATHERS, SERIAL_GATHERS + 1, 3 * SERIAL_GATHERS + 5])
def test_the_sliced_gather_gives_what_one_index_gives(n):
    """take gathers in slices small enough for torch to run each on the calling thread;
    positions is nonzero's answer as a 1-d tensor."""
    import torch

    gen = torch.Generator().manual_seed(n)
    source = torch.randint(-(1 << 62), 1 << 62, (97,), generator=gen)
    index = torch.randint(0, 97, (n,), generator=gen)
    assert torch.equal(take(torch, source, index), source[index])
    mask = torch.rand(n, generator=gen) < 0.3
    assert torch.equal(positions(mask), torch.arange(n)[mask])


@pytest.mark.parametrize("n", [0, 7, SERIAL_SEARCHES, SERIAL_SEARCHES + 1, 3 * SERIAL_SEARCHES + 5])
def test_the_sliced_search_gives_what_one_search_gives(n):
    """segment_positions searches in slices small enough for torch to run each on the calling
    thread; the answer must be the one search's, slice edges included."""
    import random

    import torch

    rng = random.Random(n)
    values = torch.tensor(
        [rng.choice([0, 5, LOCAL, LOCAL + 8, 1 << 50, -5, MIN_ADDR, MAX_ADDR - 8]) for _ in range(n)], dtype=torch.int64
    )
    starts = torch.sort(torch.tensor([rng.randrange(MIN_ADDR, MAX_ADDR) for _ in range(50)] + [LOCAL])).values
    assert torch.equal(segment_positions(torch, starts, values), torch.searchsorted(starts, values, right=True))


# -- allocation stacks (repro watch --stacks) ------------------------------------------------------


def test_start_trace_records_allocation_stacks_only_when_asked(monkeypatch):
    import torch

    from repro.diagnose import allocator

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(kw))
    allocator.start_trace()
    allocator.start_trace(stacks=True)
    assert [(c["enabled"], c["context"], c["stacks"]) for c in calls] == [
        ("all", None, "python"),  # no stack gathered: the census's cheap trace
        ("all", "alloc", "python"),  # each allocation's python stack
    ]
    assert {c["max_entries"] for c in calls} == {allocator.TRACE_ENTRIES}


def test_a_stacks_book_keeps_the_stacks_and_never_pauses_the_trace(monkeypatch):
    started = []
    monkeypatch.setattr(C, "start_trace", lambda capacity, stacks=False: started.append((capacity, stacks)))
    book = C.CensusBook(rank=0, trace=C.Tracing.STACKS)
    assert started == [(C.TRACE_ENTRIES, True)] and book.traced and book.capacity == C.TRACE_ENTRIES
    assert book.pause_trace() is False and not book.paused  # allocations between phases keep their stacks
    book.paused = True  # as after a pause of an earlier torch: resumed with the same settings
    book.resume_trace()
    assert started[-1] == (C.TRACE_ENTRIES, True) and not book.paused
    C.CensusBook(rank=0, trace=C.Tracing.START)
    assert started[-1] == (C.TRACE_ENTRIES, False)  # without --stacks: as before


def frames(*sites):
    """An allocation's stack as torch's snapshot gives it: innermost first."""
    return [{"filename": f, "line": line, "name": name} for f, line, name in sites]


def test_allocation_stacks_give_the_frames_of_the_live_block_holding_an_address():
    from repro.diagnose.allocator import AllocationStacks

    made = frames(("/home/u/prog.py", 12, "build"))
    snap = snapshot(
        [
            {
                "address": SEG,
                "total_size": 6 * MiB,
                "segment_pool_id": (0, 0),
                "blocks": [
                    {"address": SEG, "size": 2 * MiB, "state": "active_allocated", "frames": made},
                    {"address": SEG + 2 * MiB, "size": 2 * MiB, "state": "inactive", "frames": made},
                    {"address": SEG + 4 * MiB, "size": 2 * MiB, "state": "active_allocated"},  # before the history
                ],
            }
        ]
    )
    reads = []
    stacks = AllocationStacks(lambda: reads.append(1) or (snap, 0))
    assert stacks.frames_at(SEG + 100) == made
    assert stacks.frames_at(SEG + 2 * MiB) == []  # freed since: its frames are another allocation's
    assert stacks.frames_at(SEG + 4 * MiB) == [] and stacks.frames_at(SEG - 1) == []
    assert stacks.frames_at(SEG + 6 * MiB) == []
    assert reads == [1]  # one read of the segments, at the first question


def test_driver_lists_a_graphs_nodes_as_the_driver_fills_them():
    """Driver.nodes asks cuGraphGetNodes for the count, then for the handles, and returns them as
    plain ints (a null handle as None, as ctypes reads one); a stand-in libcuda entry point."""
    import types

    handles = [0x7F00_0000_1000, 0x7F00_0000_2000, 0, 0x7F00_0000_3000]
    asked = []

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t))
    def get_nodes(graph, out, count):
        asked.append((graph, bool(out)))
        if out:
            for i, h in enumerate(handles[: count[0]]):
                out[i] = h
        count[0] = len(handles)
        return 0

    driver = Driver(types.SimpleNamespace(cuGraphGetNodes=get_nodes))
    assert driver.nodes(0xABC) == [0x7F00_0000_1000, 0x7F00_0000_2000, None, 0x7F00_0000_3000]
    assert asked == [(0xABC, False), (0xABC, True)]


def test_is_device_address_asks_the_driver_once_per_2mib_page_and_times_it():
    """Words outside the allocator are counted as device addresses by asking the driver, once
    per 2 MiB page (a graph holds thousands of int pairs that look like addresses): the exit
    record reports how many pages were asked about and the seconds it took."""
    from repro.diagnose.cuda_driver import CU_MEMORYTYPE_DEVICE, CUDA_ERROR_INVALID_VALUE, CUDA_SUCCESS, Driver

    asked = []

    def get_attribute(mem, attribute, value):
        asked.append(value.value)
        mem._obj.value = CU_MEMORYTYPE_DEVICE
        return CUDA_SUCCESS if value.value >> 21 == 0x7F00_0000_0000 >> 21 else CUDA_ERROR_INVALID_VALUE

    lib = types.SimpleNamespace(cuPointerGetAttribute=get_attribute)
    driver = Driver(lib)
    page = 0x7F00_0000_0000
    assert driver.is_device_address(page + 8) and driver.is_device_address(page + (1 << 21) - 8)
    assert not driver.is_device_address(0x5600_0000_0000) and not driver.is_device_address(0x5600_0000_0040)
    assert asked == [page + 8, 0x5600_0000_0000]  # one query per page, its answer cached
    assert len(driver.address_cache) == 2 and driver.address_seconds > 0
