"""The pytest plugin (repro.pytest) on CPU: inner pytest sessions in subprocesses.

No CUDA graph exists on CPU: the inner suites drive the hooks through the stand-in graph class
of tests/watch_programs/fake_graph.py (patched by the session's watcher), with real guard
recordings on CPU tensors. Real graphs: tests/test_pytest_plugin_gpu.py.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).resolve().parent / "watch_programs"

CONFTEST = f"""
import sys
import pytest
sys.path.insert(0, {str(PROGRAMS)!r})
import fake_graph


@pytest.fixture(scope="session", autouse=True)
def graphs_watched():
    # The stand-in graph class goes through the hooks when the session is watched.
    return fake_graph.patch_if_watched()
"""

STALE = """
import torch
import pytest
from fake_graph import FakeGraph, capture

X = torch.ones(2, 4)                      # the static input: alive for the session


def capture_routine(graph, x=X):
    weight = torch.randn(8, 4)            # held by this local only: freed on return
    with capture(graph):
        out = x @ weight.t()
    return out


@pytest.fixture(scope="module")
def captured():
    graph = FakeGraph()
    capture_routine(graph)
    return graph


def test_clean():
    weight = torch.ones(4, 4)
    graph = FakeGraph()
    with capture(graph):
        weight.sum()
    graph.replay()


def test_replays_stale(captured):
    captured.replay()
"""


def run_pytest(
    tmp_path: Path,
    files: dict[str, str],
    *args: str,
    ep: bool = False,
    env_extra: dict[str, str] | None = None,
    timeout: float = 240,
) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPRO_WATCH")}
    path = [str(REPO)]
    if ep:
        path.insert(0, str(fake_install(tmp_path)))
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["REPRO_WATCH_DIR"] = str(tmp_path / "records")  # not a switch: only where records go
    env.update(env_extra or {})
    plugin = [] if ep else ["-p", "repro.pytest"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *plugin, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def fake_install(tmp_path: Path) -> Path:
    """A dist-info declaring our pytest11 entry point, as `pip install` would write it (the
    machine's install of repro may predate the entry point)."""
    site = tmp_path / "_site"
    info = site / "repro_entry_point-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: repro-entry-point\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[pytest11]\nrepro = repro.pytest\n")
    return site


def out_of(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


SUMMARY_HEAD = re.compile(r"^=+ repro watch: (no findings|\d+ finding\(s\)) =+$", re.M)
NO_REPORT = "recorded, but in no test report"


def findings_by_test(out: str) -> dict[str, list[str]]:
    """The terminal summary's "repro watch" section: {test id: [its finding lines]}; findings
    no report carried are under NO_REPORT."""
    head = SUMMARY_HEAD.search(out)
    assert head is not None, out
    by_test: dict[str, list[str]] = {}
    current = None
    for line in out[head.end() :].splitlines()[1:]:
        if line.startswith("records: "):
            break
        if line.startswith("  ") and current is not None:
            by_test[current].append(line.strip())
        elif line.startswith(NO_REPORT):
            current = NO_REPORT
            by_test.setdefault(current, [])
        elif not re.match(r"(\d+|no) CUDA graph|hooks' own error", line):
            current = line
            by_test.setdefault(current, [])
    return by_test


def graphs_checked(out: str) -> int:
    found = re.search(r"^(\d+) CUDA graph\(s\) captured and checked", out, re.M)
    return int(found.group(1)) if found else 0


def junit_findings(path: Path) -> dict[str, list[str]]:
    """{test case name: its repro_watch_finding property values} of a --junitxml file."""
    return {
        c.get("name"): [p.get("value") for p in c.iter("property") if p.get("name") == "repro_watch_finding"]
        for c in ET.parse(path).iter("testcase")
    }


# -- off ------------------------------------------------------------------------------------------

OFF_CHECK = """
import sys

def test_nothing_heavy_imported(request):
    assert request.config.pluginmanager.get_plugin("repro") is not None
    heavy = [m for m in ("torch", "repro.diagnose.guard", "repro.pytest.watch", "repro.watch.hooks", "rich")
             if m in sys.modules]
    assert heavy == []
    # Of repro, the plugin module and the package's bare __init__ only.
    assert sorted(m for m in sys.modules if m == "repro" or m.startswith("repro.")) == ["repro", "repro.pytest"]
"""


def test_off_by_default_it_loads_from_the_entry_point_and_imports_nothing_heavy(tmp_path):
    proc = run_pytest(tmp_path, {"test_off.py": OFF_CHECK}, "-q", ep=True)
    assert proc.returncode == 0, out_of(proc)
    assert "repro watch" not in out_of(proc)


def test_p_no_repro_keeps_it_out(tmp_path):
    proc = run_pytest(tmp_path, {"test_off.py": OFF_CHECK}, "-q", "-p", "no:repro", ep=True)
    assert proc.returncode == 1 and "assert None is not None" in out_of(proc), out_of(proc)
    proc = run_pytest(tmp_path, {}, "-q", "-p", "no:repro", "--repro-watch", "test_off.py", ep=True)
    assert proc.returncode == 4 and "unrecognized arguments: --repro-watch" in out_of(proc)


def test_explicit_p_with_the_entry_point_installed_registers_once(tmp_path):
    proc = run_pytest(
        tmp_path,
        {"conftest.py": CONFTEST, "test_stale.py": STALE},
        "-q",
        "-p",
        "repro.pytest",
        "--repro-watch",
        ep=True,
    )
    assert proc.returncode == 1, out_of(proc)
    assert "1 failed, 1 passed" in proc.stdout


class Options:
    """The one thing watch_mode asks of a pytest.Config."""

    def __init__(self, repro_watch=None):
        self.repro_watch = repro_watch

    def getoption(self, name, default=None):
        return getattr(self, name, default)


@pytest.mark.parametrize(
    "option, env, mode",
    [
        (None, None, None),
        (None, "", None),
        (None, "0", None),
        (None, "1", "fail"),
        (None, "warn", "warn"),
        (None, " WARN ", "warn"),
        (None, "fail", "fail"),
        ("warn", "1", "warn"),
        ("fail", "warn", "fail"),
    ],
)
def test_watch_mode_from_the_option_else_the_environment(monkeypatch, option, env, mode):
    from repro.pytest import watch_mode

    if env is None:
        monkeypatch.delenv("REPRO_WATCH", raising=False)
    else:
        monkeypatch.setenv("REPRO_WATCH", env)
    assert watch_mode(Options(option)) == mode


def test_failure_text_of_a_census_finding_names_kernel_and_parameter():
    from repro.pytest.attribution import Phase, PhaseFinding
    from repro.diagnose.allocator import Block
    from repro.diagnose.captured import Reference
    from repro.diagnose.fates import Fate, census_finding
    from repro.outcome import to_jsonable
    from repro.pytest.watch import finding_text

    block = Block(start=0x7F0000001000, size=4096, state="inactive", pool=(0, 0), segment=0x7F0000000000)
    ref = Reference(
        node=3,
        kind="kernel",
        kernel="ampere_sgemm_128x64_nn",
        where="param 2 +8",
        offset=24,
        addr=0x7F0000001000,
        block=block,
    )
    finding = to_jsonable(
        census_finding(
            "#1 t.py:9 in capture", Fate(block, "freed", block, "allocator state"), [ref], "before replay", 0
        )
    )
    tf = PhaseFinding(
        id="h-1.jsonl:4",
        pid=1,
        mechanism="census",
        finding=finding,
        captured_in=Phase("t.py::a", "setup"),
        replayed_in=Phase("t.py::b", "call"),
    )
    text = finding_text(tf)
    assert "read by:     kernel ampere_sgemm_128x64_nn, param 2 +8\n" in text
    assert "captured in: t.py::a (setup)" in text and "replayed in: t.py::b (call)" in text
    memcpy = Reference(node=5, kind="memcpy", kernel="", where="src", offset=0, addr=block.start, block=block)
    tf.finding = to_jsonable(
        census_finding("#1", Fate(block, "freed", block, "allocator state"), [memcpy], "before replay", 0)
    )
    assert "read by:     node 5 src\n" in finding_text(tf)


def test_failure_text_shows_where_a_guard_finding_was_created_and_dropped():
    from repro.pytest.attribution import Phase, PhaseFinding
    from repro.pytest.watch import finding_text

    f = {
        "graph": "#1 g",
        "slot": "model.w",
        "status": "freed",
        "created_at": "m.py:3 in load (aten.randn)",
        "freed_at": "m.py:9 in reload (reassigned)",
        "message": "graph '#1 g' captured tensor model.w ...",
    }
    text = finding_text(
        PhaseFinding(
            id="x:1", pid=7, mechanism="guard", finding=f, captured_in=None, replayed_in=Phase("t.py::b", "call")
        )
    )
    assert text.splitlines() == [
        "repro watch: graph '#1 g': model.w freed (guard, pid 7)",
        "  captured in: not found in these records",
        "  replayed in: t.py::b (call)",
        "  created at:  m.py:3 in load (aten.randn)",
        "  dropped at:  m.py:9 in reload (reassigned)",
        "  graph '#1 g' captured tensor model.w ...",
    ]


# -- on: fail, warn, attribution, junit -----------------------------------------------------------


def test_fail_mode_fails_the_replaying_test_with_both_phases(tmp_path):
    proc = run_pytest(
        tmp_path, {"conftest.py": CONFTEST, "test_stale.py": STALE}, "-q", "--repro-watch", "--junitxml", "junit.xml"
    )
    out = out_of(proc)
    assert proc.returncode == 1, out
    assert "1 failed, 1 passed" in proc.stdout
    assert "FAILED test_stale.py::test_replays_stale" in proc.stdout
    # The failure text: tensor, graph, status, created at, both phases.
    assert "<local weight of capture_routine" in out and "freed" in out
    assert "captured in: test_stale.py::test_replays_stale (setup)" in out  # the module fixture
    assert "replayed in: test_stale.py::test_replays_stale (call)" in out
    assert "dropped at:  test_stale.py:" in out
    assert "repro watch: 1 finding(s)" in out and "2 CUDA graph(s) captured and checked" in out
    case = {c.get("name"): c for c in ET.parse(tmp_path / "junit.xml").iter("testcase")}
    stale = case["test_replays_stale"]
    assert stale.find("failure") is not None and "freed" in stale.find("failure").get("message")
    props = [p.get("value") for p in stale.iter("property") if p.get("name") == "repro_watch_finding"]
    assert len(props) == 1 and "<local weight of capture_routine" in props[0]
    assert case["test_clean"].find("failure") is None


def test_capture_in_one_test_replay_in_another(tmp_path):
    two = STALE.replace(
        "def test_replays_stale(captured):\n    captured.replay()",
        "def test_captures(captured):\n    pass\n\n\ndef test_replays_later(captured):\n    captured.replay()",
    )
    proc = run_pytest(tmp_path, {"conftest.py": CONFTEST, "test_two.py": two}, "-q", "--repro-watch")
    out = out_of(proc)
    assert "FAILED test_two.py::test_replays_later" in proc.stdout, out
    assert "captured in: test_two.py::test_captures (setup)" in out
    assert "replayed in: test_two.py::test_replays_later (call)" in out


CLASS_FIXTURE = """
import torch
import pytest
from fake_graph import FakeGraph, capture


def capture_routine(graph):
    weight = torch.randn(8, 4)            # held by this local only: freed on return
    with capture(graph):
        weight.sum()


class TestReplayAtTeardown:
    @pytest.fixture(scope="class")
    def graph(self):
        g = FakeGraph()
        capture_routine(g)
        yield g
        g.replay()                        # the class fixture's teardown replays the dead graph

    def test_first(self, graph):
        pass

    def test_second(self, graph):
        pass
"""


def test_class_fixture_captured_in_setup_replayed_in_teardown(tmp_path):
    proc = run_pytest(
        tmp_path,
        {"conftest.py": CONFTEST, "test_class.py": CLASS_FIXTURE},
        "-q",
        "--repro-watch",
        "--junitxml",
        "junit.xml",
    )
    out = out_of(proc)
    assert proc.returncode == 1, out
    assert "2 passed, 1 error" in proc.stdout, out
    assert "ERROR test_class.py::TestReplayAtTeardown::test_second" in proc.stdout
    assert "captured in: test_class.py::TestReplayAtTeardown::test_first (setup)" in out
    assert "replayed in: test_class.py::TestReplayAtTeardown::test_second (teardown)" in out
    case = {c.get("name"): c for c in ET.parse(tmp_path / "junit.xml").iter("testcase")}
    props = [p.get("value") for p in case["test_second"].iter("property") if p.get("name") == "repro_watch_finding"]
    assert len(props) == 1 and "(teardown)" in props[0]
    assert case["test_second"].find("error") is not None
    assert case["test_first"].find("error") is None and not list(case["test_first"].iter("property"))


def test_warn_mode_passes_and_lists_findings_per_test(tmp_path):
    proc = run_pytest(tmp_path, {"conftest.py": CONFTEST, "test_stale.py": STALE}, "-q", "--repro-watch=warn")
    out = out_of(proc)
    assert proc.returncode == 0, out
    assert "2 passed" in proc.stdout
    summary = out[out.index("repro watch: 1 finding(s)") :]
    assert summary.splitlines()[1].startswith("2 CUDA graph(s) captured and checked")
    assert summary.splitlines()[2] == "test_stale.py::test_replays_stale"
    assert "<local weight of capture_routine" in summary and "records: " in summary


def test_env_switch_turns_it_on_and_the_session_env_is_restored(tmp_path):
    conftest = CONFTEST + textwrap.dedent("""
        import os

        @pytest.hookimpl(trylast=True)
        def pytest_unconfigure(config):
            print("ENV-AFTER", os.environ.get("REPRO_WATCH_SITE"), os.environ.get("PYTHONPATH"), flush=True)
    """)
    check_env = """
        import os
        def test_env_for_children():
            assert os.environ["REPRO_WATCH"] == "1" and os.environ["REPRO_WATCH_DIR"]
            assert os.environ["PYTHONPATH"].split(os.pathsep)[0].endswith("_site")
    """
    proc = run_pytest(
        tmp_path, {"conftest.py": conftest, "test_env.py": check_env}, "-q", "-s", env_extra={"REPRO_WATCH": "1"}
    )
    out = out_of(proc)
    assert proc.returncode == 0, out
    assert f"ENV-AFTER None {REPO}\n" in out  # as before the session


def test_no_switch_no_watch(tmp_path):
    proc = run_pytest(tmp_path, {"conftest.py": CONFTEST, "test_stale.py": STALE}, "-q")
    assert proc.returncode == 0 and "2 passed" in proc.stdout, out_of(proc)
    assert "repro watch" not in out_of(proc)


# -- the marker -----------------------------------------------------------------------------------

MARKED = (
    STALE
    + """

@pytest.mark.repro_watch(off=True)
def test_off(captured):
    captured.replay()


@pytest.mark.repro_watch(expect="<local weight of capture_routine*")
def test_expected_found():
    g = FakeGraph()
    capture_routine(g)
    g.replay()


def test_skips_after_a_stale_replay():
    g = FakeGraph()
    capture_routine(g)
    g.replay()
    pytest.skip("a skip does not hide the replay")


@pytest.mark.repro_watch(expect="*workspace*")
def test_expected_missing():
    g = FakeGraph()
    kept = torch.ones(3)
    with capture(g):
        kept.sum()
    g.replay()
"""
)


def test_marker_off_and_expect(tmp_path):
    proc = run_pytest(
        tmp_path,
        {"conftest.py": CONFTEST, "test_marked.py": MARKED},
        "-q",
        "--repro-watch",
        "-k",
        "off or expected or skips",
    )
    out = out_of(proc)
    assert "2 failed, 2 passed" in proc.stdout, out
    assert "FAILED test_marked.py::test_expected_missing" in proc.stdout
    assert "FAILED test_marked.py::test_skips_after_a_stale_replay" in proc.stdout
    assert "expected a finding matching '*workspace*'" in out
    assert "[allowed by the repro_watch marker]" in out


# -- processes tests start, xdist, forked, timeout, shard -----------------------------------------

SUBPROCESS = f"""
import subprocess, sys

def test_runs_a_program():
    assert subprocess.call([sys.executable, {str(PROGRAMS / "stale_local.py")!r}]) == 0


def test_runs_a_program_through_a_shell():
    assert subprocess.call(f"{{sys.executable}} {str(PROGRAMS / "stale_local.py")!r} | cat", shell=True) == 0
"""


def test_a_subprocess_finding_is_the_starting_tests(tmp_path):
    for _ in range(2):  # the same records directory twice: each session its own findings
        proc = run_pytest(tmp_path, {"conftest.py": CONFTEST, "test_sub.py": SUBPROCESS}, "-q", "--repro-watch")
        out = out_of(proc)
        assert "2 failed" in proc.stdout, out
        for test in ("test_runs_a_program", "test_runs_a_program_through_a_shell"):
            assert f"FAILED test_sub.py::{test}" in proc.stdout
            assert f"captured in: test_sub.py::{test} (call)" in out
            assert f"replayed in: test_sub.py::{test} (call)" in out
        assert "<local weight of capture_routine" in out
        assert "repro watch: 2 finding(s)" in out and "in no test report" not in out
    assert len(list((tmp_path / "records").glob("*.jsonl"))) == 6


def test_xdist_workers_findings_merge_in_the_controller(tmp_path):
    pytest.importorskip("xdist")
    files = {"conftest.py": CONFTEST, "test_stale.py": STALE, "test_sub.py": SUBPROCESS}
    proc = run_pytest(tmp_path, files, "-q", "-n", "2", "--repro-watch", "--junitxml", "junit.xml")
    out = out_of(proc)
    assert proc.returncode == 1, out
    assert "3 failed, 1 passed" in proc.stdout, out
    assert "repro watch: 3 finding(s)" in out
    by_test = findings_by_test(out)
    assert sorted(by_test) == [
        "test_stale.py::test_replays_stale",
        "test_sub.py::test_runs_a_program",
        "test_sub.py::test_runs_a_program_through_a_shell",
    ]
    assert all(len(lines) == 1 and "<local weight of capture_routine> freed" in lines[0] for lines in by_test.values())
    assert graphs_checked(out) == 4  # 2 in the workers, 1 in each started program
    props = junit_findings(tmp_path / "junit.xml")
    assert {name: len(v) for name, v in props.items()} == {
        "test_clean": 0,
        "test_replays_stale": 1,
        "test_runs_a_program": 1,
        "test_runs_a_program_through_a_shell": 1,
    }


def test_forked_children_report_their_own_findings_once(tmp_path):
    pytest.importorskip("pytest_forked")
    files = {"conftest.py": CONFTEST, "test_stale.py": STALE}
    proc = run_pytest(tmp_path, files, "-q", "--forked", "--repro-watch")
    out = out_of(proc)
    assert "1 failed, 1 passed" in proc.stdout, out
    assert "replayed in: test_stale.py::test_replays_stale (call)" in out
    assert "repro watch: 1 finding(s)" in out and "2 CUDA graph(s) captured and checked" in out


HANG = """
import time
import torch
from fake_graph import FakeGraph, capture


class HangingGraph(FakeGraph):
    def replay(self):
        time.sleep(120)                    # a replay that never returns


def test_hangs_in_replay():
    from repro.watch import hooks as watch_hooks
    watch_hooks.active().patch(HangingGraph)
    g = HangingGraph()
    weight = torch.randn(4, 4)
    with capture(g):
        weight.sum()
    del weight
    g.replay()
"""


def test_a_hung_replay_killed_by_pytest_timeout_still_leaves_its_finding(tmp_path):
    pytest.importorskip("pytest_timeout")
    pytest.importorskip("xdist")
    files = {"conftest.py": CONFTEST, "test_hang.py": HANG}
    proc = run_pytest(tmp_path, files, "-q", "-n", "1", "--timeout", "5", "--timeout-method", "thread", "--repro-watch")
    out = out_of(proc)
    assert proc.returncode != 0, out
    (line,) = findings_by_test(out)[NO_REPORT]
    assert "replayed in test_hang.py::test_hangs_in_replay (call)" in line


def test_shards_each_report_their_own_tests(tmp_path):
    pytest.importorskip("pytest_shard")
    files = {"conftest.py": CONFTEST, "test_stale.py": STALE}
    outs = [
        run_pytest(tmp_path, files, "-q", "--shard-id", str(i), "--num-shards", "2", "--repro-watch") for i in range(2)
    ]
    failed = [o for o in outs if "FAILED test_stale.py::test_replays_stale" in o.stdout]
    assert len(failed) == 1, [out_of(o) for o in outs]
    assert "repro watch: 1 finding(s)" in out_of(failed[0])


# -- examples/engine_ci ---------------------------------------------------------------------------

EXAMPLES = REPO / "examples" / "engine_ci"

REBUILD = f"""
import sys
import torch
sys.path.insert(0, {str(EXAMPLES)!r})
from fake_graph import FakeGraph, capture
from engine_layer import Layer, new_weights


def capture_layer(layer, x):
    graph = FakeGraph()
    with capture(graph):
        out = layer(x)
    return graph, out


def reload_under_a_graph(reuse_kernel):
    layer = Layer(16, torch.device("cpu"), reuse_kernel=reuse_kernel)
    x = torch.randn(2, 16)                   # the static input: held while the graph replays
    graph, out = capture_layer(layer, x)
    graph.replay()
    layer.reload(new_weights(layer, seed=1))
    graph.replay()


def test_reload_rebuilds_the_kernel_under_a_graph():
    reload_under_a_graph(reuse_kernel=False)


def test_reused_kernel_is_clean():
    reload_under_a_graph(reuse_kernel=True)
"""


def test_example_layer_rebuilt_on_reload_is_named_by_path(tmp_path):
    """The example suite's graph test, driven on CPU through the stand-in graph class."""
    proc = run_pytest(tmp_path, {"conftest.py": CONFTEST, "test_rebuild.py": REBUILD}, "-q", "--repro-watch")
    out = out_of(proc)
    assert "1 failed, 1 passed" in proc.stdout, out
    assert "FAILED test_rebuild.py::test_reload_rebuilds_the_kernel_under_a_graph" in proc.stdout
    assert "layer.kernel.workspace freed" in out and "layer.kernel.scale freed" in out
    assert "dropped at:  engine_layer.py:" in out and "in process_weights_after_loading" in out


def test_example_suite_on_cpu_skips_graph_tests_and_says_why(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("with CUDA the graph tests run: tests/test_pytest_plugin_gpu.py")
    proc = run_pytest(tmp_path, {}, "-q", "-rs", "--repro-watch", "--junitxml", str(tmp_path / "j.xml"), str(EXAMPLES))
    out = out_of(proc)
    assert proc.returncode == 0, out
    assert "2 passed, 2 skipped" in proc.stdout
    assert out.count("needs CUDA: CUDA graphs exist only on a GPU") == 2
    props = [p.get("value") for p in ET.parse(tmp_path / "j.xml").iter("property") if p.get("name") == "repro_reload"]
    assert props == ["layer: 3 tensor slots, 0 changed"]  # the repro_stable fixture's census
    assert "repro watch: no findings" in out and "no CUDA graph was captured: nothing was checked" in out


STABLE_FIXTURE = f"""
import sys
import torch
sys.path.insert(0, {str(EXAMPLES)!r})
from engine_layer import Layer, new_weights


def test_kernel_reused(repro_stable):
    layer = Layer(16, torch.device("cpu"), reuse_kernel=True)
    with repro_stable(layer, name="layer"):
        layer.reload(new_weights(layer, seed=1))


def test_kernel_rebuilt(repro_stable):
    layer = Layer(16, torch.device("cpu"), reuse_kernel=False)
    with repro_stable(layer, name="layer"):
        layer.reload(new_weights(layer, seed=1))


def test_kernel_rebuilt_but_ignored(repro_stable):
    layer = Layer(16, torch.device("cpu"), reuse_kernel=False)
    with repro_stable(layer, name="layer", ignore=["layer.kernel.*"]):
        layer.reload(new_weights(layer, seed=1))
"""


def test_repro_stable_fixture_fails_an_unstable_reload_with_the_plugin_off(tmp_path):
    """The fixture is there whenever the plugin is loaded, --repro-watch or not."""
    proc = run_pytest(tmp_path, {"test_stable.py": STABLE_FIXTURE}, "-q", "--junitxml", "junit.xml", ep=True)
    out = out_of(proc)
    assert proc.returncode == 1, out
    assert "1 failed, 2 passed" in proc.stdout, out
    assert "FAILED test_stable.py::test_kernel_rebuilt" in proc.stdout
    assert "ReloadUnstable: 2 of 3 tensor slots under layer changed across the reload (2 freed)" in out
    assert "layer.kernel.workspace  freed" in out and "layer.kernel.scale  freed" in out
    assert "repro watch" not in out
    props = {
        c.get("name"): [p.get("value") for p in c.iter("property") if p.get("name") == "repro_reload"]
        for c in ET.parse(tmp_path / "junit.xml").iter("testcase")
    }
    assert props == {
        "test_kernel_reused": ["layer: 3 tensor slots, 0 changed"],
        "test_kernel_rebuilt": ["layer: 3 tensor slots, 2 changed"],
        "test_kernel_rebuilt_but_ignored": ["layer: 3 tensor slots, 0 changed"],
    }


# -- README: the CI snippets ----------------------------------------------------------------------


def readme_yaml_after(heading: str) -> dict:
    """The first ```yaml block after `heading` in the README's "In your engine's CI" section."""
    yaml = pytest.importorskip("yaml")
    text = (REPO / "README.md").read_text()
    section = text[text.index("## In your engine's CI") :]
    section = section[: section.index("\n## ", 1)]
    block = section[section.index(heading) :]
    block = block[block.index("```yaml\n") + len("```yaml\n") :]
    return yaml.safe_load(block[: block.index("```")])


def suite_at(tmp_path: Path, *dirs: str) -> None:
    """The stale-graph suite in each of the snippet's test directories."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for d in dirs:
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / f"test_{Path(d).name}.py").write_text(STALE)


def test_readme_buildkite_step_runs_as_written(tmp_path):
    """The pytest command of the Buildkite step, $$ as the agent passes it to the shell (one
    shard of one), on the stale-graph suite placed where the step's paths point."""
    for name in ("pytest_shard", "pytest_timeout"):
        pytest.importorskip(name)
    (step,) = readme_yaml_after("Buildkite")["steps"]
    assert step["env"]["PYTHONFAULTHANDLER"] == "1" and step["artifact_paths"] == ["artifacts/**/*"]
    command = shlex.split(
        step["commands"][1].replace("$$BUILDKITE_PARALLEL_JOB_COUNT", "1").replace("$$BUILDKITE_PARALLEL_JOB", "0")
    )
    assert command[0] == "pytest" and "--repro-watch" in command
    paths = [a for a in command if a.startswith("tests/")]
    suite_at(tmp_path, *paths)
    proc = run_pytest(tmp_path, {}, *command[1:])
    out = out_of(proc)
    assert proc.returncode == 1, out
    assert "2 failed, 2 passed" in proc.stdout, out
    assert "repro watch: 2 finding(s)" in out
    assert list((tmp_path / "artifacts" / "repro-watch").glob("*.jsonl"))
    junit = ET.parse(tmp_path / "artifacts" / "junit-0.xml")
    assert len([p for p in junit.iter("property") if p.get("name") == "repro_watch_finding"]) == 2


def test_readme_github_actions_job_runs_as_written(tmp_path):
    """The job's pytest command for one suite of its matrix, with two xdist workers instead of
    four (this machine's cores)."""
    pytest.importorskip("xdist")
    job = readme_yaml_after("GitHub Actions")["jobs"]["gpu-tests"]
    assert "self-hosted" in job["runs-on"] and "gpu" in job["runs-on"]
    upload = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["if"] == "failure()" and upload["with"]["path"].split() == ["junit.xml", "repro-watch/"]
    (run,) = [s["run"] for s in job["steps"] if "pytest" in s.get("run", "")]
    suite = job["strategy"]["matrix"]["suite"][0]
    command = shlex.split(run.replace("${{ matrix.suite }}", suite))
    assert command[:3] == ["python", "-m", "pytest"] and command[command.index("-n") + 1] == "4"
    command[command.index("-n") + 1] = "2"
    suite_at(tmp_path, suite)
    proc = run_pytest(tmp_path, {}, *command[3:])
    out = out_of(proc)
    assert proc.returncode == 1 and "1 failed, 1 passed" in proc.stdout, out
    assert list((tmp_path / "repro-watch").glob("*.jsonl"))
    junit = ET.parse(tmp_path / "junit.xml")
    assert len([p for p in junit.iter("property") if p.get("name") == "repro_watch_finding"]) == 1


@pytest.mark.parametrize(
    "args, env, stacks",
    [
        (["--repro-watch", "--repro-watch-stacks"], {}, "1"),
        ([], {"REPRO_WATCH": "1", "REPRO_WATCH_STACKS": "1"}, "1"),
        (["--repro-watch"], {}, "0"),
    ],
)
def test_stacks_option_or_env_reaches_the_hooks_and_the_processes_tests_start(tmp_path, args, env, stacks):
    check = f"""
        import os
        import subprocess
        import sys

        from repro.watch.hooks import active


        def test_stacks_setting():
            assert active().settings.stacks is {stacks == "1"}
            assert os.environ["REPRO_WATCH_STACKS"] == {stacks!r}
            code = "from repro.watch.hooks import active; print(active().settings.stacks)"
            child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            assert child.stdout == "{stacks == "1"}\\n"  # the child's own hooks, from the environment
    """
    proc = run_pytest(tmp_path, {"test_stacks.py": check}, "-q", *args, env_extra=env)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, out_of(proc)
