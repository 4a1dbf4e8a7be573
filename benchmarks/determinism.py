"""Determinism: does every seed give the same verdict?

For each scenario and after-free value: N unfixed trials (seeds 0..N-1) must all reproduce, with
one and the same outcome; N fixed trials must all be CLEAN (a non-CLEAN fixed trial is a false
alarm). Every trial is a full isolated trial (fresh processes, NCCL at TP=2), `--jobs` at a time.
Usage: PYTHONPATH=$PWD python3 benchmarks/determinism.py --n 20 --jobs 12 --json OUT/det.json
       [--scenario gemma4-mtp --scenario nvfp4-reload] [--after-free keep release reuse poison]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

from common import emit
from repro.env import gpus
from repro.outcome import REPRODUCED, Outcome
from repro.run.runner import plan, run_planned

# The shipping set-up of each scenario: gemma4-mtp at E2B dims and TP=2 (the bug needs TP > 1),
# nvfp4-reload at Qwen3-30B-A3B MoE dims. Steps are cut to what a verdict needs.
SETUPS = {
    "gemma4-mtp": {"tp": 2, "steps": 4},
    "nvfp4-reload": {"steps": 3},
}
MODES = ("unfixed", "fixed")


def planned_trials(scenarios: list[str], after_free: list[str], n: int, gpus: int, deadline: float) -> list:
    """Seed-major order: a run cut short still has the same seeds for every group."""
    out = []
    for seed in range(n):
        for scenario in scenarios:
            for af in after_free:
                for mode in MODES:
                    run = {**SETUPS[scenario], "mode": mode, "after_free": af, "seed": seed, "deadline_s": deadline}
                    out.append(plan(scenario, None, run, [], gpus))
    return out


def tally(trials: list) -> list[dict]:
    groups: dict[tuple, list] = collections.defaultdict(list)
    for t in trials:
        groups[(t.scenario, t.config["run"]["after_free"], t.mode)].append(t)
    rows = []
    for (scenario, af, mode), ts in groups.items():
        counts = collections.Counter(t.outcome.value for t in ts)
        row = {
            "scenario": scenario,
            "after_free": af,
            "mode": mode,
            "n": len(ts),
            "outcomes": dict(counts),
            "graph_replayed": sum(t.graph_replayed for t in ts),
            "total_s_median": sorted(t.timings.get("total", 0.0) for t in ts)[len(ts) // 2],
        }
        if mode == "unfixed":
            row["reproduced"] = sum(t.outcome in REPRODUCED for t in ts)
            row["same_outcome"] = max(counts.values())
        else:
            row["false_alarms"] = sum(t.outcome != Outcome.CLEAN for t in ts)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--scenario", action="append", choices=sorted(SETUPS))
    ap.add_argument("--after-free", nargs="+", default=["keep", "release", "reuse", "poison"])
    ap.add_argument("--deadline", type=float, default=180)
    ap.add_argument("--json")
    ap.add_argument("--log", help="JSON lines, one per finished trial, written as they finish")
    a = ap.parse_args()
    planned = planned_trials(a.scenario or list(SETUPS), a.after_free, a.n, gpus.gpu_count(), a.deadline)
    if any(p.device != "cuda" for p in planned):
        sys.exit("determinism: needs CUDA GPUs (2 for gemma4-mtp at TP=2); a CPU run replays no graph")
    done = []
    log = open(a.log, "a", buffering=1) if a.log else None

    def progress(trial) -> None:
        done.append(trial)
        r = trial.config["run"]
        line = {
            "scenario": trial.scenario,
            "mode": trial.mode,
            "after_free": r["after_free"],
            "seed": r["seed"],
            "outcome": trial.outcome.value,
            "total_s": trial.timings.get("total"),
        }
        if trial.first_failure:  # keep the cause: the trial's files are temporary
            line["detail"] = trial.first_failure.detail
            line["errors"] = [r.error or r.stderr_tail[-400:] for r in trial.ranks if not r.killed_by_harness]
        sys.stderr.write(f"[{len(done)}/{len(planned)}] {json.dumps(line)}\n")
        if log:
            log.write(json.dumps(line) + "\n")

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = run_planned(planned, Path(tmp), on_done=progress, jobs=a.jobs)
    wall = time.perf_counter() - start
    emit(
        {
            "n": a.n,
            "jobs": a.jobs,
            "trials": len(planned),
            "wall_s": wall,
            "environment": result.report.environment.get("summary"),
            "rows": tally(result.report.trials),
        },
        a.json,
    )


if __name__ == "__main__":
    main()
