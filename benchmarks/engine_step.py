"""What `repro watch`'s per-replay hook costs an engine's decode step, measured inside one process.

    PYTHONPATH=. python3 benchmarks/engine_step.py full|piecewise [--sizes 67] [--layers 32]
        [--hidden 1024] [--rounds 20] [--decompose] [--imitate trace,keep] [--undo-rounds N]
    repro watch -- python3 benchmarks/engine_step.py piecewise ...

Builds examples/engine_shapes.py's engine, captures its graphs (under watch when started so),
then times decode rounds (every size once, synchronized around each step, as engine_shapes
times them), each step back to back with these replay functions: `torch.cuda.CUDAGraph.replay`
as the process has it after the first round (`hooked`: under watch, with every graph settled,
the wrappers stand aside and this is torch's own; `watch.class_replay` says which), torch's own
(`bare`; in a plain process both are the same function: an A/A run that shows the noise
floor), a Python wrapper that only calls it (`thin`: what any Python layer costs here) and,
under watch, watch's replay wrapper itself (`wrapper`: what a replay costs while some graph
is held, or through a bound replay saved while the wrapper was on the class). Same graphs, same
memory, same process: the spread between processes (+-15% on one H200, between fresh
processes of the same program) does not enter the ratio. One JSON line:
the synchronized step with and without the hook (each size's median over rounds, averaged over
sizes), their ratio; the host's part of that step (until step() returns: what the hook adds
directly); and pipelined rounds (one synchronize per round: the host's work hidden behind the
GPU's where it can be). Also: the capture's seconds and the first round's; each thread's CPU
and the container's CPU throttling over the rounds; --imitate puts one piece of what watch
leaves in a process (its allocator trace, kept cudaGraph_t objects) into a plain one, and
--undo-rounds times the bare step again with the allocator trace stopped: whether either slows
a process by itself (docs/PERFORMANCE.md, ninth series). GPU only.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import importlib.util
import json
import os
import statistics
import sys
import threading
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
    p.add_argument("--decompose", action="store_true", help="also time each piece of the hook's path alone")
    p.add_argument(
        "--imitate",
        default="",
        help="comma-separated, in a plain process: what watch leaves in a process, alone. trace: the "
        "allocator's alloc/free trace on from before the capture, as the census starts it; keep: "
        "every graph keeps its cudaGraph_t past capture_end (instantiated there, as watch does)",
    )
    p.add_argument(
        "--undo-rounds",
        type=int,
        default=0,
        help="after the timed rounds, time the bare step this many rounds as the process is, then "
        "again with the allocator trace stopped: whether the trace is what slows the process",
    )
    p.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() before the timed rounds: whether the cyclic GC's passes over what the "
        "process holds (watch's records among it) enter the step",
    )
    return p.parse_args(argv)


def timed_step(torch, step, b: int) -> tuple[float, float]:
    """(seconds of one synchronized step of size b; seconds until it returned, before its
    synchronize: the host's own part)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(b)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, t1 - t0


def pipelined_pass(torch, step, sizes) -> float:
    """Seconds of one pass over every size with one synchronize at its end."""
    t0 = time.perf_counter()
    for b in sizes:
        step(b)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


IMITATIONS = ("trace", "keep")
SETTLE_ROUNDS = 2  # untimed rounds after the first, before the timed ones


def imitate(torch, what: list[str]) -> None:
    """Put into this plain process, before its capture, the named pieces of what watch leaves
    in a watched one (--imitate)."""
    unknown = [w for w in what if w not in IMITATIONS]
    if unknown:
        raise SystemExit(f"--imitate {','.join(unknown)}: not one of {', '.join(IMITATIONS)}")
    if "trace" in what:
        from repro.diagnose.allocator import start_trace

        start_trace()
    if "keep" in what:
        graph_class = torch.cuda.CUDAGraph
        init, end = graph_class.__init__, graph_class.capture_end

        def keeping_init(graph, *args, **kwargs):
            kwargs.pop("keep_graph", None)
            init(graph, True, *args[1:], **kwargs)

        def instantiating_end(graph):
            end(graph)
            graph.instantiate()

        graph_class.__init__ = keeping_init
        graph_class.capture_end = instantiating_end


def bare_rounds(torch, step, sizes, rounds: int) -> float:
    """Microseconds of the synchronized step with whatever replay the class has now (each size's
    median over rounds, averaged over sizes)."""
    got = [[timed_step(torch, step, b)[0] for b in sizes] for _ in range(rounds)]
    return round(per_size_mean(got), 2)


def undo_phases(torch, step, sizes, rounds: int, bare) -> dict:
    """The bare step as the process is, then with the allocator trace stopped (it stays
    stopped: run this last)."""
    graph_class = torch.cuda.CUDAGraph
    hooked, graph_class.replay = graph_class.replay, bare
    try:
        as_is = bare_rounds(torch, step, sizes, rounds)
        torch.cuda.memory._record_memory_history(enabled=None)
        trace_off = bare_rounds(torch, step, sizes, rounds)
    finally:
        graph_class.replay = hooked
    return {"rounds": rounds, "as_is_us": as_is, "trace_off_us": trace_off}


def cgroup_cpu() -> dict:
    """The container's CPU limit and throttling so far (cgroup v2; empty where unreadable)."""
    out = {}
    for name in ("cpu.max", "cpu.stat"):
        try:
            with open(f"/sys/fs/cgroup/{name}") as f:
                text = f.read()
        except OSError:
            continue
        if name == "cpu.max":
            out["max"] = text.strip()
        else:
            stat = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
            out |= {k: int(stat[k]) for k in ("nr_throttled", "throttled_usec", "usage_usec") if k in stat}
    return out


def per_size_mean(rounds: list[list[float]]) -> float:
    """Microseconds: the mean over sizes of each size's median over rounds. A median over every
    step of every size mixes 67 step times that differ by size, and lands on whichever size sits
    in the middle: it jumps between sizes by ~1% from one run to the next (the A/A runs of the
    sixth series read 0.988-0.991x). Per size first, the rounds pair up."""
    return 1e6 * statistics.fmean(statistics.median(per_round) for per_round in zip(*rounds))


def pass_through(bare):
    """A Python wrapper that does nothing but call `bare`: what any Python layer on the replay
    path costs in this step (the floor under the hook's own work)."""

    def replay(graph):
        return bare(graph)

    return replay


def measure(torch, step, sizes, rounds: int, hooked, bare, extra=()) -> dict:
    """Every size's step timed with each replay function in turn, back to back (which goes
    first rotates by round), then one pipelined pass each: paired step by step, the machine's
    drift over a round (one H200 host moved ~2% between identical functions timed a round
    apart) does not enter the ratio."""
    graph_class = torch.cuda.CUDAGraph
    variants = (("hooked", hooked), ("bare", bare), ("thin", pass_through(bare)), *extra)
    names = [name for name, _ in variants]
    got = {v: {"step_us": [], "host_us": [], "pipelined_us": []} for v in names}
    try:
        for r in range(rounds):
            turn = r % len(variants)
            order = variants[turn:] + variants[:turn]
            steps, hosts = {v: [] for v in names}, {v: [] for v in names}
            for b in sizes:
                for name, fn in order:
                    graph_class.replay = fn
                    took, host = timed_step(torch, step, b)
                    steps[name].append(took)
                    hosts[name].append(host)
            for name, fn in order:
                graph_class.replay = fn
                got[name]["pipelined_us"].append(1e6 * pipelined_pass(torch, step, sizes) / len(sizes))
                got[name]["step_us"].append(steps[name])
                got[name]["host_us"].append(hosts[name])
    finally:
        graph_class.replay = hooked
    out = {}
    for key in ("step_us", "host_us", "pipelined_us"):
        summarize = statistics.median if key == "pipelined_us" else per_size_mean
        us = {v: summarize(got[v][key]) for v in names}
        out[key] = {v: round(t, 2) for v, t in us.items()} | {"ratio": round(us["hooked"] / us["bare"], 4)}
        if "wrapper" in us:
            out[key]["wrapper_ratio"] = round(us["wrapper"] / us["bare"], 4)
    return out


def parts_of_the_hook(bare) -> list:
    """Under watch, replay functions that each add one piece of the hook's steady-state path
    to a bare call (which piece costs what in this step); none in a plain process."""
    active = active_watcher()
    if active is None:
        return []
    gate, drops, counters = active.graphs.gate, active.tools.drops, active.log.counters
    held = gate.held

    def gated(graph):
        if gate.at == drops.n and id(graph) not in held:
            pass
        return bare(graph)

    def counted(graph):
        counters.replays += 1
        return bare(graph)

    def guarded(graph):
        try:
            return bare(graph)
        except RuntimeError:
            raise

    armed = False
    replays = itertools.count()

    def flagged(graph):
        if armed:
            return counted(graph)
        return bare(graph)

    def flag_counted(graph):
        if armed:
            return counted(graph)
        next(replays)
        return bare(graph)

    def flag_added(graph):
        if armed:
            return counted(graph)
        counters.replays += 1
        return bare(graph)

    mode = 1

    def held_mode(graph):
        if not mode:
            counters.replays += 1
        elif mode == 1 and id(graph) not in held:
            counters.replays += 1
        return bare(graph)

    return [
        ("held_mode", held_mode),
        ("gated", gated),
        ("counted", counted),
        ("guarded", guarded),
        ("flagged", flagged),
        ("flag_counted", flag_counted),
        ("flag_added", flag_added),
    ]


def watched_states() -> dict | None:
    """Under watch: whether the replay wrapper's gate is open and how many graphs it holds for
    the checks, how many graphs are settled and why the others are not; None in a plain
    process."""
    active = active_watcher()
    if active is None:
        return None
    drops = active.tools.drops.n
    counts: dict[str, int] = {}
    for state in active.graphs.values():
        if state.managed or not state.captured:
            why = "managed or not captured"
        elif state.fast_at == drops:
            why = "settled"
        elif state.live is None:
            why = "no live handles (guard path)"
        elif not active.checks.listened(state.label):
            why = "a storage without a drop callback"
        else:
            why = "unsettled"
        counts[why] = counts.get(why, 0) + 1
    gate, book = active.graphs.gate, active.tools.census.book
    return {
        "wrapper_mode": wrapper_mode(),
        "trace_paused": None if book is None else book.paused,
        "drops": drops,
        "gate_open": gate.at == drops,
        "mode": gate.mode.name,
        "held": len(gate.held),
        "states": counts,
        "counters": dict(vars(active.log.counters)),
    }


def active_watcher():
    watcher = sys.modules.get("repro.watch.hooks.watcher")
    return watcher.active() if watcher is not None else None


def replay_wrapper(torch):
    """Under watch, its replay wrapper of torch.cuda.CUDAGraph (on the class or standing aside);
    None in a plain process."""
    active = active_watcher()
    return None if active is None else active.replay_wrappers.get(torch.cuda.CUDAGraph)


def hook_counts() -> dict | None:
    active = active_watcher()
    if active is None:
        return None
    return {"replays_counted": active.log.counters.replays, "stood_aside": active.graphs.gate.asides}


def wrapper_mode() -> int | None:
    """The Mode the replay wrapper keeps in its own closure (what it tests at each replay; the
    gate's `mode` is what it was last told), or None where it keeps none."""
    import torch

    hook = replay_wrapper(torch)
    names = getattr(getattr(hook, "__code__", None), "co_freevars", ())
    if "mode" not in names or hook.__closure__ is None:
        return None
    return hook.__closure__[names.index("mode")].cell_contents


def thread_cpu() -> dict[str, float]:
    """CPU seconds each of this process's threads has used so far, by thread id (Linux /proc;
    empty where it cannot be read): a thread that burns CPU while the step runs shows here."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[tid] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    except (OSError, ValueError, IndexError):
        pass
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
    imitated = [w for w in args.imitate.split(",") if w]
    torch.zeros(1, device="cuda")  # CUDA's initialisation, before any imitation
    imitate(torch, imitated)
    model = shapes.build_model(torch, args.layers, args.hidden, args.context)
    kv = shapes.KVCache(torch, args.layers, args.context, args.hidden)
    engine = shapes.Engine(torch, args, model, kv)
    sizes = shapes.vllm_sizes(args.sizes)
    t0 = time.perf_counter()
    if args.shape == "full":
        engine.capture_full(sizes)
        step = engine.replay_full
    else:
        engine.capture_pieces(sizes)
        step = engine.replay_pieces
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0
    for b in sizes:  # first replays: where watch's deep checks run
        step(b)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0 - capture_s
    # A graph settles at its second replay (the first deep-checks it, the second tests its
    # storages and settles it): until every graph has, the wrapper stays on the class. More
    # rounds, untimed, so that `hooked` below is what the class holds in the steady state (a
    # GPU run that read it after one round timed the wrapper: docs/PERFORMANCE.md, tenth series).
    for _ in range(SETTLE_ROUNDS):
        for b in sizes:
            step(b)
    torch.cuda.synchronize()
    wrapper = replay_wrapper(torch)  # watch's, on the class or standing aside; None: plain
    hooked = torch.cuda.CUDAGraph.replay  # as the process has it now
    bare = getattr(wrapper, "__wrapped__", hooked)
    if args.gc_freeze:
        gc.freeze()
    cgroup_before = cgroup_cpu()
    rss_before, gc_before, cpu_before = rss_kib(), [g["collections"] for g in gc.get_stats()], thread_cpu()
    extra = [("wrapper", wrapper)] if wrapper is not None else []
    extra += parts_of_the_hook(bare) if args.decompose else []
    seen_before = hook_counts()
    result = measure(torch, step, sizes, args.rounds, hooked, bare, extra)
    seen = {k: v - seen_before[k] for k, v in hook_counts().items()} if seen_before else None
    collections = [g["collections"] - n for g, n in zip(gc.get_stats(), gc_before)]
    cpu_after, main_tid = thread_cpu(), str(threading.get_native_id())
    other_cpu = sum(t - cpu_before.get(tid, 0.0) for tid, t in cpu_after.items() if tid != main_tid)
    replays = 2 * args.rounds * engine.graphs  # per variant: every graph once a synced and once a pipelined pass
    # The host memory the timed rounds added (resident, not peak): watch's records must not grow
    # with replays, only with captures.
    grown = rss_kib() - rss_before
    cgroup_after = cgroup_cpu()
    throttled = {k: v - cgroup_before[k] for k, v in cgroup_after.items() if k != "max" and k in cgroup_before}
    states = watched_states()  # before the undo phases stop the trace
    undo = undo_phases(torch, step, sizes, args.undo_rounds, bare) if args.undo_rounds else None
    print(
        json.dumps(
            {
                "shape": args.shape,
                "graphs": engine.graphs,
                "hook": wrapper is not None,
                "class_replay": "torch's own" if hooked is bare else "watch's wrapper",
                # under watch: replays the wrapper counted and times it stood aside, over the
                # timed rounds (the `wrapper` variant's replays among them)
                "hooks_over_rounds": seen,
                "imitated": imitated,
                "capture_s": round(capture_s, 3),
                "first_round_s": round(first_s, 3),
                "rounds": args.rounds,
                "replays_per_variant": replays,
                "rss_grown_kib": grown,
                "watch": states,
                "undo": undo,
                "kernel": os.uname().release,
                "cgroup": {"max": cgroup_after.get("max"), **throttled},
                "threads": {
                    "count": len(cpu_after),
                    "python": sorted(t.name for t in threading.enumerate()),
                    "torch_intra_op": torch.get_num_threads(),
                    "main_cpu_s": round(cpu_after.get(main_tid, 0.0) - cpu_before.get(main_tid, 0.0), 2),
                    "others_cpu_s": round(other_cpu, 2),
                },
                "gc": {"frozen": args.gc_freeze, "collections": collections, "tracked": len(gc.get_objects())},
                **result,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
