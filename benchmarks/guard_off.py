"""Does any outcome depend on the guard? Every after-free value with the guard on and off.

Each (knob, guard) pair is one full isolated trial, `--jobs` at a time; the table pairs them
up and says whether the outcome is the same. The after-free knob takes its blocks from the
graph census, so the two columns must agree; findings are counted by the mechanism that saw
them (guard / census / both).
Usage: PYTHONPATH=$PWD python3 benchmarks/guard_off.py --scenario nvfp4-reload [--tp N]
       [--steps N] [--seed S] [--jobs 8] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

from common import emit
from repro.env import gpus
from repro.outcome import AfterFreeKnob
from repro.run.runner import plan, run_planned

GUARDS = ("warn", "off")


def planned_trials(scenario: str, run: dict, knobs: list[str]) -> list:
    return [
        plan(scenario, None, {**run, "after_free": knob, "guard": guard}, [], gpus.gpu_count())
        for knob in knobs
        for guard in GUARDS
    ]


def row_of(t) -> dict:
    mechanisms = collections.Counter(f.mechanism for f in t.guard_findings)
    after_free = t.details.get("after_free", {})
    return {
        "after_free": t.config["run"]["after_free"],
        "guard": t.config["run"]["guard"],
        "outcome": t.outcome.value,
        "first_failure": t.first_failure.detail if t.first_failure else "",
        "findings": dict(mechanisms),
        "after_free_blocks": after_free.get("blocks"),
        "after_free_landed": after_free.get("landed"),
        "after_free_note": after_free.get("note", ""),
        "finding_list": [finding_row(f) for f in t.guard_findings],
    }


def finding_row(f) -> dict:
    c = f.census or {}
    return {
        "mechanism": f.mechanism,
        "status": f.status,
        "slot": f.slot,
        "when": f.when,
        "block": [c.get("block_start"), c.get("block_size")] if c else None,
        "site": (c.get("sites") or [""])[0] if c else "",
        "disagreement": f.disagreement,
    }


def table(rows: list[dict]) -> str:
    lines = ["| after-free | guard on (warn) | guard off | same | findings on / off |", "|---|---|---|---|---|"]
    by = {(r["after_free"], r["guard"]): r for r in rows}
    for knob in dict.fromkeys(r["after_free"] for r in rows):
        on, off = by.get((knob, "warn")), by.get((knob, "off"))
        if on is None or off is None:
            continue
        same = "yes" if on["outcome"] == off["outcome"] else "NO"
        lines.append(f"| {knob} | {on['outcome']} | {off['outcome']} | {same} | {on['findings']} / {off['findings']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="nvfp4-reload")
    ap.add_argument("--mode", default="unfixed")
    ap.add_argument("--tp", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--after-free", nargs="*", default=[k.value for k in AfterFreeKnob])
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    run = {"mode": args.mode, "seed": args.seed}
    if args.tp:
        run["tp"] = args.tp
    if args.steps:
        run["steps"] = args.steps
    with tempfile.TemporaryDirectory(prefix="repro-guard-off-") as tmp:
        result = run_planned(planned_trials(args.scenario, run, args.after_free), Path(tmp), jobs=args.jobs)
    rows = [row_of(t) for t in result.report.trials]
    sys.stderr.write(table(rows) + "\n")
    same = all(
        r_on["outcome"] == r_off["outcome"]
        for r_on in rows
        for r_off in rows
        if r_on["after_free"] == r_off["after_free"]
    )
    emit({"scenario": args.scenario, "run": run, "rows": rows, "all_same": same}, args.json)


if __name__ == "__main__":
    main()
