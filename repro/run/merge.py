"""`repro merge REPORT.json ...`: the shard reports of one split joined into one report.

The merged report is what one run of the whole plan would have written: the trials in plan
order, each with the host its shard ran on (`node`), the environment of the first shard, and a
`shard` key that lists the shards merged. A shard missing from the reports given, or given
twice, is a failure of the merged run, named in the report (summary line, JUnit, JSON
`shard.problems`): CI must never mistake 3 shards of 4 for a green run.

Reports of different plans (another matrix, another `--only`, another shard count) cannot be
joined: that is bad input (exit 2), not a failed run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repro.config import ConfigError
from repro.outcome import Report, report_from_dict


@dataclass
class ShardReport:
    path: Path
    report: Report
    shard: dict[str, Any]

    @property
    def name(self) -> str:
        return f"{self.shard['index']}/{self.shard['count']}"


def load(path: Path) -> ShardReport:
    try:
        report = report_from_dict(json.loads(path.read_text()))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a repro JSON report ({e})") from None
    shard = report.shard
    if not shard or "plan" not in shard or "index" not in shard or "merged" in shard:
        raise ConfigError(
            f"{path}: not the report of one shard (it has no shard K/N); "
            "write each shard's with `repro matrix --shard K/N --json PATH`"
        )
    return ShardReport(path, report, shard)


def check_same_split(shards: list[ShardReport]) -> None:
    first = shards[0]
    for s in shards[1:]:
        if s.shard["count"] != first.shard["count"]:
            raise ConfigError(
                f"{s.path} is shard {s.name} of {s.shard['count']}, {first.path} shard {first.name} "
                f"of {first.shard['count']}: merge the reports of one split"
            )
        if s.shard["plan"] != first.shard["plan"]:
            raise ConfigError(
                f"{s.path} was planned with {len(s.shard['plan'])} trials, {first.path} with "
                f"{len(first.shard['plan'])} (or other ids): merge the reports of one matrix, "
                "run with the same --config and --only"
            )


def host_of(report: Report) -> str:
    host = (report.environment or {}).get("host") or {}
    return str(host.get("hostname") or "") if isinstance(host, dict) else ""


def problems_of(shards: list[ShardReport], count: int, plan: list[str]) -> list[str]:
    """Missing or duplicated shards, and trials that no shard (or two) was given."""
    problems = []
    by_index: dict[int, list[ShardReport]] = {}
    for s in shards:
        by_index.setdefault(s.shard["index"], []).append(s)
    for k in range(1, count + 1):
        if k not in by_index:
            problems.append(f"shard {k}/{count} missing: no report given for it")
        elif len(by_index[k]) > 1:
            problems.append(
                f"shard {k}/{count} given {len(by_index[k])} times ({', '.join(str(s.path) for s in by_index[k])})"
            )
    owner: dict[str, str] = {}
    for k in sorted(by_index):
        s = by_index[k][0]
        for tid in s.shard["trials"]:
            if tid in owner and owner[tid] != s.name:
                problems.append(
                    f"trial {tid} is in shard {owner[tid]} and shard {s.name}: the shards were split "
                    "differently (the same --balance file for every shard?)"
                )
            owner.setdefault(tid, s.name)
    present = set(by_index)
    unowned = [t for t in plan if t not in owner]
    if unowned and len(present) == count:
        problems.append(f"{len(unowned)} planned trial(s) in no shard: {', '.join(unowned[:5])}")
    return problems


def merge(paths: list[Path]) -> Report:
    """One report over shard reports; shard problems are in report.shard['problems']."""
    if not paths:
        raise ConfigError("repro merge needs at least one shard report (REPORT.json ...)")
    shards = [load(p) for p in paths]
    check_same_split(shards)
    count, plan = shards[0].shard["count"], list(shards[0].shard["plan"])
    problems = problems_of(shards, count, plan)
    firsts: dict[int, ShardReport] = {}
    for s in sorted(shards, key=lambda s: s.shard["index"]):
        firsts.setdefault(s.shard["index"], s)
    used = list(firsts.values())
    trials = {}
    for s in used:
        for t in s.report.trials:
            t.node = t.node or host_of(s.report) or None
            trials.setdefault(t.id, t)
    order = {tid: i for i, tid in enumerate(plan)}
    owned = {tid for s in used for tid in s.shard["trials"]}
    interrupted_by = next((s.report.interrupted_by for s in used if s.report.interrupted_by), None)
    return Report(
        environment=used[0].report.environment,
        trials=sorted(trials.values(), key=lambda t: order.get(t.id, len(order))),
        created=min(s.report.created for s in used),
        interrupted=any(s.report.interrupted for s in used),
        interrupted_by=interrupted_by,
        not_run=sum(s.report.not_run for s in used) + sum(1 for t in plan if t not in owned),
        shard={
            "merged": [
                {
                    "index": s.shard["index"],
                    "count": count,
                    "source": str(s.path),
                    "host": host_of(s.report),
                    "created": s.report.created,
                    "by": s.shard.get("by", ""),
                }
                for s in used
            ],
            "count": count,
            "plan": plan,
            "problems": problems,
        },
    )
