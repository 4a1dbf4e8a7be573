"""Graph census under real CUDA graphs: where only the census sees the bug, and controls.

Blind spots of the dispatcher-level guard (it must report nothing in each):
  * a raw Triton kernel reading a buffer freed after capture;
  * a kernel compiled with NVRTC and launched with cuLaunchKernel, whose only pointer to the
    freed buffer sits inside a struct parameter;
  * cuBLAS's workspace allocated inside an earlier graph's private pool and baked into a later
    graph's GEMM (vllm-omni #6457), then dropped while the later graph lives.
Controls with no census finding: a graph whose inputs are updated in place; the fixed modes of
both scenarios (nvfp4-reload; gemma4-mtp at TP=1), REPRO_CENSUS_SEEDS seeds each (default 2).
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from repro.diagnose.captured import GraphCensus
from repro.diagnose.census import CensusBook
from repro.rank.graphs import capture
from repro.diagnose.guard import CaptureGuard

pytestmark = pytest.mark.gpu

try:
    import triton
    import triton.language as tl

    @triton.jit
    def twice_kernel(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask) * 2, mask=mask)
except ImportError:  # CPU machines without triton only collect this file
    triton = None

SPAN_SOURCE = rb"""
struct Span { long long n; const float* src; float* dst; };
extern "C" __global__ void span_add_one(Span s) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < s.n) s.dst[i] = s.src[i] + 1.0f;
}
"""


@pytest.fixture(autouse=True)
def _cuda(cuda_only):
    yield


def holds(finding, ptr: int) -> bool:
    c = finding.census
    return c["block_start"] <= ptr < c["block_start"] + c["block_size"]


def only_census_sees(book: CensusBook, guard: CaptureGuard, ptr: int, status: str = "freed") -> list:
    findings = book.check("after set-up")
    assert [f.status for f in findings if holds(f, ptr)] == [status], [f.message for f in findings]
    assert guard.check("after set-up") == [], "the guard must be blind to this case"
    return findings


def test_raw_triton_kernel_reading_a_freed_buffer_is_seen_only_by_the_census():
    if triton is None:
        pytest.skip("triton is not installed")
    book, guard = CensusBook(), CaptureGuard("warn")
    n = 1 << 20
    src = torch.randn(n, device="cuda")
    out = torch.empty(n, device="cuda")

    def launch(dst):
        twice_kernel[(n // 1024,)](src, dst, n, BLOCK=1024)  # noqa: F821 (src is deleted below: the bug)
        return dst

    captured = capture(launch, (out,), "triton twice", guard, census=book)
    ptr = src.data_ptr()
    book.resolve()  # words are matched at the first check
    census: GraphCensus = book.censuses["triton twice"]
    assert any(r.addr == ptr and "twice_kernel" in r.kernel for r in census.references), census.counts()
    del src  # freed after capture
    [f] = [f for f in only_census_sees(book, guard, ptr) if holds(f, ptr)]
    assert "twice_kernel" in f.census["kernel"] and f.census["where"].startswith("param ")
    assert guard.slots == []
    del captured


def nvrtc_ptx(source: bytes, name: bytes) -> bytes:
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    err, prog = nvrtc.nvrtcCreateProgram(source, name, 0, [], [])
    assert err == ok, err
    major, minor = torch.cuda.get_device_capability()
    opts = [f"--gpu-architecture=compute_{major}{minor}".encode()]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if err != ok:
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        pytest.fail(f"NVRTC failed: {log.decode(errors='replace')}")
    err, size = nvrtc.nvrtcGetPTXSize(prog)
    ptx = b" " * size
    (err,) = nvrtc.nvrtcGetPTX(prog, ptx)
    assert err == ok, err
    return ptx


class Span(ctypes.Structure):
    _fields_ = [("n", ctypes.c_longlong), ("src", ctypes.c_uint64), ("dst", ctypes.c_uint64)]


def test_pointer_inside_a_struct_parameter_is_seen_only_by_the_census():
    ptx = nvrtc_ptx(SPAN_SOURCE, b"span.cu")
    cuda = ctypes.CDLL("libcuda.so.1")
    torch.cuda.init()
    module, fn = ctypes.c_void_p(), ctypes.c_void_p()
    assert cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(ptx)) == 0
    assert cuda.cuModuleGetFunction(ctypes.byref(fn), module, b"span_add_one") == 0
    book, guard = CensusBook(), CaptureGuard("warn")
    n = 1 << 18
    src = torch.randn(n, device="cuda")
    out = torch.zeros(n, device="cuda")
    span = Span(n, src.data_ptr(), out.data_ptr())
    params = (ctypes.c_void_p * 1)(ctypes.addressof(span))

    def launch(dst):
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        code = cuda.cuLaunchKernel(fn, n // 256, 1, 1, 256, 1, 1, 0, stream, params, None)
        assert code == 0, f"cuLaunchKernel: CUresult {code}"
        return dst

    captured = capture(launch, (out,), "struct span", guard, census=book)
    captured.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, src + 1)  # the launch really ran in the graph
    ptr = src.data_ptr()
    book.resolve()  # words are matched at the first check
    census = book.censuses["struct span"]
    [ref] = [r for r in census.references if r.addr == ptr]
    assert (ref.kernel, ref.where, ref.offset) == ("span_add_one", "param 0 +8", 8)
    del src
    only_census_sees(book, guard, ptr)


def test_cublas_workspace_in_an_earlier_graphs_pool_is_seen_only_by_the_census():
    """vllm-omni #6457: the workspace made during graph A's capture lives in A's pool; B uses it."""
    book, guard = CensusBook(), CaptureGuard("warn")
    torch._C._cuda_clearCublasWorkspaces()
    a = torch.randn(64, 65536, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(65536, 64, device="cuda", dtype=torch.bfloat16)
    graph_a = capture(lambda x: x @ b, (a,), "A", guard, census=book)
    graph_b = capture(lambda x: x @ b, (a,), "B", guard, census=book)
    book.resolve()  # words are matched at the first check
    census_b = book.censuses["B"]
    assert census_b.foreign_pools.get("graph 'A'", 0) > 0, census_b.counts()
    workspace = next(r for r in census_b.references if r.block.pool == book.censuses["A"].pool)
    assert book.check("after capture") == [] and guard.check("after capture") == []
    torch._C._cuda_clearCublasWorkspaces()  # what retiring graphs may do
    findings = book.check("after clearing cuBLAS workspaces", "B")
    assert [f.status for f in findings if holds(f, workspace.addr)] in (["freed"], ["released"]), [
        f.message for f in findings
    ]
    assert guard.check("after clearing cuBLAS workspaces") == []
    del graph_a, graph_b


def test_inputs_updated_in_place_give_no_census_finding():
    book, guard = CensusBook(), CaptureGuard("warn")
    x = torch.randn(256, 512, device="cuda")
    w = torch.randn(512, 128, device="cuda")
    captured = capture(lambda t: torch.relu(t @ w), (x,), "in place", guard, census=book)
    book.resolve()  # words are matched at the first check
    census = book.censuses["in place"]
    assert census.kernels > 0 and {x.data_ptr(), w.data_ptr()} <= {r.addr for r in census.references}
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        w.copy_(torch.randn_like(w))
        assert book.check("after update") == [] and guard.check("after update") == []
        out = captured.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, torch.relu(x @ w))
    assert census.unreadable == [], census.unreadable


def seeds() -> int:
    return int(os.environ.get("REPRO_CENSUS_SEEDS", "2"))


@pytest.mark.parametrize(
    "scenario,run",
    [
        ("nvfp4-reload", {"mode": "fixed", "steps": 3}),
        ("gemma4-mtp", {"mode": "fixed", "tp": 1}),
    ],
)
def test_fixed_modes_give_no_census_finding(tmp_path, scenario, run):
    from repro.env import gpus
    from repro.run.runner import plan, run_planned

    planned = [plan(scenario, None, {**run, "seed": s}, [], gpus.gpu_count()) for s in range(seeds())]
    trials = run_planned(planned, tmp_path, jobs=min(8, len(planned))).report.trials
    for t in trials:
        census = t.details.get("census") or []
        # The census really ran: every graph was read and holds outside-pool references.
        assert census and all(c["kernels"] > 0 and c["references"] > 0 for c in census), (t.id, census)
        seen = [f.message for f in t.guard_findings if f.mechanism in ("census", "both")]
        assert seen == [], (t.id, seen)
        assert t.outcome.value == "CLEAN", (t.id, t.outcome, t.first_failure)
