"""Where a trial's time goes: one TP=1 trial's rank run in this process under cProfile.

Time to verdict is dominated by one-time costs in the worker (torch import, first capture);
this names them. The rank runs exactly as `python -m repro.rank.worker` would run it.
Usage: PYTHONPATH=$PWD python3 benchmarks/profile_trial.py [--scenario nvfp4-reload] [--top 30]
           [--graphs] [--who-imports MODULE] [-- any run key=value, e.g. steps=2]
--graphs times each capture and each graph's first replay instead of profiling (cProfile's
own cost would be in every figure).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
import traceback
from pathlib import Path

t_process = time.perf_counter()

from repro.env import gpus  # noqa: E402  (the clock above starts first)
from repro.run.runner import plan  # noqa: E402
from repro.run.protocol import TrialSpec  # noqa: E402
from repro.rank.worker import run_rank  # noqa: E402


class WhoImports:
    """A meta-path finder that finds nothing: it keeps the stack of the first import of `name`."""

    def __init__(self, name: str):
        self.name = name
        self.stack: list[str] = []

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name and not self.stack:
            self.stack = traceback.format_stack()[:-1]
        return None


class GraphClock:
    """Times each capture (warm-up, capture, census, instantiate) and each graph's first replay,
    by wrapping the scenarios' `capture` and `Captured.replay` in this process only; CUDA is
    synchronized around each, so a time is the work's own."""

    def __init__(self):
        self.captures: list[tuple[str, float]] = []
        self.first_replays: dict[str, float] = {}

    def install(self) -> None:
        import repro.rank.graphs as graphs
        from repro.scenarios import SCENARIOS, load_scenario

        original_capture, original_replay = graphs.capture, graphs.Captured.replay
        clock = self

        def timed_capture(fn, inputs, label, *args, **kwargs):
            sync(inputs[0])
            start = time.perf_counter()
            out = original_capture(fn, inputs, label, *args, **kwargs)
            sync(inputs[0])
            clock.captures.append((label, time.perf_counter() - start))
            return out

        def timed_replay(captured):
            if captured.graph is None or captured.label in clock.first_replays:
                return original_replay(captured)
            sync(captured.inputs[0])
            start = time.perf_counter()
            out = original_replay(captured)
            sync(captured.inputs[0])
            clock.first_replays[captured.label] = time.perf_counter() - start
            return out

        for name in SCENARIOS:
            module = load_scenario(name)
            if getattr(module, "capture", None) is original_capture:
                module.capture = timed_capture
        graphs.Captured.replay = timed_replay

    def lines(self) -> list[str]:
        return [f"capture {label}: {sec * 1e3:.1f} ms" for label, sec in self.captures] + [
            f"first replay {label}: {sec * 1e3:.2f} ms" for label, sec in self.first_replays.items()
        ]


def sync(tensor) -> None:
    if tensor.is_cuda:
        import torch

        torch.cuda.synchronize(tensor.device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="nvfp4-reload")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", help="write the pstats dump here")
    ap.add_argument("--who-imports", metavar="MODULE", help="print the stack that first imports MODULE")
    ap.add_argument("--graphs", action="store_true", help="time each capture and each graph's first replay")
    ap.add_argument("run", nargs="*", help="run overrides, KEY=VALUE")
    a = ap.parse_args()
    run = {"tp": 1} if a.scenario == "gemma4-mtp" else {}
    p = plan(a.scenario, None, run, [f"run.{kv}" for kv in a.run], gpus.gpu_count())
    with tempfile.TemporaryDirectory() as tmp:
        spec = TrialSpec(trial_id="profile", config=p.cfg.to_dict(), device=p.device, world_size=1, out_dir=tmp)
        who = WhoImports(a.who_imports) if a.who_imports else None
        if who:
            sys.meta_path.insert(0, who)
        clock = GraphClock() if a.graphs else None
        if clock:
            clock.install()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        if not clock:  # the clock times the work itself, not cProfile's cost
            prof.enable()
        code = run_rank(spec, 0)  # a failing rank calls os._exit: profile passing trials
        prof.disable()
        total = time.perf_counter() - t0
        phases = [line for line in (Path(tmp) / "rank0.jsonl").read_text().splitlines() if '"phase"' in line]
    out = io.StringIO()
    if clock:
        out.write("\n".join(clock.lines()) + "\n")
    if who:
        out.write(f"first import of {who.name}: " + ("".join(who.stack[-25:]) if who.stack else "never\n"))
    stats = None if clock else pstats.Stats(prof, stream=out).sort_stats("cumulative")
    if stats:
        stats.print_stats(a.top)
    sys.stdout.write(
        f"{a.scenario} on {p.device}: rank exit {code}, {total:.2f} s in run_rank "
        f"({t0 - t_process:.2f} s before it)\n" + "\n".join(phases) + "\n" + out.getvalue()
    )
    if a.out and stats:
        stats.dump_stats(a.out)


if __name__ == "__main__":
    main()
