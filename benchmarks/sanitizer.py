"""The guard vs compute-sanitizer memcheck on the same unfixed trials.

For each after-free value the same unfixed trial runs twice: with the guard (warn, no
sanitizer) and under `compute-sanitizer --tool memcheck` with the guard off, so each tool's
verdict is its own. Recorded: detected or not, the time to the diagnosis (guard: when its
finding was on disk; memcheck: the trial's end, when its report is complete), wall time, and
memcheck's first report lines. Memcheck sees accesses to memory the driver no longer maps; with
`keep` the freed block stays in PyTorch's cache, still mapped, and memcheck has nothing to see.
Usage: PYTHONPATH=$PWD python3 benchmarks/sanitizer.py --json out.json [--scenario gemma4-mtp]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

from common import emit
from repro import doctor
from repro.isolate import read_records, run_trial
from repro.runner import plan

MEMCHECK = ["compute-sanitizer", "--tool", "memcheck", "--print-limit", "5", "--show-backtrace", "no"]
MEMCHECK_ERROR = re.compile(r"Invalid __global__|Program hit|ERROR SUMMARY: [1-9]")


def memcheck_lines(tail: str) -> list[str]:
    return [l.strip() for l in tail.splitlines() if re.search(r"Invalid __global__|ERROR SUMMARY|Program hit", l)]


def first_finding_at(out_dir: Path, world: int) -> float | None:
    times = [e["t"] for r in read_records(str(out_dir), world) for e in r.of("finding")]
    return min(times) if times else None


def one(scenario: str, preset: str | None, after_free: str, steps: int, tp: int, memcheck: bool,
        deadline: float) -> dict:
    run = {"mode": "unfixed", "after_free": after_free, "steps": steps, "deadline_s": deadline,
           "guard": "off" if memcheck else "warn"}
    if scenario == "gemma4-mtp":
        run["tp"] = tp
    p = plan(scenario, preset, run, [], doctor.gpu_count())
    with tempfile.TemporaryDirectory() as tmp:
        t_spawn, t0 = time.time(), time.perf_counter()
        trial = run_trial(p.cfg, p.device, Path(tmp), "s", wrapper=MEMCHECK if memcheck else None)
        wall = time.perf_counter() - t0
        found_at = first_finding_at(Path(tmp) / "s", p.cfg.run.tp)
    tails = "\n".join(r.stderr_tail for r in trial.ranks)
    row = {"scenario": scenario, "after_free": after_free, "tool": "memcheck" if memcheck else "guard",
           "outcome": trial.outcome.value, "wall_s": wall}
    if memcheck:
        lines = memcheck_lines(tails)
        row.update(detected=any(MEMCHECK_ERROR.search(l) for l in lines), diagnosis_s=wall, report=lines[:4])
    else:
        row.update(detected=found_at is not None, diagnosis_s=None if found_at is None else found_at - t_spawn,
                   finding=trial.guard_findings[0].slot if trial.guard_findings else None)
    return row


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
        for memcheck in (False, True):
            rows.append(one(a.scenario, a.preset, af, a.steps, a.tp, memcheck, a.deadline))
            sys.stderr.write(json.dumps(rows[-1]) + "\n")
    by = {(r["after_free"], r["tool"]): r for r in rows}
    for af in a.after_free:
        g, m = by[(af, "guard")], by[(af, "memcheck")]
        if g["detected"] and m["detected"]:
            g["memcheck_over_guard"] = m["diagnosis_s"] / g["diagnosis_s"]
    emit(rows, a.json)


if __name__ == "__main__":
    main()
