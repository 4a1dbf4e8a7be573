"""What `repro watch`'s per-replay hook costs an engine's decode step, measured inside one process.

    PYTHONPATH=. python3 benchmarks/engine_step.py full|piecewise [--sizes 67] [--layers 32]
        [--hidden 1024] [--rounds 20]
    repro watch -- python3 benchmarks/engine_step.py piecewise ...

Builds examples/engine_shapes.py's engine, captures its graphs (under watch when started so),
then times decode rounds (every size once, synchronized around each step, as engine_shapes
times them) alternating two replay functions round by round: `torch.cuda.CUDAGraph.replay` as
the process has it (under watch: the hook's wrapper) and the function it wraps (`__wrapped__`;
in a plain process there is none, so both are the same function: an A/A run that shows the
noise floor). Same graphs, same memory, same process: the spread between processes (+-15% on
one H200, between fresh processes of the same program) does not enter the ratio. One JSON line:
the synchronized step with and without the hook (each size's median over rounds, averaged over
sizes), their ratio; the host's part of that step (until step() returns: what the hook adds
directly); and pipelined rounds (one synchronize per round: the host's work hidden behind the
GPU's where it can be). GPU only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load_shapes():
    spec = importlib.util.spec_from_file_location("engine_shapes", REPO / "examples" / "engine_shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=("full", "piecewise"))
    p.add_argument("--sizes", type=int, default=67)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--rounds", type=int, default=20, help="rounds per variant")
    return p.parse_args(argv)


def timed_round(torch, step, sizes) -> tuple[list[float], list[float], float]:
    """(seconds of each synchronized step, in the order of `sizes`; seconds until each of those
    steps returned, before its synchronize: the host's own part; seconds of one pipelined pass
    over every size)."""
    steps, hosts = [], []
    for b in sizes:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(b)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - t0)
        hosts.append(t1 - t0)
    t0 = time.perf_counter()
    for b in sizes:
        step(b)
    torch.cuda.synchronize()
    return steps, hosts, time.perf_counter() - t0


def per_size_mean(rounds: list[list[float]]) -> float:
    """Microseconds: the mean over sizes of each size's median over rounds. A median over every
    step of every size mixes 67 step times that differ by size, and lands on whichever size sits
    in the middle: it jumps between sizes by ~1% from one run to the next (the A/A runs of the
    sixth series read 0.988-0.991x). Per size first, the rounds pair up."""
    return 1e6 * statistics.fmean(statistics.median(per_round) for per_round in zip(*rounds))


def measure(torch, step, sizes, rounds: int, hooked, bare) -> dict:
    """Rounds alternating the two replay functions (which goes first alternates too)."""
    graph_class = torch.cuda.CUDAGraph
    got = {v: {"step_us": [], "host_us": [], "pipelined_us": []} for v in ("hooked", "bare")}
    variants = (("hooked", hooked), ("bare", bare))
    try:
        for r in range(rounds):
            for name, fn in variants if r % 2 == 0 else variants[::-1]:
                graph_class.replay = fn
                steps, hosts, pipelined = timed_round(torch, step, sizes)
                got[name]["step_us"].append(steps)
                got[name]["host_us"].append(hosts)
                got[name]["pipelined_us"].append(1e6 * pipelined / len(sizes))
    finally:
        graph_class.replay = hooked
    out = {}
    for key in ("step_us", "host_us", "pipelined_us"):
        if key == "pipelined_us":
            h, b = (statistics.median(got[v][key]) for v in ("hooked", "bare"))
        else:
            h, b = (per_size_mean(got[v][key]) for v in ("hooked", "bare"))
        out[key] = {"hooked": round(h, 2), "bare": round(b, 2), "ratio": round(h / b, 4)}
    return out


def rss_kib() -> int:
    """This process's resident memory now (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)
    except (OSError, ValueError, IndexError):
        return 0


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"shape": args.shape, "cuda": False, "note": "no CUDA device: nothing was captured"}))
        return 0
    shapes = load_shapes()
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    model = shapes.build_model(torch, args.layers, args.hidden, args.context)
    kv = shapes.KVCache(torch, args.layers, args.context, args.hidden)
    engine = shapes.Engine(torch, args, model, kv)
    sizes = shapes.vllm_sizes(args.sizes)
    if args.shape == "full":
        engine.capture_full(sizes)
        step = engine.replay_full
    else:
        engine.capture_pieces(sizes)
        step = engine.replay_pieces
    for b in sizes:  # first replays: where watch's deep checks run
        step(b)
    torch.cuda.synchronize()
    hooked = torch.cuda.CUDAGraph.replay
    bare = getattr(hooked, "__wrapped__", hooked)
    rss_before = rss_kib()
    result = measure(torch, step, sizes, args.rounds, hooked, bare)
    replays = 2 * args.rounds * engine.graphs  # per variant: every graph once a synced and once a pipelined pass
    # The host memory the timed rounds added (resident, not peak): watch's records must not grow
    # with replays, only with captures.
    grown = rss_kib() - rss_before
    print(
        json.dumps(
            {
                "shape": args.shape,
                "graphs": engine.graphs,
                "hook": bare is not hooked,
                "rounds": args.rounds,
                "replays_per_variant": replays,
                "rss_grown_kib": grown,
                **result,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
