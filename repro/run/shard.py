"""`repro matrix --shard K/N`: a stable 1/N of a matrix's trials, for a CI system's own parallelism.

Buildkite (`parallelism: N`), GitHub Actions matrices and Slurm arrays start N copies of one
command; each copy runs its shard and writes its JSON report, and `repro merge` joins them
(repro/run/merge.py). The split depends only on the trial ids of the plan (and, with --balance, on
the durations a previous report recorded), never on the machine, the clock or the order the
trials were listed in, so every copy computes the same split without talking to the others.

Each shard's report records which shard it was and the ids of the whole plan, so the merge can
tell a missing or duplicated shard from a complete set.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from repro.config import ConfigError

# Where `--shard auto` looks, in this order: Buildkite's parallel job (0-based) and count, then
# a plain K/N that any CI (a GitHub Actions matrix, a Slurm array wrapper) can set.
BUILDKITE_JOB, BUILDKITE_COUNT = "BUILDKITE_PARALLEL_JOB", "BUILDKITE_PARALLEL_JOB_COUNT"
PLAIN_VAR = "REPRO_SHARD"
# A trial a previous report never timed counts this long when nothing else is known.
UNKNOWN_S = 1.0


@dataclass(frozen=True)
class Shard:
    index: int  # 1-based: shard 1/4 .. 4/4
    count: int

    @property
    def name(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass
class ShardRecord:
    """What a shard's report says about its place in the plan (the report's `shard` key)."""

    index: int
    count: int
    plan: list[str]  # every trial id of the full plan, in plan order
    trials: list[str]  # the ids this shard was given
    by: str = "trial id"  # how the plan was split: "trial id" | "durations from PATH"
    durations: dict[str, float] = field(default_factory=dict)  # the estimate each given trial was balanced by

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_shard(text: str, env: dict[str, str]) -> Shard:
    """'K/N' (1 <= K <= N) or 'auto'; a bad value is a ConfigError naming it and the fix."""
    if text == "auto":
        return shard_from_env(env)
    return parse_pair(f"--shard {text!r}", text)


def parse_pair(where: str, text: str) -> Shard:
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise ConfigError(f"{where}: expected K/N with 1 <= K <= N (e.g. 2/4), or auto") from None
    if n < 1 or not 1 <= k <= n:
        raise ConfigError(f"{where}: shard {k} of {n} does not exist; K runs from 1 to N (e.g. 1/{max(n, 1)})")
    return Shard(k, n)


def shard_from_env(env: dict[str, str]) -> Shard:
    job, count = env.get(BUILDKITE_JOB), env.get(BUILDKITE_COUNT)
    if job is not None or count is not None:
        where = f"--shard auto: {BUILDKITE_JOB}={job!r} {BUILDKITE_COUNT}={count!r}"
        try:
            k, n = int(job or ""), int(count or "")
        except ValueError:
            raise ConfigError(f"{where}: both must be integers (Buildkite sets them with `parallelism: N`)") from None
        return parse_pair(where, f"{k + 1}/{n}")  # Buildkite counts jobs from 0
    if env.get(PLAIN_VAR):
        return parse_pair(f"--shard auto: {PLAIN_VAR}={env[PLAIN_VAR]!r}", env[PLAIN_VAR])
    raise ConfigError(
        f"--shard auto: neither {BUILDKITE_JOB}/{BUILDKITE_COUNT} (Buildkite `parallelism`) "
        f"nor {PLAIN_VAR}=K/N is set; pass --shard K/N"
    )


def split_by_id(ids: list[str], count: int) -> list[list[str]]:
    """Round robin over the sorted ids: shard sizes differ by at most one trial."""
    ordered = sorted(ids)
    return [ordered[k::count] for k in range(count)]


def split_by_durations(ids: list[str], count: int, seconds: dict[str, float]) -> list[list[str]]:
    """Longest first onto the least loaded shard (ties: the lower shard), ids breaking ties in
    duration: deterministic for the same plan and the same previous report."""
    loads = [0.0] * count
    shards: list[list[str]] = [[] for _ in range(count)]
    for tid in sorted(ids, key=lambda t: (-seconds[t], t)):
        k = min(range(count), key=lambda i: (loads[i], i))
        shards[k].append(tid)
        loads[k] += seconds[tid]
    return [sorted(s) for s in shards]


def previous_durations(path: Path) -> dict[str, float]:
    """Seconds per trial id from a previous JSON report (a run's or a merge's)."""
    try:
        data = json.loads(path.read_text())
        trials = data["trials"]
        return {
            t["id"]: float(t["timings"]["total"])
            for t in trials
            if isinstance(t.get("timings"), dict) and "total" in t["timings"]
        }
    except OSError as e:
        raise ConfigError(
            f"--balance {path}: cannot read it ({e.strerror}); pass the JSON report of a previous run"
        ) from None
    except (ValueError, KeyError, TypeError):
        raise ConfigError(
            f"--balance {path}: not a repro JSON report (no trials[] with timings); "
            "pass the file a previous `repro matrix --json PATH` wrote"
        ) from None


def estimates(ids: list[str], recorded: dict[str, float]) -> dict[str, float]:
    """The recorded duration of each id; the median of the recorded ones for a trial never timed."""
    known = [recorded[t] for t in ids if t in recorded]
    fallback = statistics.median(known) if known else UNKNOWN_S
    return {t: recorded.get(t, fallback) for t in ids}


def select_shard(planned: list, text: str, balance: Path | None, env: dict[str, str]) -> tuple[list, ShardRecord]:
    """The planned trials of shard `text` ('K/N' | 'auto') and the record its report keeps."""
    from repro.run.matrix import planned_id

    record = assign([planned_id(p) for p in planned], parse_shard(text, env), balance)
    mine = set(record.trials)
    return [p for p in planned if planned_id(p) in mine], record


def assign(ids: list[str], shard: Shard, balance: Path | None = None) -> ShardRecord:
    """This shard's ids of the plan `ids` (plan order kept in `plan`)."""
    if balance is None:
        mine = split_by_id(ids, shard.count)[shard.index - 1]
        return ShardRecord(shard.index, shard.count, list(ids), mine)
    seconds = estimates(ids, previous_durations(balance))
    mine = split_by_durations(ids, shard.count, seconds)[shard.index - 1]
    return ShardRecord(
        shard.index,
        shard.count,
        list(ids),
        mine,
        by=f"durations from {balance.name}",
        durations={t: seconds[t] for t in mine},
    )
