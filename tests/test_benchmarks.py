"""benchmarks/ is not run by CI (it needs GPUs and minutes), so at least every script must import:
a renamed or moved harness name breaks it here, not on the next GPU session."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "common.py")


@pytest.fixture
def benchmarks_on_path(monkeypatch):
    # The scripts import their siblings (common, replay) as top-level modules, as `python
    # benchmarks/x.py` would; keep those out of sys.modules afterwards.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if getattr(sys.modules[name], "__file__", "") and str(BENCHMARKS) in sys.modules[name].__file__:
            del sys.modules[name]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_imports_and_has_main(script, benchmarks_on_path):
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # runs the imports, not main(): __name__ is not __main__
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"


def test_census_host_benchmark_runs_on_the_cpu_at_a_small_size(benchmarks_on_path, tmp_path, capsys):
    """The one benchmark that needs no GPU runs here for real, small: reading stand-in kernel
    nodes and checking every graph against one trace."""
    import json

    spec = importlib.util.spec_from_file_location("benchmark_census_host", BENCHMARKS / "census_host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "census.json"
    assert module.main(["--graphs", "3", "--nodes", "12", "--trace", "200", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["kernel_nodes"] == 36 and doc["pending_words"] == 36  # one weight word per node
    # 3 pointers + a 512-byte struct + two int32: 68 aligned words a node, all counted
    assert doc["words"] == 36 * 68 and doc["check_together_s"] >= 0


def test_engine_step_alternates_the_replay_functions_and_restores_the_hook(benchmarks_on_path, monkeypatch):
    """The in-process step measure: each variant's rounds time that variant's replay (a fake
    clock that the hooked replay moves by 3 units a batch row and the bare one by 2 gives
    exactly 1.5x; steps of different sizes are averaged per size, so size 4's step counts as
    much as size 1's), the host part is what step() took before its synchronize, and the class
    keeps the hooked replay afterwards."""
    import types

    spec = importlib.util.spec_from_file_location("benchmark_engine_step", BENCHMARKS / "engine_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    clock = [0.0]
    monkeypatch.setattr(module.time, "perf_counter", lambda: clock[0])
    calls = {"hooked": 0, "bare": 0}

    def make(name, cost):
        def replay(b):
            calls[name] += 1
            clock[0] += cost * b

        return replay

    def synchronize():
        clock[0] += 1e-6  # the GPU's tail: in the step, not in its host part

    hooked, bare = make("hooked", 3e-6), make("bare", 2e-6)
    graph_class = type("CUDAGraph", (), {"replay": hooked})
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(CUDAGraph=graph_class, synchronize=synchronize))
    step = lambda b: torch.cuda.CUDAGraph.replay(b)  # noqa: E731
    out = module.measure(torch, step, [1, 2, 4], 4, hooked, bare)
    # synced steps + one pipelined pass per round; the pass-through variant calls bare too
    assert calls == {"hooked": 4 * 3 * 2, "bare": 2 * 4 * 3 * 2}
    bare_host, bare_step = round(14 / 3, 2), round(17 / 3, 2)
    assert out["host_us"] == {"hooked": 7.0, "bare": bare_host, "ratio": 1.5, "thin": bare_host}  # 3 * mean(1, 2, 4)
    assert out["step_us"] == {"hooked": 8.0, "bare": bare_step, "ratio": round(8 / (17 / 3), 4), "thin": bare_step}
    assert out["pipelined_us"]["hooked"] == round((21 + 1) / 3, 2)
    assert graph_class.replay is hooked


def test_engine_step_pairs_rounds_per_size_before_averaging(benchmarks_on_path):
    """One slow round of one size moves that size's median not at all (a median of 3 rounds)."""
    spec = importlib.util.spec_from_file_location("benchmark_engine_step", BENCHMARKS / "engine_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rounds = [[1e-6, 10e-6], [1e-6, 10e-6], [50e-6, 10e-6]]  # rounds x sizes, seconds
    assert module.per_size_mean(rounds) == pytest.approx(5.5)


def test_fingerprint_benchmark_runs_on_the_cpu_at_a_small_size(benchmarks_on_path, tmp_path, capsys):
    """The contents fingerprint's costs, CPU-runnable: every input fingerprinted, a sampled row
    above FULL_BYTES (times are not asserted)."""
    import json

    spec = importlib.util.spec_from_file_location("benchmark_fingerprint", BENCHMARKS / "fingerprint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "fingerprint.json"
    assert (
        module.main(
            ["--device", "cpu", "--counts", "3", "--sizes", "4096", str(2 << 20), "--repeats", "1", "--json", str(out)]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["count"], r["size_bytes"], r["sampled"], r["fingerprinted"]) for r in rows] == [
        (3, 4096, False, 3),
        (3, 2 << 20, True, 3),
    ]


def test_watch_overhead_wrapper_part_times_settled_graphs_on_the_cpu(benchmarks_on_path):
    """The replay wrapper's own cost runs on a stand-in graph class here: every graph of the
    chain is settled (its replays take the fast path), and both variants were timed."""
    spec = importlib.util.spec_from_file_location("benchmark_watch_overhead", BENCHMARKS / "watch_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = module.part_wrapper(chain=5, rounds=2, calls=50)
    assert doc["device"] == "cpu" and doc["settled_graphs"] == 5 and doc["calls_per_round"] == 50
    assert doc["class_replay"] == "torch's own"  # every graph settled: the wrappers stand aside
    assert set(doc["ns_per_replay"]) == {"hooked", "bare"} and all(v > 0 for v in doc["ns_per_replay"].values())


def test_engine_capture_table_shows_the_in_process_step_with_its_host_part_and_memory(benchmarks_on_path):
    """The markdown table of benchmarks/engine_capture.py: the in-process row carries the
    synced ratio, the host part, the A/A floor and the memory the rounds added."""
    spec = importlib.util.spec_from_file_location("benchmark_engine_capture", BENCHMARKS / "engine_capture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    one = {"plain": 1.0, "watch": 1.2, "ratio": 1.2}
    step = {
        "step_us": {"hooked": 101.0, "bare": 100.0, "ratio": 1.01},
        "pipelined_us": {"hooked": 90.0, "bare": 90.0, "ratio": 1.0},
    }
    row = {
        "shape": "piecewise",
        "graphs": 66,
        "capture_s": one,
        "first_round_s": one,
        "step_us": {"plain": 100.0, "watch": 101.0, "ratio": 1.01},
        "findings": [0],
        "watch_kib_per_graph": 17.0,
        "step_in_process": {
            "watch": {
                **step,
                "step_us": {**step["step_us"], "wrapper_ratio": 1.02},
                "class_replay": "torch's own",
                "host_us": {"hooked": 12.0, "bare": 10.0, "ratio": 1.2},
                "rss_grown_kib": 8,
                "replays_per_variant": 1320,
            },
            "plain_aa": {**step, "rss_grown_kib": 4},
        },
    }
    lines = module.table([row, {**row, "host_us": {"plain": 90.0, "watch": 99.0, "ratio": 1.1}}]).splitlines()
    assert lines[2].startswith(
        "| piecewise | 66 | 1.00 / 1.20 s (1.20x) | 1.00 / 1.20 s (1.20x) | 100 / 101 (1.010x) |"
    )
    assert "100 / 101 (1.010x; host 90 / 99) |" in lines[3]  # whether a slower step is the host's
    assert lines[-1] == (
        "| piecewise (torch's own) | 101 / 100 (1.0100x) | 12.0 / 10.0 (1.200x) | 90 / 90 (1.0000x) | 1.0200x | "
        "synced 1.0100x, pipelined 1.0000x | 8 / 4 over 1320 replays |"
    )


def test_engine_capture_summary_keeps_each_pairs_ratio_and_the_fastest_of_each_side(benchmarks_on_path):
    """The host runs one capture at two speeds from process to process: the summary keeps each
    alternated pair's ratio and the ratio of each side's fastest, and the table shows them."""
    spec = importlib.util.spec_from_file_location("benchmark_engine_capture", BENCHMARKS / "engine_capture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plain = [{"graphs": 67, "capture_s": s} for s in (4.0, 6.0, 4.2)]
    watched = [{"capture_s": s, "findings": 0} for s in (6.0, 6.6, 9.0)]
    row = module.summarize("full", plain, watched)
    assert row["capture_s"] == {"plain": 4.2, "watch": 6.6, "ratio": pytest.approx(6.6 / 4.2)}
    assert row["capture_pair_ratios"] == [1.5, 1.1, round(9.0 / 4.2, 3)]
    assert row["capture_min_ratio"] == 1.5
    line = module.table([{**row, "first_round_s": row["capture_s"], "step_us": row["capture_s"]}]).splitlines()[2]
    assert "4.20 / 6.60 s (1.57x; pairs 1.10-2.14x, fastest 1.50x)" in line


def test_engine_capture_writes_each_part_as_it_ends(benchmarks_on_path, tmp_path, monkeypatch):
    """A time limit that ends the run during the in-process step keeps the capture pairs already
    measured on disk, and a step-only row (--repeats 0) renders without a capture line."""
    spec = importlib.util.spec_from_file_location("benchmark_engine_capture", BENCHMARKS / "engine_capture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    runs = iter([2.0, 3.0, 2.2, 3.1])
    monkeypatch.setattr(
        module,
        "run_once",
        lambda args, shape, watched, out, tag: {"graphs": 67, "capture_s": next(runs), "findings": 0},
    )

    def cut(*_):
        raise TimeoutError("the session's limit")

    monkeypatch.setattr(module, "step_once", cut)
    with pytest.raises(TimeoutError):
        module.main(["--cases", "full", "--repeats", "2", "--step-rounds", "3", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "engine_capture.json").read_text())
    assert doc["rows"][0]["capture_pair_ratios"] == [1.5, round(3.1 / 2.2, 3)]
    assert "2.10 / 3.05 s" in (tmp_path / "table.md").read_text()

    step = {
        "step_us": {"hooked": 101.0, "bare": 100.0, "ratio": 1.01},
        "pipelined_us": {"hooked": 9.0, "bare": 9.0, "ratio": 1.0},
    }
    lines = module.table([{"shape": "full", "step_in_process": {"watch": step, "plain_aa": step}}]).splitlines()
    assert len(lines) == 6 and lines[-1].startswith("| full (?) | 101 / 100 (1.0100x) |")


def test_allocator_costs_says_on_the_cpu_that_its_stack_part_needs_a_gpu(benchmarks_on_path, capsys):
    """The --stacks cost (allocations with and without their stacks) is measured on a GPU only:
    here the script says so in one line and exits 3."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("measures for real on a GPU")
    spec = importlib.util.spec_from_file_location("benchmark_allocator_costs", BENCHMARKS / "allocator_costs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--part", "stacks"]) == 3
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("allocator_costs: needs a CUDA GPU") and "run it on a GPU machine" in line
    assert module.CONTEXTS == ("off", None, "state", "alloc")  # the two watch records, and none
