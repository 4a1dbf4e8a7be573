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
import threading
import time
from pathlib import Path

from common import emit
from repro.env import gpus
from repro.run.isolate import Interrupted, run_trial
from repro.run.protocol import Event, log_path, read_records
from repro.run.runner import plan

# API errors (NCCL probes kernels it has no image for) are noise here: only memory errors count.
MEMCHECK = [
    "compute-sanitizer",
    "--tool",
    "memcheck",
    "--report-api-errors",
    "no",
    "--print-limit",
    "10",
    "--show-backtrace",
    "no",
]
MEMORY_ERROR = re.compile(r"Invalid __(global|shared|local)__ (read|write)|is out of bounds|is misaligned")


def first_memory_error(out_dir: Path, world: int) -> list[str] | None:
    """Memcheck's first memory-error block (the error, its kernel, thread, address), if any."""
    for r in range(world):
        path = log_path(out_dir, r)
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        for i, line in enumerate(lines):
            if MEMORY_ERROR.search(line):
                return [l.strip() for l in lines[i : i + 5]]
    return None


def first_finding_at(out_dir: Path, world: int) -> float | None:
    times = [e["t"] for r in read_records(str(out_dir), world) for e in r.of(Event.FINDING)]
    return min(times) if times else None


def one(
    scenario: str, preset: str | None, after_free: str, steps: int, tp: int, memcheck: bool, deadline: float
) -> dict:
    """One trial; a memcheck trial is stopped as soon as memcheck has reported a memory error
    (its diagnosis is then complete: memcheck goes on slowly through every later bad access)."""
    run = {
        "mode": "unfixed",
        "after_free": after_free,
        "steps": steps,
        "deadline_s": deadline,
        "guard": "off" if memcheck else "warn",
    }
    if scenario == "gemma4-mtp":
        run["tp"] = tp
    p = plan(scenario, preset, run, [], gpus.gpu_count())
    world = p.cfg.run.tp
    stop = threading.Event()
    seen: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp) / "s"
        t_spawn, t0 = time.time(), time.perf_counter()

        def watch(_trial_id: str, _steps: int) -> None:
            if memcheck and "report" not in seen:
                report = first_memory_error(out_dir, world)
                if report:
                    seen.update(report=report, at=time.perf_counter() - t0)
                    stop.set()

        try:
            trial = run_trial(
                p.cfg, p.device, Path(tmp), "s", wrapper=MEMCHECK if memcheck else None, on_tick=watch, stop=stop
            )
        except Interrupted as e:
            trial = e.trial
        wall = time.perf_counter() - t0
        found_at = first_finding_at(out_dir, world)
        report = seen.get("report") or first_memory_error(out_dir, world)
    row = {
        "scenario": scenario,
        "after_free": after_free,
        "tool": "memcheck" if memcheck else "guard",
        "outcome": trial.outcome.value,
        "wall_s": wall,
    }
    if memcheck:
        row.update(
            detected=report is not None,
            diagnosis_s=seen.get("at", wall if report else None),
            stopped_early="at" in seen,
            report=report,
        )
    else:
        row.update(
            detected=found_at is not None,
            diagnosis_s=None if found_at is None else found_at - t_spawn,
            finding=trial.guard_findings[0].slot if trial.guard_findings else None,
        )
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
