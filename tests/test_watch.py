"""`repro watch -- CMD`: CLI contract, injection into every Python process, vLLM entry point,
torchrun. On CPU no CUDA graph exists: tests that need a finding route a stand-in graph class
(tests/watch_programs/fake_graph.py) through the hooks and are named *_plumbing; they show
the hooks are installed and check before replay, not that a real capture is read right."""

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
import types
from pathlib import Path

import pytest

from conftest import REPO, group_alive, watch_argv

PROGRAMS = REPO / "tests" / "watch_programs"


def env_with_repo(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPRO_WATCH")}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def run(args, cwd=None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        args,
        capture_output=True,
        env=kwargs.pop("env", env_with_repo()),
        cwd=cwd or REPO,
        timeout=kwargs.pop("timeout", 180),
        **kwargs,
    )


def watch(tmp_path, *cmd, options=()) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "report.json"
    proc = run(watch_argv(tmp_path / "run", *cmd, report=out, options=options))
    return proc, (json.loads(out.read_text()) if out.exists() else {})


# -- CLI contract -------------------------------------------------------------------------------


def test_stdout_is_passed_through_byte_exact_and_exit_code_kept(tmp_path):
    code = (
        "import sys; sys.stdout.buffer.write(b'raw \\x00\\xff bytes\\nno newline'); "
        "sys.stderr.write('err line\\n'); sys.exit(7)"
    )
    plain = run([sys.executable, "-c", code])
    watched, rep = watch(tmp_path, sys.executable, "-c", code)
    assert plain.returncode == 7 and watched.returncode == 7
    assert watched.stdout == plain.stdout == b"raw \x00\xff bytes\nno newline"
    assert b"err line" in watched.stderr
    assert rep["schema"] == "repro.watch/1" and rep["command_exit"] == 7 and rep["exit"] == 7
    assert [p["torch_hooked"] for p in rep["processes"]] == [False]  # never imported torch
    assert rep["findings"] == []


def test_torch_is_not_imported_by_the_hooks(tmp_path):
    code = "import sys; print('torch' in sys.modules)"
    watched, rep = watch(tmp_path, sys.executable, "-c", code)
    assert watched.stdout == b"False\n"
    assert len(rep["processes"]) == 1 and rep["processes"][0]["exited"]


def test_program_sees_its_own_sys_path_and_shadowed_sitecustomize_runs(tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITE_RAN'] = '1'\n")
    code = "import os, sys; print(os.environ.get('OWN_SITE_RAN'), [p for p in sys.path if '_site' in p])"
    env = env_with_repo()
    env["PYTHONPATH"] = str(own) + os.pathsep + env["PYTHONPATH"]
    plain = run([sys.executable, "-c", code], env=env)
    out = tmp_path / "r.json"
    watched = run(
        watch_argv(tmp_path / "run", sys.executable, "-c", code, report=out),
        env=env,
    )
    assert plain.stdout == watched.stdout == b"1 []\n"
    assert json.loads(out.read_text())["processes"][0]["origins"] == ["sitecustomize"]


def test_usage_errors_exit_2_with_one_line(tmp_path):
    cases = [
        [],
        ["--on-finding", "loud", "--", "true"],
        ["--record", "everything", "--", "true"],
        ["--", "no-such-command-xyz"],
    ]
    for args in cases:
        proc = run([sys.executable, "-m", "repro", "watch", "--run-dir", str(tmp_path / "u"), *args])
        assert proc.returncode == 2, args
        lines = proc.stderr.decode().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("repro: error:"), proc.stderr
    used = tmp_path / "used"
    used.mkdir()
    (used / "vm-1.jsonl").write_text("{}\n")
    proc = run(watch_argv(used, "true"))
    assert proc.returncode == 2 and b"already holds records" in proc.stderr


def test_record_choice_reaches_every_process_and_a_bad_one_falls_back(tmp_path, capsys):
    from repro.watch import command as watch_mod
    from repro.watch import settings as watch_settings

    env = watch_mod.watch_env({}, tmp_path, "warn", "ops")
    assert env[watch_settings.ENV_RECORD] == "ops"
    assert watch_settings.ENV_RECORD not in watch_mod.watch_env({}, tmp_path, "warn")
    assert watch_settings.settings_from_env(env, "api").record == "ops"
    assert watch_settings.settings_from_env({watch_settings.ENV_ON: "1"}, "api").record == "graph"
    bad = watch_settings.settings_from_env({watch_settings.ENV_ON: "1", watch_settings.ENV_RECORD: "all"}, "api")
    assert bad.record == "graph" and "REPRO_WATCH_RECORD='all' is not one of graph, ops" in capsys.readouterr().err


def test_finding_exits_1_json_names_the_tensor_plumbing(tmp_path):
    plain = run([sys.executable, str(PROGRAMS / "stale_local.py")])
    watched, rep = watch(tmp_path, sys.executable, str(PROGRAMS / "stale_local.py"))
    assert plain.returncode == 0 and b"watched=False" in plain.stderr
    assert watched.stdout == plain.stdout  # the program printed the same
    assert watched.returncode == 1 and rep["command_exit"] == 0 and rep["exit"] == 1
    (f,) = rep["findings"]
    assert f["mechanism"] == "guard" and f["finding"]["status"] == "freed"
    assert "local weight of capture_routine" in f["finding"]["slot"]
    assert f["finding"]["freed_at"].startswith("stale_local.py:")
    assert f["finding"]["when"].startswith("first replay after capture")
    (p,) = rep["processes"]
    assert p["pid"] == f["pid"] and p["findings"] == 1 and p["graphs"] == 1
    # Three replays: the first reports, the second tests the graph's live storages and settles
    # it, the third is torch's own (the wrappers stand aside): the count says "at least".
    assert p["replays"] == 2 and p["replays_all_counted"] is False
    assert p["census"].startswith("unavailable: CUDA is not available")  # never claimed on CPU
    records = (tmp_path / "run").glob("*.jsonl")
    assert sum(1 for line in next(records).read_text().splitlines() if '"finding"' in line) == 1


def test_raise_mode_raises_stale_capture_error_before_the_replay_plumbing(tmp_path):
    watched, rep = watch(tmp_path, sys.executable, str(PROGRAMS / "stale_local.py"), options=("--on-finding", "raise"))
    err = watched.stderr.decode()
    assert "StaleCaptureError" in err and "local weight of capture_routine" in err
    assert b"replays 3" not in watched.stdout  # the first replay never ran
    assert watched.returncode == 1 and rep["command_exit"] == 1
    assert len(rep["findings"]) == 1 and rep["processes"][0]["exited"]


def test_junit_and_html_are_written_plumbing(tmp_path):
    junit, html = tmp_path / "w.xml", tmp_path / "w.html"
    watched, _ = watch(
        tmp_path, sys.executable, str(PROGRAMS / "stale_local.py"), options=("--junit", str(junit), "--html", str(html))
    )
    assert watched.returncode == 1
    assert "<failure" in junit.read_text() and "capture_routine" in junit.read_text()
    assert "FREED" in html.read_text()


def test_json_to_stdout_follows_the_program_output(tmp_path):
    proc = run(watch_argv(tmp_path / "run", sys.executable, "-c", "print('first')", report="-"))
    head, _, rest = proc.stdout.decode().partition("\n")
    assert head == "first" and json.loads(rest)["schema"] == "repro.watch/1"


# -- injection ----------------------------------------------------------------------------------


def test_children_grandchildren_and_spawn_workers_are_watched_plumbing(tmp_path):
    plain = run([sys.executable, str(PROGRAMS / "clean_children.py"), "top", "4"])
    watched, rep = watch(tmp_path, sys.executable, str(PROGRAMS / "clean_children.py"), "top", "4")
    assert plain.returncode == 4 and watched.returncode == 4  # clean: CMD's own exit code
    assert watched.stdout == plain.stdout
    procs = rep["processes"]
    roles = sorted(
        p["argv"][-1] if p["argv"][-1] in ("child", "grandchild") else "top" if "top" in p["argv"] else "spawn"
        for p in procs
    )
    assert roles.count("top") == 1 and roles.count("child") == 1 and roles.count("grandchild") == 1
    assert roles.count("spawn") >= 1  # spawn worker (and its resource tracker)
    by_pid = {p["pid"]: p for p in procs}
    grandchild = next(p for p in procs if p["argv"][-1] == "grandchild")
    child = by_pid[grandchild["ppid"]]
    assert child["argv"][-1] == "child" and by_pid[child["ppid"]]["argv"][-1] == "4"
    graphs = {p["argv"][-1]: p["graphs"] for p in procs if p["graphs"]}
    assert len(graphs) == 4 and all(n == 1 for n in graphs.values())  # top, child, grandchild, worker
    assert rep["findings"] == [] and all(p["exited"] for p in procs)


def test_torchrun_two_ranks_one_record_file_each_plumbing(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(PROGRAMS / "dist_ranks.py"),
    ]
    watched, rep = watch(tmp_path, *cmd)
    assert b"rank 0 of 2: sum 1" in watched.stdout and b"rank 1 of 2: sum 1" in watched.stdout
    ranks = [p for p in rep["processes"] if p["graphs"]]
    assert sorted(p["rank"] for p in ranks) == [0, 1]
    assert sorted(p["env"]["RANK"] for p in ranks) == ["0", "1"]
    files = {Path(p["record_file"]).name for p in ranks}
    assert len(files) == 2  # one record file per rank
    assert sorted(f["rank"] for f in rep["findings"]) == [0, 1]
    assert watched.returncode == 1


def test_merge_of_two_run_directories(tmp_path):
    for node in ("a", "b"):
        proc = run(watch_argv(tmp_path / node, sys.executable, str(PROGRAMS / "stale_local.py")))
        assert proc.returncode == 1
    out = tmp_path / "merged.json"
    merged = run(
        [sys.executable, "-m", "repro", "watch-report", str(tmp_path / "a"), str(tmp_path / "b"), "--json", str(out)]
    )
    rep = json.loads(out.read_text())
    assert merged.returncode == 1 and len(rep["processes"]) == 2 and len(rep["findings"]) == 2
    assert run([sys.executable, "-m", "repro", "watch-report", str(tmp_path / "none")]).returncode == 2


def test_ctrl_c_is_forwarded_to_the_group_and_reported(tmp_path):
    code = (
        "import signal, sys, time, subprocess\n"
        "try:\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "    print('ready', child.pid, flush=True)\n"
        "    time.sleep(60)\n"
        "except KeyboardInterrupt:\n    child.wait(); sys.exit(5)\n"
    )
    out = tmp_path / "r.json"
    proc = subprocess.Popen(
        watch_argv(tmp_path / "run", sys.executable, "-c", code, report=out),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env_with_repo(),
        cwd=REPO,
    )
    line = proc.stdout.readline().decode().split()
    assert line[0] == "ready"
    grandchild = int(line[1])
    pgid = os.getpgid(grandchild)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    rep = json.loads(out.read_text())
    assert rep["interrupted"] and rep["command_exit"] == 5
    deadline = time.monotonic() + 10
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(pgid)


# -- vLLM entry point ---------------------------------------------------------------------------


def install_entry_points(site: Path) -> None:
    """Write the entry points pyproject declares into a dist-info, as an installer would."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    dist = site / "repro_watch_ep_test-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: repro-watch-ep-test\nVersion: 0.0\n")
    lines = []
    for group, eps in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in eps.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")


VLLM_LOADER = """
import os, sys
from importlib.metadata import entry_points
if sys.argv[1] == "torch-first":
    import torch
allowed = os.environ.get("VLLM_PLUGINS")
plugins = {ep.name: ep.load() for ep in entry_points(group="vllm.general_plugins")
           if allowed is None or ep.name in allowed.split(",")}
for _ in range(2):                       # vLLM may load the plugins more than once per process
    for func in plugins.values():
        func()
import torch
from repro.watch import hooks as watch_hooks
w = watch_hooks.active()
wrapped = hasattr(torch.cuda.CUDAGraph.replay, "__wrapped__")
print(sorted(plugins), w is not None, wrapped, [str(o) for o in w.origins] if w else None)
"""


@pytest.mark.parametrize("order", ["plugin-first", "torch-first"])
def test_vllm_plugin_entry_point_activates_only_with_repro_watch(tmp_path, order):
    site = tmp_path / "site"
    install_entry_points(site)
    base = env_with_repo()
    base["PYTHONPATH"] = str(site) + os.pathsep + base["PYTHONPATH"]
    off = run([sys.executable, "-c", VLLM_LOADER, order], env=base, cwd=tmp_path)
    assert off.stdout == b"['repro_watch'] False False None\n", off.stderr
    assert not (tmp_path / "repro-watch").exists()
    runs = tmp_path / "runs"
    on = run(
        [sys.executable, "-c", VLLM_LOADER, order],
        env={**base, "REPRO_WATCH": "1", "REPRO_WATCH_DIR": str(runs)},
        cwd=tmp_path,
    )
    assert on.stdout == b"['repro_watch'] True True ['vllm-plugin']\n", on.stderr
    (record,) = runs.glob("*.jsonl")
    kinds = [json.loads(line)["kind"] for line in record.read_text().splitlines()]
    assert kinds.count("process") == 1 and kinds.count("hooked") == 1
    blocked = run(
        [sys.executable, "-c", VLLM_LOADER, order],
        env={**base, "REPRO_WATCH": "1", "REPRO_WATCH_DIR": str(runs), "VLLM_PLUGINS": "other"},
        cwd=tmp_path,
    )
    assert blocked.stdout == b"[] False False None\n"


def test_vllm_plugin_under_repro_watch_is_idempotent_with_sitecustomize(tmp_path):
    site = tmp_path / "site"
    install_entry_points(site)
    env = env_with_repo()
    env["PYTHONPATH"] = str(site) + os.pathsep + env["PYTHONPATH"]
    out = tmp_path / "r.json"
    proc = run(
        watch_argv(tmp_path / "run", sys.executable, "-c", VLLM_LOADER, "plugin-first", report=out),
        env=env,
        cwd=tmp_path,
    )
    assert proc.stdout == b"['repro_watch'] True True ['sitecustomize', 'vllm-plugin']\n", proc.stderr
    (p,) = json.loads(out.read_text())["processes"]
    assert p["origins"] == ["sitecustomize", "vllm-plugin"]


# -- in-process hooks ---------------------------------------------------------------------------


def test_reset_marks_other_graphs_for_a_deep_check_plumbing(tmp_path, monkeypatch):
    import torch
    from repro.watch import hooks as watch_hooks

    sys.path.insert(0, str(PROGRAMS))
    try:
        from fake_graph import FakeGraph, capture
    finally:
        sys.path.remove(str(PROGRAMS))

    class Graph(FakeGraph):  # a class of its own: patching must not leak into other tests
        pass

    watcher = watch_hooks.Watcher(watch_hooks.WatchSettings(str(tmp_path), "warn", "api"))
    watcher.log.recorder = watch_hooks.Recorder(str(tmp_path))
    watcher.patch(Graph)
    a, b = Graph(), Graph()
    kept = torch.ones(3)
    with capture(a):
        kept.sum()
    with capture(b):
        kept.sum()
    a.replay(), b.replay()
    assert watcher.log.counters.checks_deep == 2
    b.reset()
    a.replay()
    assert watcher.log.counters.checks_deep == 3 and watcher.log.counters.replays == 3
    assert watcher.log.counters.findings == 0
    watcher.log.recorder.close()


def test_graphs_captured_by_cudagraph_trees_are_counted_not_checked():
    from repro.watch.hooks.capture import capture_site

    code = compile(
        "def f(get):\n    return get()\n", os.path.join("x", "torch", "_inductor", "cudagraph_trees.py"), "exec"
    )
    namespace: dict = {}
    exec(code, namespace)
    site, managed = namespace["f"](lambda: capture_site(sys._getframe(1)))
    assert managed and site.startswith("cudagraph_trees.py:")
    assert capture_site(sys._getframe(0))[1] is False


def test_finding_records_survive_a_hard_crash_plumbing(tmp_path):
    code = (
        "import os, sys; sys.path.insert(0, %r)\n"
        "import stale_local, torch\n"
        "stale_local.main([])\n"
        "os.kill(os.getpid(), 9)\n"
    ) % str(PROGRAMS)
    watched, rep = watch(tmp_path, sys.executable, "-c", code)
    assert watched.returncode == 1 and rep["command_exit"] == 128 + 9
    assert len(rep["findings"]) == 1 and rep["processes"][0]["exited"] is False


def fake_graph_module() -> types.ModuleType:
    """tests/watch_programs/fake_graph: the stand-ins (graph classes, a census book)."""
    sys.path.insert(0, str(PROGRAMS))
    try:
        import fake_graph
    finally:
        sys.path.remove(str(PROGRAMS))
    return fake_graph


def fake_graph_class():
    """(a fresh subclass of tests/watch_programs/fake_graph.FakeGraph, its capture helper): each
    test patches its own class."""
    sys.path.insert(0, str(PROGRAMS))
    try:
        from fake_graph import FakeGraph, capture
    finally:
        sys.path.remove(str(PROGRAMS))
    return type("Graph", (FakeGraph,), {}), capture


def test_fast_path_catches_a_free_between_replays_plumbing(tmp_path):
    import torch
    from repro.watch import hooks as watch_hooks

    Graph, capture = fake_graph_class()

    class Engine:
        def __init__(self):
            self.cache = torch.zeros(4, 4)

        def capture(self, graph):
            with capture(graph):
                self.cache.add_(1)

    watcher = watch_hooks.Watcher(watch_hooks.WatchSettings(str(tmp_path), "raise", "api"))
    watcher.log.recorder = watch_hooks.Recorder(str(tmp_path))
    watcher.patch(Graph)
    engine, graph = Engine(), Graph()
    engine.capture(graph)
    for _ in range(3):
        graph.replay()  # deep once, then the fast path
    assert watcher.log.counters.findings == 0 and watcher.graphs[graph].live is not None
    engine.cache = torch.zeros(8, 4)  # rebinding frees the captured cache
    from repro.diagnose.guard import StaleCaptureError

    with pytest.raises(StaleCaptureError) as err:
        graph.replay()
    (finding,) = err.value.findings
    assert finding.slot == "Engine.cache" and finding.status == "freed" and finding.when == "before replay"
    assert finding.new_ptr == engine.cache.data_ptr()  # the owner's name points elsewhere now
    lines = [json.loads(line) for line in Path(watcher.log.recorder.path).read_text().splitlines()]
    assert [r["finding"]["slot"] for r in lines if r["kind"] == "finding"] == ["Engine.cache"]
    graph.replay()  # reported once, not at every replay
    assert watcher.log.counters.findings == 1
    watcher.log.recorder.close()


def test_fast_path_tests_storages_only_after_a_captured_storage_died_plumbing(tmp_path):
    """While no captured storage dies, a replay tests none of them (one count compared); the
    first replay after any death (here another graph's storage) tests the graph's own once."""
    import torch
    from repro.watch import hooks as watch_hooks

    Graph, capture = fake_graph_class()

    class Engine:
        def __init__(self):
            self.cache, self.other = torch.zeros(4, 4), torch.zeros(4)

    watcher = watch_hooks.Watcher(watch_hooks.WatchSettings(str(tmp_path), "warn", "api"))
    watcher.log.recorder = watch_hooks.Recorder(str(tmp_path))
    watcher.patch(Graph)
    engine, graph, other = Engine(), Graph(), Graph()
    with capture(graph):
        engine.cache.add_(1)
    with capture(other):
        engine.other.add_(1)
    graph.replay()
    other.replay()  # deep checks: live handles noted
    tested = []
    real = watcher.tools.expired
    watcher.tools.expired = lambda h: tested.append(h) or real(h)
    for _ in range(3):
        graph.replay()
    assert len(tested) == 1  # once: live is new since the deep check
    for _ in range(3):
        graph.replay()
    assert len(tested) == 1 and watcher.log.counters.replays == 8
    engine.other = torch.zeros(4)  # other's storage dies
    assert watcher.tools.guard.drops.n == 1
    graph.replay()
    graph.replay()
    assert len(tested) == 2 and watcher.log.counters.findings == 0
    watcher.log.recorder.close()


def test_a_settled_graph_replays_past_the_checking_path_until_something_asks_for_a_check_plumbing(tmp_path):
    """The wrapper's fast path: once a graph is checked and its storages seen alive, a replay
    does not enter before_replay; a death anywhere, or another graph's reset, sends it back."""
    import torch
    from repro.watch import hooks as watch_hooks

    Graph, capture = fake_graph_class()
    cache, other_cache = torch.zeros(4), torch.zeros(4)
    watcher = watch_hooks.Watcher(watch_hooks.WatchSettings(str(tmp_path), "warn", "api"))
    watcher.log.recorder = watch_hooks.Recorder(str(tmp_path))
    watcher.patch(Graph)
    graph, other = Graph(), Graph()
    with capture(graph):
        cache.add_(1)
    with capture(other):
        other_cache.add_(1)
    entered = []
    real = watcher.checks.before_replay
    watcher.checks.before_replay = lambda g: entered.append(g) or real(g)
    for _ in range(4):
        graph.replay()
    assert entered == [graph, graph]  # the deep check, then the storages tested once
    assert watcher.graphs[graph].fast_at == watcher.tools.drops.n and watcher.log.counters.replays == 4
    other.reset()
    graph.replay()
    assert entered[-1] is graph and watcher.log.counters.checks_deep == 2  # deep again after the reset
    graph.replay()
    graph.replay()
    assert len(entered) == 4  # tested once more, then settled again
    watcher.log.recorder.close()


def test_a_replay_that_takes_arguments_gets_them_and_is_still_checked_plumbing(tmp_path):
    import torch
    from repro.watch import hooks as watch_hooks
    from repro.watch.hooks.patch import takes_only_self
    from repro.diagnose.guard import StaleCaptureError

    Graph, capture = fake_graph_class()
    seen = []
    Graph = type("StreamGraph", (Graph,), {"replay": lambda self, stream=None: seen.append(stream)})
    watcher = watch_hooks.Watcher(watch_hooks.WatchSettings(str(tmp_path), "raise", "api"))
    watcher.log.recorder = watch_hooks.Recorder(str(tmp_path))
    watcher.patch(Graph)
    assert not takes_only_self(Graph.replay.__wrapped__)
    holder = {"cache": torch.zeros(4)}
    graph = Graph()
    with capture(graph):
        holder["cache"].add_(1)
    graph.replay(stream="s1")
    graph.replay()
    assert seen == ["s1", None]
    del holder["cache"]
    with pytest.raises(StaleCaptureError):
        graph.replay(stream="s2")
    assert seen == ["s1", None]  # raise mode: the stale replay never ran
    watcher.log.recorder.close()


def test_takes_only_self_is_torchs_replay_signature():
    from repro.watch.hooks.patch import takes_only_self

    class G:
        def replay(self):
            pass

        def posonly(self, /):
            pass

        def more(self, stream=None):
            pass

        def star(self, *args):
            pass

        def kw(self, *, stream=None):
            pass

        def keywords(self, **kw):
            pass

    assert takes_only_self(G.replay) and takes_only_self(G.posonly)
    assert not any(map(takes_only_self, (G.more, G.star, G.kw, G.keywords, len, print)))


def test_examples_run_as_is_and_under_watch_on_cpu(tmp_path):
    """Without CUDA each example says so and exits 0; watched, nothing changes and nothing is found."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the GPU behaviour is checked by benchmarks/watch_checks.sh")
    names = ["watch_kv_cache.py", "watch_weight_sync.py", "watch_triton_freed.py", "watch_compiled_clean.py"]
    script = "; ".join(f"{sys.executable} examples/{n} || exit 9" for n in names)
    plain = run(["sh", "-c", script])
    watched, rep = watch(tmp_path, "sh", "-c", script)
    assert plain.returncode == 0 and watched.returncode == 0, watched.stderr
    assert watched.stdout == plain.stdout and plain.stdout.count(b"no CUDA device") == 4
    assert len(rep["processes"]) == 4 and all(p["torch_hooked"] for p in rep["processes"])
    assert rep["findings"] == []


def test_census_runs_at_capture_end_and_deep_checks_only_plumbing(tmp_path, monkeypatch):
    """With a census available: graphs are made with keep_graph=True and instantiated at the end
    of capture_end (where torch would have), a census is added per capture, and checked at the
    first replay after a capture or a reset, never on the per-replay path. The census here is a
    recording stand-in (no CUDA on CPU); the real one is exercised by the GPU runs."""
    import torch
    from repro.watch import hooks as watch_hooks
    from repro.watch.hooks import tools as hooks_tools
    from repro.outcome import Finding

    class Graph:
        # As torch's CUDAGraph: keep_graph reaches the graph through __init__ (pybind), and a
        # __new__ that takes it too but does not use it.
        def __new__(cls, keep_graph=False):
            return super().__new__(cls)

        def __init__(self, keep_graph=False):
            self.keep_graph, self.instantiated = keep_graph, 0

        def capture_begin(self, *a, **k):
            pass

        def capture_end(self):
            pass

        def instantiate(self):
            self.instantiated += 1

        def replay(self):
            pass

        def reset(self):
            pass

    calls = []

    class Book:
        def __init__(self, rank, trace):
            calls.append(("book", trace))
            self.censuses = {}

        def add(self, graph, label, pool=None, since=None, after_read=None):
            calls.append(("add", label, graph.instantiated, since))
            census = types.SimpleNamespace(pending=[], references=[], seconds=0.002, sort_seconds=0.0005, words=64)
            if after_read is not None:  # only for a graph the watch instantiates (a)
                after_read(census)  # a small graph: instantiated inline, after the census
            calls.append(("read", label, graph.instantiated))
            self.censuses[label] = census
            return census

        def check_graphs(self, when, labels):
            calls.append(("check", tuple(labels), when))
            return [
                Finding(
                    slot="<block 0x10 read by k+8>",
                    graph=labels[0],
                    status="reused",
                    when=when,
                    rank=0,
                    shape=[],
                    dtype="",
                    nbytes=64,
                    old_ptr=0x10,
                    mechanism="census",
                )
            ]

        def census_line(self):
            return "graph census: stand-in"

        def hand_over(self, census, left):
            calls.append(("hand_over", len(census.pending), len(left)))

        def pause_trace(self):
            calls.append(("pause",))
            return True

        def resume_trace(self):
            calls.append(("resume",))

    def merge_findings(guard, census, slots, guard_on, book):
        return guard + census

    from repro.diagnose.census import Tracing

    fake = type(sys)("fake_census")
    fake.census_supported, fake.Tracing = (lambda: (True, "")), Tracing
    fake.CensusBook, fake.merge_findings = Book, merge_findings
    marks = iter(range(100))
    fake.clock_marker = lambda: {"time_us": next(marks)}
    monkeypatch.setattr(hooks_tools, "load_census", lambda: fake)
    watcher = watch_hooks.Watcher(watch_hooks.WatchSettings(str(tmp_path), "warn", "api"))
    watcher.log.recorder = watch_hooks.Recorder(str(tmp_path))
    watcher.patch(Graph)
    a, b = Graph(), Graph(keep_graph=True)
    assert a.keep_graph and b.keep_graph  # forced where the program did not ask
    kept = torch.ones(2)
    for g in (a, b):
        g.capture_begin()
        kept.add_(1)
        g.capture_end()
    assert a.instantiated == 1 and b.instantiated == 0  # b's owner asked for keep_graph itself
    label_a, label_b = watcher.graphs[a].label, watcher.graphs[b].label
    # Each census reads the trace from its capture's start; nothing was recorded at the
    # dispatcher (the census makes the slots: here it read none).
    assert [c for c in calls if c[0] == "add"] == [
        ("add", label_a, 0, {"time_us": 0}),
        ("add", label_b, 0, {"time_us": 1}),
    ]
    assert [c for c in calls if c[0] == "read"] == [("read", label_a, 0), ("read", label_b, 0)]
    assert watcher.tools.guard.slots == [] and watcher.tools.guard.index_builds == 0
    assert [c for c in calls if c[0] == "hand_over"] == [("hand_over", 0, 0)] * 2
    assert watcher.log.counters.internal_errors == 0
    # The census's own split of its time: each census's read and sort, and the naming after it.
    seconds = watcher.log.seconds
    assert seconds.census_read == pytest.approx(2 * 0.0015) and seconds.census_sort == pytest.approx(2 * 0.0005)
    assert 0 < seconds.census_names <= seconds.census
    for _ in range(3):
        a.replay()
    checks = [c for c in calls if c[0] == "check"]
    # One census check for every graph captured since the last one, at the first replay after them.
    assert checks == [("check", (label_a, label_b), "first replay after capture")]
    b.reset()  # b's census goes; a is due again
    assert label_b not in watcher.tools.census.book.censuses
    a.replay()
    assert [c[1] for c in calls if c[0] == "check"] == [(label_a, label_b), (label_a,)]
    a.replay()  # nothing new: no census check
    assert len([c for c in calls if c[0] == "check"]) == 2
    assert watcher.log.counters.findings == 2
    # The trace rests after each census check and resumes when a capture begins.
    assert [c[0] for c in calls if c[0] in ("pause", "resume")][:3] == ["resume", "resume", "pause"]
    lines = [json.loads(line) for line in Path(watcher.log.recorder.path).read_text().splitlines()]
    assert {r["mechanism"] for r in lines if r["kind"] == "finding"} == {"census"}
    watcher.on_exit()
    assert json.loads(Path(watcher.log.recorder.path).read_text().splitlines()[-1])["census"].startswith("active")
    watcher.log.recorder.close()


@pytest.mark.parametrize("path", ["guard", "census"])
def test_capturing_function_locals_die_at_its_return_plumbing(path):
    """The hooks import their modules at the program's first graph; nothing of that may keep a
    frame alive (a frame in a reference cycle pins every frame below it through f_back: the
    capturing function's locals would outlive its return until the cyclic GC ran, and a buffer
    the program frees there would not be freed while watched). The program turns the GC off
    first, so no collection can hide it; "census" also goes through the census path (forced
    keep_graph, census at capture end) with a stand-in census."""
    proc = run([sys.executable, str(PROGRAMS / "local_freed_on_return.py"), path])
    assert proc.returncode == 0, proc.stderr
    # Both paths make the local's slot (the recording from the op, the census path from the
    # captured word), named after the local, and neither keeps it alive.
    assert proc.stdout.decode().split() == [
        "alive=False",
        "frames=0",
        f"kept={path == 'census'}",
        "slots=<local_dst_of_capture>,<local_src_of_capture>",
        "internal=0",
    ], proc.stderr


# -- everyday edges -------------------------------------------------------------------------------


def test_default_run_folders_are_unique_and_created_at_once(tmp_path, monkeypatch):
    """Runs started in the same second (a script, CI jobs, xdist workers) never share a folder."""
    from concurrent.futures import ThreadPoolExecutor
    from repro.watch import command as watch_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with ThreadPoolExecutor(8) as pool:
        dirs = list(pool.map(lambda _: watch_mod.default_run_dir(), range(24)))
    assert len(set(dirs)) == 24 and all(d.is_dir() and not any(d.iterdir()) for d in dirs)
    assert all(d.parent == tmp_path / "repro" / "runs" and d.name.startswith("watch-") for d in dirs)


def test_three_watch_runs_in_a_row_all_succeed(tmp_path):
    env = env_with_repo(XDG_CACHE_HOME=str(tmp_path))
    codes = [
        run([sys.executable, "-m", "repro", "watch", "--", sys.executable, "-c", "pass"], env=env) for _ in range(3)
    ]
    assert [c.returncode for c in codes] == [0, 0, 0], [c.stderr for c in codes]
    assert len(list((tmp_path / "repro" / "runs").glob("watch-*"))) == 3


def test_watch_report_refuses_what_is_not_a_watch_run(tmp_path):
    trial = tmp_path / "run" / "00-selftest"
    trial.mkdir(parents=True)
    (trial / "spec.json").write_text("{}")
    (trial / "rank0.jsonl").write_text('{"event": "start", "rank": 0, "pid": 1, "t": 0}\n')
    for target, needle in [
        (tmp_path / "run", "a trial run's folder"),
        (trial, "not a repro watch run"),
        (tmp_path / "absent", "does not exist"),
        (tmp_path / "run" / "00-selftest" / "spec.json", "not a directory"),
    ]:
        proc = run([sys.executable, "-m", "repro", "watch-report", str(target)])
        lines = proc.stderr.decode().strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr


def test_watch_says_plainly_when_nothing_could_be_checked(tmp_path):
    """A program that captures no CUDA graph (every program on a machine without a GPU): the
    report must not read as a clean bill of health."""
    watched, rep = watch(tmp_path, sys.executable, "-c", "import torch; print(torch.ones(2).sum().item())")
    assert watched.returncode == 0 and rep["findings"] == []
    notes = " ".join(rep["notes"])
    assert "Nothing checked: no CUDA graph was captured in the 1 watched process(es) (1 imported torch)" in notes
    assert "CUDA graph captures and their replays only" in notes
    import torch

    if not torch.cuda.is_available():
        assert "this machine has no GPU" in notes
    assert "Nothing checked" in watched.stderr.decode()


def test_sight_notes_stay_quiet_once_a_graph_was_checked():
    from repro.watch.command import sight_notes
    from repro.watch.records import WatchedProcess, WatchReport

    seen = WatchReport(processes=[WatchedProcess(pid=1, host="h", torch_hooked=True, graphs=2)], findings=[])
    assert sight_notes(seen, gpu_count=0) == []
    blind = WatchReport(processes=[WatchedProcess(pid=1, host="h", torch_hooked=True)], findings=[])
    assert "this machine has no GPU" in sight_notes(blind, gpu_count=0)[0]
    assert "this machine has no GPU" not in sight_notes(blind, gpu_count=2)[0]


def test_a_record_holding_text_that_was_not_utf8_is_still_written(tmp_path):
    """An argv byte that was not UTF-8 reaches Python as a surrogate escape; the record of that
    process must still be written (it was lost: strict UTF-8 encoding raised)."""
    from repro.watch import hooks as watch_hooks

    recorder = watch_hooks.Recorder(str(tmp_path))
    recorder.write({"kind": "process", "argv": ["prog", "caf\udce9"]})
    recorder.close()
    [line] = Path(recorder.path).read_text(encoding="ascii").splitlines()
    assert json.loads(line)["argv"] == ["prog", "caf\udce9"]


def test_an_object_reached_under_two_names_is_watched_once_per_name_not_per_capture(tmp_path):
    """A runner's `self.model` and its caller's `model` are one module under two names. Each
    capture used to re-watch the name the previous capture replaced, which threw the owner
    index away every time: in the piecewise engine, 2,211 captures built it 2,211 times."""
    import types as _types
    import torch
    from repro.watch import hooks as watch_hooks
    from repro.watch.hooks.tools import plumbing_files
    from repro.diagnose.guard import CaptureGuard

    watcher = watch_hooks.Watcher(watch_hooks.WatchSettings(str(tmp_path), "warn", "api"))
    watcher.tools.guard = CaptureGuard("warn", plumbing=plumbing_files())

    class Runner:
        def __init__(self, model):
            self.model = model

        def capture(self):
            watcher.captures.owners.watch(watcher.tools.guard, sys._getframe())
            return watcher.tools.guard.adopt(
                "g",
                [
                    _types.SimpleNamespace(
                        addr=self.model.weight.data_ptr(), describe=lambda: "node 0 kernel k param 0 +0"
                    )
                ],
            )

    model = torch.nn.Linear(4, 4)
    runner = Runner(model)
    for _ in range(5):
        assert runner.capture() == []
    assert watcher.tools.guard.index_builds == 1
    assert {o.name for o in watcher.tools.guard._owners} >= {"Runner", "Runner.model", "model"}
    assert watcher.tools.guard.slots[0].name in ("Runner.model.weight", "model.weight")


# -- --stacks: where census-mode findings' tensors were created ----------------------------------


def test_stacks_setting_from_the_environment_and_into_every_process(tmp_path):
    from repro.watch import command as watch_mod
    from repro.watch import settings as watch_settings

    on = {watch_settings.ENV_ON: "1"}
    assert watch_settings.ENV_STACKS in watch_settings.ENV_VARS  # saved and restored by the pytest plugin
    assert watch_settings.settings_from_env(on, "api").stacks is False
    for value, stacks in (("1", True), (" 1 ", True), ("yes", True), ("0", False), ("", False)):
        env = {**on, watch_settings.ENV_STACKS: value}
        assert watch_settings.settings_from_env(env, "api").stacks is stacks, value
    assert watch_mod.watch_env({}, tmp_path, "warn", stacks=True)[watch_settings.ENV_STACKS] == "1"
    assert (
        watch_mod.watch_env({watch_settings.ENV_STACKS: "1"}, tmp_path, "warn", stacks=False)["REPRO_WATCH_STACKS"]
        == "0"
    )
    outer = {watch_settings.ENV_STACKS: "1"}  # None: the environment's own setting stays
    assert watch_mod.watch_env(outer, tmp_path, "warn")[watch_settings.ENV_STACKS] == "1"
    assert watch_settings.ENV_STACKS not in watch_mod.watch_env({}, tmp_path, "warn")


def test_stacks_flag_of_the_cli_reaches_the_command_environment(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from repro.cli import app
    from repro.watch import command as watch_mod

    envs = []
    monkeypatch.setattr(
        watch_mod, "run_command", lambda command, env: envs.append(env) or watch_mod.CommandResult(0, False)
    )
    runner = CliRunner()
    for options, expected in ((["--stacks"], "1"), ([], "0")):
        result = runner.invoke(app, ["watch", "--run-dir", str(tmp_path / expected), *options, "--", "true"])
        assert result.exit_code == 0, (result.stdout, result.stderr)
        assert envs[-1]["REPRO_WATCH_STACKS"] == expected
    assert "--stacks" in runner.invoke(app, ["watch", "--help"]).stdout


def test_stacks_start_at_cuda_initialisation_and_never_break_it_plumbing(monkeypatch):
    import torch

    from repro.diagnose import allocator
    from repro.watch import hooks as watch_hooks

    queued, started = [], []
    monkeypatch.setattr(torch.cuda, "_lazy_call", queued.append)
    monkeypatch.setattr(allocator, "start_trace", lambda *a, **kw: started.append(kw))
    plain = watch_hooks.Watcher(watch_hooks.WatchSettings("unused", "warn", "api"))
    assert plain.settings.stacks is False and plain.tools.allocation_sites() is None  # nothing new runs
    watcher = watch_hooks.Watcher(watch_hooks.WatchSettings("unused", "warn", "api", stacks=True))
    watcher.wait_for_cuda()  # torch.cuda is imported here: queued at once
    assert queued == [watcher.tools.start_stacks] and started == []
    queued[0]()  # what torch's lazy init runs
    assert started == [{"stacks": True}] and watcher.log.counters.internal_errors == 0

    def broken(*a, **kw):
        raise RuntimeError("no allocator")

    monkeypatch.setattr(allocator, "start_trace", broken)
    watcher.tools.start_stacks()  # inside torch's lazy init: said, never raised
    assert watcher.log.counters.internal_errors == 1


def test_stacks_hook_queues_the_start_when_the_program_imports_torch(tmp_path):
    """Under `repro watch --stacks` the start is queued for CUDA's initialisation as the
    program's own `import torch` finishes torch.cuda; without --stacks nothing is queued."""
    code = "import torch; print([getattr(c, '__name__', '') for c, _ in torch.cuda._queued_calls])"
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    watched, rep = watch(tmp_path / "on", sys.executable, "-c", code, options=("--stacks",))
    assert watched.returncode == 0, watched.stderr
    assert "start_stacks" in watched.stdout.decode()
    (record,) = (tmp_path / "on" / "run").glob("*.jsonl")
    assert json.loads(record.read_text().splitlines()[0])["stacks"] is True
    plain, _ = watch(tmp_path / "off", sys.executable, "-c", code)
    assert plain.returncode == 0 and "start_stacks" not in plain.stdout.decode()


def test_stacks_name_where_a_census_slot_was_created_plumbing(tmp_path, monkeypatch):
    """A census-mode capture (stand-in census: its one word is in the capturing function's
    local) makes the local's slot, and --stacks fills its created_at from the frames the
    allocator recorded for that block (stand-in snapshot), read once, at capture end."""
    import torch

    from repro.diagnose import allocator
    from repro.watch import hooks as watch_hooks
    from repro.watch.hooks import tools as hooks_tools

    Graph = type("Graph", (fake_graph_module().KeptGraph,), {})

    held = {}

    class Book(fake_graph_module().StandInBook):
        def __init__(self, rank, trace):
            super().__init__(rank, trace)
            held["trace"] = trace

        def add(self, graph, label, pool=None, since=None, after_read=None):
            ptr = held["weight"].data_ptr()
            word = types.SimpleNamespace(addr=ptr, describe=lambda: "node 0 kernel k param 1 +0")
            return types.SimpleNamespace(pending=[word], references=[], seconds=0.0, sort_seconds=0.0)

    from repro.diagnose.census import Tracing

    fake = type(sys)("fake_census")
    fake.census_supported, fake.Tracing, fake.CensusBook = (lambda: (True, "")), Tracing, Book
    fake.clock_marker = lambda: {"time_us": 0}
    fake.merge_findings = lambda guard, census, slots, guard_on, book: guard + census
    monkeypatch.setattr(hooks_tools, "load_census", lambda: fake)
    reads = []

    class Stacks:  # the allocator's segments, as start_trace(stacks=True) leaves them
        def frames_at(self, addr):
            reads.append(addr)
            made = {"filename": "/srv/app/engine.py", "line": 41, "name": "load_weights"}
            torch_frame = {"filename": torch.__file__, "line": 1, "name": "randn"}
            return [torch_frame, made] if addr == held["weight"].data_ptr() else []

    monkeypatch.setattr(allocator, "AllocationStacks", Stacks)
    watcher = watch_hooks.Watcher(watch_hooks.WatchSettings(str(tmp_path), "warn", "api", stacks=True))
    watcher.log.recorder = watch_hooks.Recorder(str(tmp_path))
    watcher.patch(Graph)

    def capture(graph):
        weight = torch.ones(4)  # held by this local only: freed on return
        held["weight"] = weight
        graph.capture_begin()
        graph.capture_end()

    graph = Graph()
    capture(graph)
    assert held["trace"] == Tracing.STACKS
    (slot,) = watcher.tools.guard.slots
    assert slot.name == "<local weight of capture>" and slot.created_at == "engine.py:41 in load_weights"
    assert len(reads) == 1 and watcher.log.counters.internal_errors == 0
    del held["weight"]
    graph.replay()
    lines = [json.loads(line) for line in Path(watcher.log.recorder.path).read_text().splitlines()]
    (finding,) = [r["finding"] for r in lines if r["kind"] == "finding"]
    assert finding["status"] == "freed" and finding["created_at"] == "engine.py:41 in load_weights"
    assert finding["freed_at"].startswith("test_watch.py:")
    assert watcher.log.counters.internal_errors == 0
    watcher.log.recorder.close()
