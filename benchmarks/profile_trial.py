"""Where a trial's time goes: one TP=1 trial's rank run in this process under cProfile.

Time to verdict is dominated by one-time costs in the worker (torch import, first capture);
this names them. The rank runs exactly as `python -m repro.worker` would run it.
Usage: PYTHONPATH=$PWD python3 benchmarks/profile_trial.py [--scenario nvfp4-reload] [--top 30]
           [-- any run key=value, e.g. steps=2]
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

from repro import gpus                       # noqa: E402  (the clock above starts first)
from repro.runner import plan                # noqa: E402
from repro.protocol import TrialSpec  # noqa: E402
from repro.worker import run_rank  # noqa: E402


class WhoImports:
    """A meta-path finder that finds nothing: it keeps the stack of the first import of `name`."""

    def __init__(self, name: str):
        self.name = name
        self.stack: list[str] = []

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name and not self.stack:
            self.stack = traceback.format_stack()[:-1]
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="nvfp4-reload")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", help="write the pstats dump here")
    ap.add_argument("--who-imports", metavar="MODULE", help="print the stack that first imports MODULE")
    ap.add_argument("run", nargs="*", help="run overrides, KEY=VALUE")
    a = ap.parse_args()
    run = {"tp": 1} if a.scenario == "gemma4-mtp" else {}
    p = plan(a.scenario, None, run, [f"run.{kv}" for kv in a.run], gpus.gpu_count())
    with tempfile.TemporaryDirectory() as tmp:
        spec = TrialSpec(trial_id="profile", config=p.cfg.to_dict(), device=p.device, world_size=1, out_dir=tmp)
        who = WhoImports(a.who_imports) if a.who_imports else None
        if who:
            sys.meta_path.insert(0, who)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        code = run_rank(spec, 0)          # a failing rank calls os._exit: profile passing trials
        prof.disable()
        total = time.perf_counter() - t0
        phases = [line for line in (Path(tmp) / "rank0.jsonl").read_text().splitlines() if '"phase"' in line]
    out = io.StringIO()
    if who:
        out.write(f"first import of {who.name}: " + ("".join(who.stack[-25:]) if who.stack else "never\n"))
    stats = pstats.Stats(prof, stream=out).sort_stats("cumulative")
    stats.print_stats(a.top)
    sys.stdout.write(f"{a.scenario} on {p.device}: rank exit {code}, {total:.2f} s in run_rank "
                     f"({t0 - t_process:.2f} s before it)\n" + "\n".join(phases) + "\n" + out.getvalue())
    if a.out:
        stats.dump_stats(a.out)


if __name__ == "__main__":
    main()
