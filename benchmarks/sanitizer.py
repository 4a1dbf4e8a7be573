"""The guard vs compute-sanitizer memcheck on the same unfixed trials.

For each after-free value: run the trial with the guard (warn) and again under
`compute-sanitizer --tool memcheck`, record the outcome, the wall time and memcheck's first
report. Memcheck only sees memory already returned to the driver; with `keep` the freed block
is still cached by PyTorch and memcheck has nothing to report.
Usage: PYTHONPATH=$PWD python3 benchmarks/sanitizer.py --json out.json [--scenario gemma4-mtp]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
import tempfile

from common import emit
from repro import doctor
from repro.isolate import run_trial
from repro.runner import plan

MEMCHECK = ["compute-sanitizer", "--tool", "memcheck", "--print-limit", "5", "--show-backtrace", "no"]


def first_report(tail: str) -> str:
    lines = [l for l in tail.splitlines() if re.search(r"Invalid __global__|ERROR SUMMARY|Program hit", l)]
    return " | ".join(lines[:3])


def one(scenario: str, preset: str, after_free: str, steps: int, tp: int, wrapper: list[str], deadline: float) -> dict:
    run = {"mode": "unfixed", "after_free": after_free, "steps": steps, "deadline_s": deadline}
    if scenario == "gemma4-mtp":
        run["tp"] = tp
    p = plan(scenario, preset, run, [], doctor.gpu_count())
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        trial = run_trial(p.cfg, p.device, Path(tmp), "s", wrapper=wrapper)
        wall = time.perf_counter() - t0
    tails = "\n".join(r.stderr_tail for r in trial.ranks)
    first_finding = trial.guard_findings[0].slot if trial.guard_findings else None
    return {"scenario": scenario, "after_free": after_free, "tool": "memcheck" if wrapper else "guard",
            "outcome": trial.outcome.value, "wall_s": wall, "guard_finding": first_finding,
            "memcheck_report": first_report(tails) if wrapper else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--scenario", default="gemma4-mtp")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--deadline", type=float, default=240)
    ap.add_argument("--after-free", nargs="+", default=["keep", "release"])
    a = ap.parse_args()
    rows = []
    for af in a.after_free:
        for wrapper in ([], MEMCHECK):
            rows.append(one(a.scenario, a.preset, af, a.steps, a.tp, wrapper, a.deadline))
            sys.stderr.write(json.dumps(rows[-1]) + "\n")
    emit(rows, a.json)


if __name__ == "__main__":
    main()
