"""What `repro watch` costs a program: replay time of a decode-like graph, per-replay check cost
against the number of captured storages, and interpreter start-up.

    PYTHONPATH=. python3 benchmarks/watch_overhead.py [--json OUT] [--parts decode,storages,wrapper,startup]

decode    a 24-layer graph (2 bf16 GEMMs + GELU per layer, batch 8, hidden 2048) replayed
          1000 times x 5 rounds, in a plain process and in one started under the watch
          environment (the same sitecustomize `repro watch` uses); GPU only.
wrapper   what the hooked CUDAGraph.replay adds per call on settled graphs (nothing died since
          their check): a chain of 33 graphs (one piecewise step), hooked vs the function it
          wraps, rounds alternating; on CPU a stand-in graph class (the wrapper alone).
storages  the hook's own per-replay work (the liveness check `before_replay` runs) on a graph
          that captured N distinct storages, N = 10 .. 3000: timed directly, 20000 calls. On
          GPU a real capture; on CPU a stand-in graph class (the hooks' plumbing; the check
          itself is the same code and touches no device).
startup   `python -c "import torch"` plain vs watched, 7 interleaved runs each, medians.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DECODE_LAYERS, DECODE_HIDDEN, DECODE_BATCH = 24, 2048, 8
REPLAYS, ROUNDS = 1000, 5
STORAGE_COUNTS = (10, 100, 300, 1000, 3000)
WRAPPER_CHAIN = 33  # one piecewise decode step of examples/engine_shapes.py: 32 layers + 1
CHECK_CALLS = 20000


def watched_env(run_dir: str) -> dict:
    sys.path.insert(0, str(REPO))
    from pathlib import Path as _P
    from repro.watch.command import watch_env

    env = watch_env(dict(os.environ), _P(run_dir), "warn")
    env["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + str(REPO)
    return env


def plain_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPRO_WATCH")}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# -- decode (inner process) ---------------------------------------------------------------------


def inner_decode() -> dict:
    import torch

    torch.set_grad_enabled(False)
    layers = (
        torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(DECODE_HIDDEN, DECODE_HIDDEN, bias=False),
                torch.nn.GELU(),
                torch.nn.Linear(DECODE_HIDDEN, DECODE_HIDDEN, bias=False),
            )
            for _ in range(DECODE_LAYERS)
        )
        .cuda()
        .to(torch.bfloat16)
    )
    x = torch.randn(DECODE_BATCH, DECODE_HIDDEN, device="cuda", dtype=torch.bfloat16)

    def step(h):
        for layer in layers:
            h = h + layer(h)
        return h

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(x)
    for _ in range(50):
        graph.replay()
    rounds = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / REPLAYS * 1e6)
    from repro.watch import hooks as watch_hooks

    watcher = watch_hooks.active()
    return {
        "us_per_replay_rounds": rounds,
        "us_per_replay": statistics.median(rounds),
        "watched": watcher is not None,
        "captured_storages": len(watcher.tools.guard.slots) if watcher and watcher.tools.guard else None,
        "replays_seen_by_hooks": watcher.log.counters.replays if watcher else None,
    }


def part_decode() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "needs CUDA"}
    out = {}
    with tempfile.TemporaryDirectory() as run_dir:
        for name, env in (("plain", plain_env()), ("watched", watched_env(run_dir))):
            proc = subprocess.run(
                [sys.executable, __file__, "--inner-decode"], env=env, capture_output=True, text=True, check=True
            )
            out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    plain, watched = out["plain"]["us_per_replay"], out["watched"]["us_per_replay"]
    out["overhead_pct"] = (watched - plain) / plain * 100
    out["shape"] = f"{DECODE_LAYERS} layers, hidden {DECODE_HIDDEN}, batch {DECODE_BATCH}, bf16"
    return out


# -- per-replay check cost vs captured storages ---------------------------------------------------


def watched_graph_class(run_dir: str):
    """(a Watcher of this process, a graph class it hooks): torch.cuda.CUDAGraph's subclass on
    GPU, a stand-in whose methods do nothing on CPU (`replay(self)`, torch's signature)."""
    import torch

    sys.path.insert(0, str(REPO))
    from repro.watch import hooks as watch_hooks
    from repro.watch.hooks.patch import HOOKED

    watcher = watch_hooks.Watcher(watch_hooks.WatchSettings(run_dir, "warn", "api"))
    watcher.log.recorder = watch_hooks.Recorder(run_dir)
    if torch.cuda.is_available():
        graph_cls = type("TimedGraph", (torch.cuda.CUDAGraph,), {})
    else:

        def nothing(self):
            pass

        graph_cls = type("TimedGraph", (), {m: nothing for m in HOOKED})
    watcher.patch(graph_cls)
    return watcher, graph_cls


def captured(graph_cls, reads: list, acc):
    """One graph that adds every tensor of `reads` into `acc`, replayed once (the deep check)."""
    import torch

    graph = graph_cls()
    if acc.is_cuda:
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for t in reads:
                acc.add_(t)
    else:
        graph.capture_begin()
        for t in reads:
            acc.add_(t)
        graph.capture_end()
    graph.replay()
    return graph


def part_storages() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    rows = []
    with tempfile.TemporaryDirectory() as run_dir:
        for n in STORAGE_COUNTS:
            watcher, graph_cls = watched_graph_class(run_dir)
            tensors = [torch.ones(16, device=device) for _ in range(n)]  # alive while timed
            acc = torch.zeros(16, device=device)
            graph = captured(graph_cls, tensors, acc)
            slots = sum(1 for s in watcher.tools.guard.slots if watcher.graphs[graph].label in s.graphs)
            t0 = time.perf_counter()
            for _ in range(CHECK_CALLS):
                watcher.checks.before_replay(graph)
            per_call = (time.perf_counter() - t0) / CHECK_CALLS * 1e6
            rows.append({"captured_storages": slots, "us_per_replay_check": per_call})
            watcher.log.recorder.close()
    return {"device": "cuda" if cuda else "cpu (stand-in graph class)", "rows": rows}


# -- the replay wrapper's own cost -----------------------------------------------------------------


def part_wrapper(chain: int = WRAPPER_CHAIN, rounds: int = 15, calls: int = 20000) -> dict:
    """What watch's replay wrapper adds per call on settled graphs (checked, nothing died): a
    chain of `chain` graphs (one piecewise decode step's replays) replayed in turn, rounds
    alternating the wrapper and the function it wraps; medians of rounds, ns per call. With
    every graph settled the wrappers stand aside (the class's replay is torch's own again:
    `class_replay`), so this is what a replay costs through a bound wrapper saved before, or
    while some other graph is held. On CPU the graph does nothing, so this is the wrapper
    alone; on GPU it adds to a real replay's host time (synchronized once per round)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as run_dir:
        watcher, graph_cls = watched_graph_class(run_dir)
        bufs = [torch.zeros(64, device=device) for _ in range(chain + 1)]
        graphs = [captured(graph_cls, [bufs[i]], bufs[i + 1]) for i in range(chain)]
        for g in graphs:
            g.replay()  # settles each graph
        hooked = watcher.replay_wrappers[graph_cls]
        variants = {"hooked": hooked, "bare": hooked.__wrapped__}
        class_replay = "torch's own" if graph_cls.replay is hooked.__wrapped__ else "watch's wrapper"
        per_call = {name: [] for name in variants}
        laps = max(1, calls // chain)
        for r in range(rounds):
            for name in variants if r % 2 == 0 else reversed(list(variants)):
                fn = variants[name]
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(laps):
                    for g in graphs:
                        fn(g)
                if device == "cuda":
                    torch.cuda.synchronize()
                per_call[name].append((time.perf_counter() - t0) / (laps * chain) * 1e9)
        settled = sum(watcher.graphs[g].fast_at == watcher.tools.drops.n for g in graphs)
        watcher.log.recorder.close()
    med = {name: statistics.median(v) for name, v in per_call.items()}
    return {
        "device": device,
        "chain": chain,
        "rounds": rounds,
        "calls_per_round": laps * chain,
        "settled_graphs": settled,
        "class_replay": class_replay,
        "ns_per_replay": med,
        "added_ns": med["hooked"] - med["bare"],
    }


# -- start-up ------------------------------------------------------------------------------------


def part_startup(runs: int = 7) -> dict:
    code = "import torch"
    times = {"plain": [], "watched": []}
    with tempfile.TemporaryDirectory() as run_dir:
        envs = {"plain": plain_env(), "watched": watched_env(run_dir)}
        for _ in range(runs):
            for name, env in envs.items():
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-c", code], env=env, check=True)
                times[name].append(time.perf_counter() - t0)
        records = [json.loads(line) for p in Path(run_dir).glob("*.jsonl") for line in p.read_text().splitlines()]
    hooked = [r for r in records if r.get("kind") == "hooked"]
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "command": f'python -c "{code}"',
        "runs": runs,
        "median_s": med,
        "runs_s": times,
        "added_s": med["watched"] - med["plain"],
        "watched_processes_hooked": len(hooked),
        "sitecustomize_import_ms": sitecustomize_import_ms(envs["watched"]),
        "patch_ms_median": statistics.median(r["patch_s"] for r in hooked) * 1e3 if hooked else None,
    }


def sitecustomize_import_ms(env: dict, runs: int = 5) -> float:
    """What the hooks add inside a process before the program runs: the sitecustomize import
    (python -X importtime, cumulative), median over runs."""
    values = []
    for _ in range(runs):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "pass"], env=env, capture_output=True, text=True, check=True
        )
        for line in proc.stderr.splitlines():
            parts = line.split("|")
            if len(parts) == 3 and parts[2].strip() == "sitecustomize":
                values.append(int(parts[1]) / 1e3)
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--parts", default="decode,storages,wrapper,startup")
    parser.add_argument("--inner-decode", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner_decode:
        print(json.dumps(inner_decode()))
        return
    import torch

    doc = {
        "benchmark": "watch_overhead",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "python": sys.version.split()[0],
    }
    parts = {"decode": part_decode, "storages": part_storages, "wrapper": part_wrapper, "startup": part_startup}
    for name in args.parts.split(","):
        doc[name] = parts[name]()
    emit(doc, args.json)


if __name__ == "__main__":
    main()
