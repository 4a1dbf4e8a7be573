"""CaptureGuard and forensics under a real torch.cuda.CUDAGraph capture (run on a GPU machine)."""

from __future__ import annotations

import pickle

import pytest
import torch

from repro.diagnose.forensics import MemoryHistory, snapshot_name
from repro.diagnose.guard import CaptureGuard, StaleCaptureError

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda(cuda_only):
    yield


def warm_up(fn) -> None:
    """Run once on a side stream before capturing, as torch.cuda.graph's docs ask."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def gather_weight() -> torch.Tensor:
    return torch.randn(4096, 256, device="cuda")  # stands in for the all-gathered lm_head


def capture_with_local_weight(
    guard: CaptureGuard, graph: torch.cuda.CUDAGraph, static_in: torch.Tensor
) -> torch.Tensor:
    """The unfixed pattern: the captured weight is a local of the capture routine."""
    weight = gather_weight()
    warm_up(lambda: static_in @ weight.t())
    with guard.capture(graph, "centroids bs=16"):
        out = static_in @ weight.t()
    return out


def test_capture_input_freed_is_reported_before_replay_with_stacks(tmp_path):
    with MemoryHistory(enabled=True, max_entries=20_000) as history:
        assert history.active, history.reason
        guard = CaptureGuard("warn")
        graph = torch.cuda.CUDAGraph()
        static_in = torch.randn(16, 256, device="cuda")
        with guard.tracking():
            capture_with_local_weight(guard, graph, static_in)

        findings = guard.check("before replay")  # the graph is never replayed here

        assert [f.status for f in findings] == ["freed"]
        finding = findings[0]
        assert finding.shape == [4096, 256] and finding.nbytes == 4096 * 256 * 4
        assert "gather_weight" in finding.created_at
        assert "capture_with_local_weight" in finding.freed_at or "test_capture_input_freed" in finding.freed_at
        assert guard.freed_blocks()[0][1] == 4096 * 256 * 4

        where = history.locate(finding.old_ptr)
        assert where is not None, history.reason
        assert where["addr"] <= finding.old_ptr < where["addr"] + where["size"]
        assert where["freed"]
        assert any("gather_weight" in f for f in where["alloc_stack"]), where
        assert any("test_capture_input_freed" in f for f in where["alloc_stack"]), where
        assert any("test_capture_input_freed" in f for f in where["free_stack"]), where

        assert history.annotate(findings) == 1
        assert finding.alloc_stack == where["alloc_stack"]

        path = history.dump(tmp_path / snapshot_name("probe", 0, 1))
        assert path is not None, history.reason
        with open(path, "rb") as fh:
            assert "device_traces" in pickle.load(fh)


def test_live_inputs_are_unchanged_and_replay_is_correct():
    guard = CaptureGuard("raise")
    weight = torch.randn(512, 64, device="cuda")
    static_in = torch.randn(8, 64, device="cuda")
    warm_up(lambda: static_in @ weight.t())
    graph = torch.cuda.CUDAGraph()
    with guard.capture(graph, "probe"):
        out = static_in @ weight.t()

    assert guard.check("before replay") == []
    static_in.copy_(torch.randn(8, 64, device="cuda"))
    graph.replay()
    torch.testing.assert_close(out, static_in @ weight.t())
    assert guard.manifest("after replay").unchanged == 2


def test_raise_mode_stops_before_the_replay():
    guard = CaptureGuard("raise")
    graph = torch.cuda.CUDAGraph()
    static_in = torch.randn(16, 256, device="cuda")
    capture_with_local_weight(guard, graph, static_in)
    with pytest.raises(StaleCaptureError, match="has been freed"):
        guard.check("before replay")


def test_rebound_kernel_workspace_on_cuda():
    class Kernel:
        def __init__(self):
            self.workspace = torch.zeros(1024, device="cuda")

    owner = torch.nn.Module()
    owner.kernel = Kernel()
    guard = CaptureGuard("warn")
    guard.watch("moe", owner)
    x = torch.ones(1024, device="cuda")
    warm_up(lambda: x + owner.kernel.workspace)
    graph = torch.cuda.CUDAGraph()
    with guard.capture(graph, "moe"):
        x + owner.kernel.workspace
    old = owner.kernel
    owner.kernel = Kernel()

    (finding,) = guard.check("after reload")
    assert (finding.slot, finding.status) == ("moe.kernel.workspace", "rebound")
    assert finding.new_ptr == owner.kernel.workspace.data_ptr() != finding.old_ptr
    assert old.workspace.data_ptr() == finding.old_ptr


def test_torch_liveness_option_is_used_only_where_torch_has_it():
    guard = CaptureGuard("warn")
    weight = torch.randn(64, 64, device="cuda")
    static_in = torch.randn(4, 64, device="cuda")
    warm_up(lambda: static_in @ weight)  # noqa: F821 (weight is deleted below, on purpose)
    graph = torch.cuda.CUDAGraph()
    with guard.capture(graph, "probe", use_torch_liveness=True):
        static_in @ weight
    if guard.torch_liveness_available:
        assert guard.mechanism.startswith("torch check_input_liveness")
    else:
        assert guard.mechanism == "repro dispatch-mode guard"
    del weight
    assert [f.status for f in guard.check("before replay")] == ["freed"]
