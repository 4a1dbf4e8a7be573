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
median step with and without the hook, their ratio, and the same for pipelined rounds (one
synchronize per round: the host's work hidden behind the GPU's where it can be). GPU only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
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


def timed_round(torch, step, sizes) -> tuple[list[float], float]:
    """(seconds of each synchronized step, seconds of one pipelined pass over every size)."""
    steps = []
    for b in sizes:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(b)
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for b in sizes:
        step(b)
    torch.cuda.synchronize()
    return steps, time.perf_counter() - t0


def measure(torch, step, sizes, rounds: int, hooked, bare) -> dict:
    """Rounds alternating the two replay functions (which goes first alternates too)."""
    graph_class = torch.cuda.CUDAGraph
    got = {"hooked": ([], []), "bare": ([], [])}
    variants = (("hooked", hooked), ("bare", bare))
    try:
        for r in range(rounds):
            for name, fn in variants if r % 2 == 0 else variants[::-1]:
                graph_class.replay = fn
                steps, pipelined = timed_round(torch, step, sizes)
                got[name][0].extend(steps)
                got[name][1].append(pipelined / len(sizes))
    finally:
        graph_class.replay = hooked
    out = {}
    for key, index in (("step_us", 0), ("pipelined_us", 1)):
        h, b = (1e6 * statistics.median(got[v][index]) for v in ("hooked", "bare"))
        out[key] = {"hooked": round(h, 2), "bare": round(b, 2), "ratio": round(h / b, 4)}
    return out


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
    result = measure(torch, step, sizes, args.rounds, hooked, bare)
    print(
        json.dumps(
            {"shape": args.shape, "graphs": engine.graphs, "hook": bare is not hooked, "rounds": args.rounds, **result}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
