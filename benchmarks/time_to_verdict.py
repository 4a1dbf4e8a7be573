"""Time to verdict of whole CLI trials (process start included), median/min/max of N runs.

Usage: PYTHONPATH=$PWD python3 benchmarks/time_to_verdict.py --runs 5 --json out.json \\
           [--tree before=/path/to/old/checkout --tree after=$PWD] [--cold] \\
           -- gemma4-mtp --tp 2 -- nvfp4-reload --steps 5
Each `--`-separated group is one `repro` command. With several trees (checkouts) the runs are
interleaved round by round (tree x command), so both see the same machine state: the ratio
is the result. --cold first runs each command once per tree with an empty cache directory
(XDG_CACHE_HOME: no bytecode of ours yet, as on a fresh machine) and reports it apart.

Per run: the CLI wall, `harness` (wall minus the trial: the parent's start-up, planning,
report), the trial's phases (slowest rank), and per rank a timeline from its records: when
it started (after the parent's spawn request) and when each phase ended.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import emit

PHASES = ("start", "import", "cuda", "init", "build", "capture", "reload", "replays", "total")


def rank_timeline(trial_dir: Path, spawned_wall: float) -> dict[str, dict[str, float]]:
    """rank -> {"started": s, "<phase> ends": s, "done": s} after the spawn (first of a name)."""
    out = {}
    for path in sorted(trial_dir.glob("rank*.jsonl")):
        marks: dict[str, float] = {}
        for line in path.read_text().splitlines():
            e = json.loads(line)
            key = {"start": "started", "done": "done"}.get(e["event"])
            if e["event"] == "phase":
                key = f"{e['name']} ends"
            if key and key not in marks:
                marks[key] = e["t"] - spawned_wall
        out[path.stem] = marks
    return out


def run_once(args: list[str], tree: str, cache: str | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        env = dict(os.environ, PYTHONPATH=tree)
        if cache:
            env["XDG_CACHE_HOME"] = cache
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "repro", *args, "--json", str(out), "--artifacts", tmp],
            capture_output=True,
            text=True,
            env=env,
            cwd=tree,
        )
        wall = time.perf_counter() - t0
        if not out.exists():
            return {"exit": proc.returncode, "wall": wall, "outcome": "NO REPORT", "error": proc.stderr[-500:]}
        trial = json.loads(out.read_text())["trials"][0]
        timings = trial["timings"]
        trial_dir = next((p.parent for p in Path(tmp).rglob("rank0.jsonl")), None)
        starts = (
            [
                r["t"]
                for r in map(json.loads, (trial_dir / "rank0.jsonl").read_text().splitlines())
                if r["event"] == "start"
            ]
            if trial_dir
            else []
        )
        spawned = starts[0] - timings.get("start", 0.0) if starts else None
        ranks = rank_timeline(trial_dir, spawned) if trial_dir and spawned else {}
    # harness: the CLI's own time outside the trial (interpreter, imports, planning, report).
    return {
        "exit": proc.returncode,
        "wall": wall,
        "outcome": trial["outcome"],
        **timings,
        "harness": wall - timings["total"],
        "ranks": ranks,
    }


def summarize(samples: list[dict]) -> dict:
    row: dict = {
        "outcomes": sorted({s["outcome"] for s in samples}),
        "exits": sorted({s["exit"] for s in samples}),
        "runs": len(samples),
    }
    for key in ("wall", "harness", *PHASES):
        values = [s[key] for s in samples if key in s]
        if values:
            row[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    ranks: dict = {}
    for s in samples:
        for rank, marks in s.get("ranks", {}).items():
            for mark, t in marks.items():
                ranks.setdefault(rank, {}).setdefault(mark, []).append(t)
    row["rank timelines (median s after spawn)"] = {
        rank: {
            m: round(statistics.median(v), 3) for m, v in sorted(marks.items(), key=lambda kv: statistics.median(kv[1]))
        }
        for rank, marks in ranks.items()
    }
    errors = [s["error"] for s in samples if "error" in s]
    if errors:
        row["errors"] = errors[:2]
    return row


def split_groups(words: list[str]) -> list[list[str]]:
    groups, cur = [], []
    for word in words:
        if word == "--":
            if cur:
                groups.append(cur)
            cur = []
        else:
            cur.append(word)
    if cur:
        groups.append(cur)
    return groups


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a checkout to time (default: this one); repeat to compare, interleaved",
    )
    ap.add_argument("--cold", action="store_true", help="first one run per tree and command on an empty cache")
    ap.add_argument("commands", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    groups = split_groups(a.commands)
    trees = dict(t.split("=", 1) for t in a.tree) or {"this": str(Path(__file__).resolve().parent.parent)}
    doc: dict = {}
    if a.cold:
        for name, tree in trees.items():
            for g in groups:
                with tempfile.TemporaryDirectory() as cache:
                    doc.setdefault("cold (empty cache, first run)", {})[f"{name}: {' '.join(g)}"] = summarize(
                        [run_once(g, tree, cache)]
                    )
    samples: dict[tuple[str, str], list[dict]] = {}
    for _ in range(a.runs):
        for name, tree in trees.items():
            for g in groups:
                samples.setdefault((name, " ".join(g)), []).append(run_once(g, tree, None))
    doc["warm"] = {f"{name}: {cmd}": summarize(s) for (name, cmd), s in samples.items()}
    if len(trees) > 1:
        first, *rest = trees
        doc["ratios (median wall / first tree's)"] = {
            f"{other}: {' '.join(g)}": round(
                doc["warm"][f"{other}: {' '.join(g)}"]["wall"]["median"]
                / doc["warm"][f"{first}: {' '.join(g)}"]["wall"]["median"],
                3,
            )
            for other in rest
            for g in groups
        }
    emit(doc, a.json)


if __name__ == "__main__":
    main()
