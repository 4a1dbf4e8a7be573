"""The pytest plugin over real CUDA graphs (torch.cuda.CUDAGraph): findings per test.

    python3 -m pytest -m gpu tests/test_pytest_plugin_gpu.py

Inner pytest sessions in subprocesses (as in test_pytest_plugin.py), each on the GPU.
"""
from __future__ import annotations

import pytest

from test_pytest_plugin import REPO, out_of, run_pytest

pytestmark = pytest.mark.gpu

GRAPHS = """
import subprocess
import sys

import pytest
import torch


def capture_routine(graph, x):
    weight = torch.randn(64, 64, device="cuda")     # held by this local only: freed on return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x @ weight
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = x @ weight
    return out


X = None


@pytest.fixture(scope="module")
def stale_graph():
    global X
    X = torch.randn(8, 64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    capture_routine(graph, X)
    return graph


def test_clean_graph():
    weight = torch.randn(64, 64, device="cuda")
    x = torch.randn(8, 64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x @ weight
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = x @ weight
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x @ weight)


def test_captures(stale_graph):
    pass


def test_replays_later(stale_graph):
    stale_graph.replay()
    torch.cuda.synchronize()


SUB = '''
import torch
from test_graphs import capture_routine
x = torch.randn(8, 64, device="cuda")
g = torch.cuda.CUDAGraph()
capture_routine(g, x)
g.replay()
torch.cuda.synchronize()
'''


def test_subprocess_graph():
    assert subprocess.call([sys.executable, "-c", SUB]) == 0
"""


@pytest.fixture
def cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def check_findings(out: str) -> None:
    assert "FAILED test_graphs.py::test_replays_later" in out, out
    assert "FAILED test_graphs.py::test_subprocess_graph" in out
    assert "captured in: test_graphs.py::test_captures (setup)" in out
    assert "replayed in: test_graphs.py::test_replays_later (call)" in out
    assert "captured in: test_graphs.py::test_subprocess_graph (call)" in out
    assert "<local weight of capture_routine" in out


def test_real_graphs_give_findings_per_test(tmp_path, cuda):
    proc = run_pytest(tmp_path, {"test_graphs.py": GRAPHS}, "-q", "--repro-watch")
    out = out_of(proc)
    assert "2 failed, 2 passed" in proc.stdout, out
    check_findings(out)


def test_real_graphs_under_xdist(tmp_path, cuda):
    pytest.importorskip("xdist")
    proc = run_pytest(tmp_path, {"test_graphs.py": GRAPHS}, "-q", "-n", "2", "--dist", "loadfile",
                      "--repro-watch")
    out = out_of(proc)
    assert "2 failed, 2 passed" in proc.stdout, out
    check_findings(out)


def test_example_suite_names_the_rebuilt_kernels_workspace(tmp_path, cuda):
    proc = run_pytest(tmp_path, {}, "-q", "--repro-watch", str(REPO / "examples" / "engine_ci"))
    out = out_of(proc)
    assert "1 failed, 3 passed" in proc.stdout, out
    assert "FAILED" in out and "test_reload_rebuilds_the_kernel_under_a_graph" in out
    assert "layer.kernel.workspace" in out
    assert "replayed in: " in out and "test_reload_rebuilds_the_kernel_under_a_graph (call)" in out
