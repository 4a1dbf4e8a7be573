"""The pytest plugin over real CUDA graphs (torch.cuda.CUDAGraph): findings per test.

    python3 -m pytest -m gpu tests/test_pytest_plugin_gpu.py

Inner pytest sessions in subprocesses (as in test_pytest_plugin.py), each on the GPU. Needs
only pytest and a CUDA torch; the xdist test skips where pytest-xdist is not installed.
"""

from __future__ import annotations

import re

import pytest

from test_pytest_plugin import REPO, findings_by_test, graphs_checked, junit_findings, out_of, run_pytest

pytestmark = pytest.mark.gpu

# Four tests, three graphs: one clean, one captured by a module fixture (in the first test's
# setup) and replayed by the next test after its input died, one captured and replayed by a
# program a test starts. Exactly two tests replay dead memory.
GRAPHS = """
import subprocess
import sys

import pytest
import torch


def capture_routine(graph, x):
    # The capture is written out here, not shared with test_clean_graph through a helper: the
    # finding names the frame whose local holds the tensor while the ops run (capture_routine).
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
    X = torch.randn(8, 64, device="cuda")           # the static input: alive for the module
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

# Each stale test: the test phase that captured its graph and the one that replayed it.
STALE_TESTS = {
    "test_graphs.py::test_replays_later": (
        "test_graphs.py::test_captures (setup)",
        "test_graphs.py::test_replays_later (call)",
    ),
    "test_graphs.py::test_subprocess_graph": (
        "test_graphs.py::test_subprocess_graph (call)",
        "test_graphs.py::test_subprocess_graph (call)",
    ),
}


@pytest.fixture
def cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def check_findings(out: str) -> None:
    """The terminal summary: findings on exactly the two tests that replayed dead memory, each
    naming the dead local and the phases that captured and replayed its graph; all three
    graphs checked."""
    by_test = findings_by_test(out)
    assert sorted(by_test) == sorted(STALE_TESTS), out
    for test, (captured, replayed) in STALE_TESTS.items():
        assert any(
            "<local weight of capture_routine" in line
            and " freed " in line
            and f"captured in {captured}; replayed in {replayed};" in line
            for line in by_test[test]
        ), out
    assert graphs_checked(out) == 3, out


def check_failures(proc) -> None:
    """Fail mode: each stale test failed with the finding as its failure text."""
    out = out_of(proc)
    for test, (captured, replayed) in STALE_TESTS.items():
        assert f"FAILED {test}" in proc.stdout, out
        assert f"captured in: {captured}\n  replayed in: {replayed}\n" in out, out


def check_junit(path) -> None:
    """pytest's own --junitxml: the findings as properties of exactly the two stale tests."""
    props = junit_findings(path)
    assert sorted(props) == ["test_captures", "test_clean_graph", "test_replays_later", "test_subprocess_graph"]
    assert props["test_clean_graph"] == [] and props["test_captures"] == [], props
    for test, (captured, replayed) in STALE_TESTS.items():
        values = props[test.split("::")[1]]
        assert values and all(
            f"captured in {captured}; replayed in {replayed};" in v and "[allowed]" not in v for v in values
        ), props


def test_real_graphs_give_findings_per_test(tmp_path, cuda):
    proc = run_pytest(tmp_path, {"test_graphs.py": GRAPHS}, "-q", "--repro-watch", "--junitxml", "junit.xml")
    out = out_of(proc)
    assert proc.returncode == 1 and "2 failed, 2 passed" in proc.stdout, out
    check_failures(proc)
    check_findings(out)
    check_junit(tmp_path / "junit.xml")


def test_real_graphs_in_warn_mode_pass_and_are_listed(tmp_path, cuda):
    proc = run_pytest(tmp_path, {"test_graphs.py": GRAPHS}, "-q", "--repro-watch=warn", "--junitxml", "junit.xml")
    out = out_of(proc)
    assert proc.returncode == 0 and "4 passed" in proc.stdout, out
    check_findings(out)
    check_junit(tmp_path / "junit.xml")


def test_real_graphs_under_xdist(tmp_path, cuda):
    pytest.importorskip("xdist")
    proc = run_pytest(tmp_path, {"test_graphs.py": GRAPHS}, "-q", "-n", "2", "--dist", "loadfile", "--repro-watch")
    out = out_of(proc)
    assert proc.returncode == 1 and "2 failed, 2 passed" in proc.stdout, out
    check_failures(proc)
    check_findings(out)


def test_example_suite_names_the_rebuilt_kernels_workspace(tmp_path, cuda):
    proc = run_pytest(tmp_path, {}, "-q", "--repro-watch", str(REPO / "examples" / "engine_ci"))
    out = out_of(proc)
    assert proc.returncode == 1 and "1 failed, 3 passed" in proc.stdout, out
    # Node ids are relative to the inner session's rootdir (this checkout: its pyproject);
    # pytest's short summary prints them relative to the working directory (the tmp dir).
    rebuilt = "examples/engine_ci/test_graphs.py::test_reload_rebuilds_the_kernel_under_a_graph"
    assert re.search(rf"^FAILED \S*{re.escape(rebuilt)}$", proc.stdout, re.M), out
    by_test = findings_by_test(out)
    assert list(by_test) == [rebuilt], out
    assert any("layer.kernel.workspace freed" in line for line in by_test[rebuilt]), out
    assert f"captured in: {rebuilt} (call)" in out and f"replayed in: {rebuilt} (call)" in out
    assert "dropped at:  " in out and "in process_weights_after_loading" in out
    assert graphs_checked(out) == 2, out
