"""Time to verdict of whole CLI trials (process start included), median/min/max of N runs.

Usage: PYTHONPATH=$PWD python3 benchmarks/time_to_verdict.py --runs 5 --json out.json \\
           -- gemma4-mtp --tp 2 -- nvfp4-reload --steps 5
Each `--`-separated group is one `repro` command; its JSON report gives the phase split.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import emit

PHASES = ("start", "import", "init", "build", "capture", "reload", "replays", "total")


def run_once(args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "repro", *args, "--json", str(out),
                               "--artifacts", tmp], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        trial = json.loads(out.read_text())["trials"][0]
    # harness: the CLI's own time outside the trial (interpreter, imports, planning, report).
    return {"exit": proc.returncode, "wall": wall, "outcome": trial["outcome"], **trial["timings"],
            "harness": wall - trial["timings"]["total"]}


def summarize(samples: list[dict]) -> dict:
    row = {"outcomes": sorted({s["outcome"] for s in samples}), "exits": sorted({s["exit"] for s in samples})}
    for key in ("wall", "harness", *PHASES):
        values = [s[key] for s in samples if key in s]
        if values:
            row[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("commands", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    groups, cur = [], []
    for word in a.commands:
        if word == "--":
            if cur:
                groups.append(cur)
            cur = []
        else:
            cur.append(word)
    if cur:
        groups.append(cur)
    doc = {" ".join(g): summarize([run_once(g) for _ in range(a.runs)]) for g in groups}
    emit(doc, a.json)


if __name__ == "__main__":
    main()
