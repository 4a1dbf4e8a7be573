"""Contents lost at the same address under a real torch.cuda.CUDAGraph (run on a GPU machine):
cuMemsetD8 on a captured tensor's data_ptr is what a level-1 sleep does to memory in a
discarded pool (vLLM #53508): same address, same _version, new bytes."""

from __future__ import annotations

import ctypes

import pytest
import torch

from repro.diagnose import fingerprint
from repro.rank.graphs import HarnessMemory, capture
from repro.diagnose.guard import CaptureGuard

pytestmark = pytest.mark.gpu
GRAPH = "decode bs=4"


@pytest.fixture(autouse=True)
def _cuda(cuda_only):
    yield


def cuda_memset(t: torch.Tensor, byte: int, offset: int = 0, nbytes: int | None = None) -> None:
    """The driver writes the bytes; torch never hears of it."""
    torch.cuda.synchronize()
    libcuda = ctypes.CDLL("libcuda.so.1")
    n = t.nbytes - offset if nbytes is None else nbytes
    rc = libcuda.cuMemsetD8_v2(ctypes.c_uint64(t.data_ptr() + offset), ctypes.c_ubyte(byte), ctypes.c_size_t(n))
    assert rc == 0, f"cuMemsetD8_v2 returned {rc}"
    torch.cuda.synchronize()


class Runner:
    def __init__(self):
        dev = "cuda"
        self.meta = torch.arange(64, dtype=torch.int32, device=dev)  # read by the graph
        self.kv = torch.zeros(16, 8, device=dev)  # written by the graph
        self.weight = torch.randn(8, 8, device=dev)
        self.big = torch.randn(1 << 22, device=dev)  # 16 MiB: sampled
        self.x = torch.ones(4, 8, device=dev)  # static input


def decode(r: Runner, x: torch.Tensor) -> torch.Tensor:
    r.kv.index_copy_(0, r.meta[:4].long(), x)
    return (x * r.meta[:4, None].float()) @ r.weight + r.big[:8].sum()


def captured(r: Runner, guard: CaptureGuard) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode(r, r.x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with guard.capture(graph, GRAPH):
        r.out = decode(r, r.x)
    return graph


def test_driver_memset_of_captured_metadata_is_found_and_graph_writes_are_not():
    r = Runner()
    guard = CaptureGuard("warn")
    guard.watch("runner", r)
    graph = captured(r, guard)
    assert {s.name for s in guard.slots if s.written} == {"runner.kv"}
    with guard.replaying(GRAPH):
        graph.replay()
    assert guard.check("after the first replay") == []

    cuda_memset(r.kv, 0xFF)  # the graph's own KV cache: its business
    cuda_memset(r.meta, 0)  # level-1 sleep: discarded, handed back zeroed
    assert guard.check("after wake", deep=False) == []  # liveness: nothing to see
    findings = guard.check("after wake")
    assert [(f.slot, f.status) for f in findings] == [("runner.meta", "contents-changed")]
    assert findings[0].old_ptr == r.meta.data_ptr() and findings[0].new_ptr is None

    r.meta.copy_(torch.arange(64, dtype=torch.int32, device="cuda"))  # restored by torch: a write
    r.weight.mul_(2)
    assert guard.check("after restore") == []
    cuda_memset(r.big, 0, offset=1 << 20, nbytes=4 << 20)  # 4 MiB of 16 lost: sampled, seen
    assert [f.slot for f in guard.check("after a partial loss")] == ["runner.big"]
    graph.replay()
    torch.cuda.synchronize()


def test_harness_capture_fingerprints_at_its_end_and_brackets_the_first_replay():
    r = Runner()
    memory = HarnessMemory(torch.device("cuda"))
    guard = CaptureGuard("warn", scratch=memory.use)
    guard.watch("runner", r)
    graph = capture(lambda x: decode(r, x), (r.x,), GRAPH, guard)
    printed = {s.name for s in guard.slots if s.contents is not None}
    assert printed == {"runner.meta", "runner.weight", "runner.big", "runner.x"}
    assert graph.replay() is not None and graph.replays == 1
    r.x.copy_(torch.randn(4, 8, device="cuda"))  # the static input, written before a replay
    graph.replay()
    assert guard.check("before replay, step 1") == []
    cuda_memset(r.weight, 0x3C)
    assert [f.slot for f in guard.check("after wake")] == ["runner.weight"]


def test_fingerprints_of_unchanged_memory_are_the_same_on_the_device():
    r = Runner()
    guard = CaptureGuard("warn")
    guard.watch("runner", r)
    captured(r, guard)
    slots = [s for s in guard.slots if s.contents is not None]
    digests = fingerprint.measure(slots)
    assert all(d is not None for d in digests) and digests == fingerprint.measure(slots)  # deterministic
