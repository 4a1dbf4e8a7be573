"""`repro watch` records -> one run's report data: the processes watched and their findings.

Reads the ``<host>-<pid>.jsonl`` files the hooks wrote in one or more run directories (one
per node after a multi-node run), tolerating a last line cut short by a crash. Plain data, no
torch: the view model (repro/report/watch_view.py) decides what a report says of it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from repro.outcome import Finding, Mechanism, as_member, finding_from_dict
from repro.report.groups import FindingGroup, group_findings
from repro.watch.settings import OnFinding, Origin

SCHEMA = "repro.watch/1"


@dataclass
class WatchedProcess:
    """A process in which the hooks were active."""

    pid: int
    host: str
    ppid: int | None = None
    started: float = 0.0  # unix time the hooks started in it
    argv: list[str] = field(default_factory=list)
    rank: int | None = None  # torch.distributed rank once initialised, else from RANK
    env: dict[str, str] = field(default_factory=dict)  # RANK, LOCAL_RANK, WORLD_SIZE, ...
    origins: list[Origin] = field(default_factory=list)
    on_finding: OnFinding = OnFinding.WARN
    torch_hooked: bool = False  # torch.cuda.graphs was imported and CUDAGraph wrapped
    torch: str | None = None
    census: str = "not checked (no capture)"
    graphs: int = 0  # captures seen (managed ones included)
    managed_graphs: int = 0  # captured by torch.compile's cudagraph trees: not checked
    replays: int | None = None  # from the exit record; None when the process left none
    replays_all_counted: bool = True  # False: the wrappers stood aside a while (replays >= the count)
    findings: int = 0
    exited: bool = False  # False: killed, crashed hard, or still running
    forked: bool = False
    internal_errors: list[str] = field(default_factory=list)
    record_file: str = ""
    pool_managed: int = 0  # captured storages in their own graph's pool: not checked
    cross_pool: int = 0  # captured storages in another graph's pool: checked


@dataclass
class WatchFinding:
    pid: int
    host: str
    rank: int | None
    mechanism: Mechanism
    finding: Finding


@dataclass
class WatchReport:
    processes: list[WatchedProcess]
    findings: list[WatchFinding]
    command: list[str] = field(default_factory=list)
    run_dirs: list[str] = field(default_factory=list)
    command_exit: int | None = None  # CMD's own exit status (None: merged report, or not run)
    exit: int | None = None  # what `repro watch` exits with
    interrupted: bool = False
    on_finding: OnFinding = OnFinding.WARN
    created: str = ""
    notes: list[str] = field(default_factory=list)
    schema: str = SCHEMA

    def groups(self) -> list[FindingGroup]:
        """One group per problem (name pattern, status, mechanism, drop site), in the order of
        its first finding; members are the WatchFindings."""
        return group_findings(self.findings, finding_of=lambda w: w.finding)


# -- reading ------------------------------------------------------------------------------------


def read_records(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash mid-write
    return records


def process_from_records(path: Path, records: list[dict[str, Any]]) -> WatchedProcess | None:
    head = next((r for r in records if r.get("kind") == "process"), None)
    if head is None:
        return None
    proc = WatchedProcess(
        pid=head["pid"],
        host=head.get("host", ""),
        ppid=head.get("ppid"),
        started=head.get("started", 0.0),
        argv=head.get("argv", []),
        env=head.get("env", {}),
        origins=[as_member(Origin, head.get("origin", ""))],
        on_finding=as_member(OnFinding, head.get("on_finding", OnFinding.WARN)),
        forked=bool(head.get("forked")),
        record_file=str(path),
    )
    rank_env = proc.env.get("RANK")
    proc.rank = int(rank_env) if rank_env is not None and rank_env.isdigit() else None
    for r in records:
        apply_record(proc, r)
    return proc


def apply_record(proc: WatchedProcess, r: dict[str, Any]) -> None:
    kind = r.get("kind")
    if kind == "hooked":
        proc.torch_hooked = True
        proc.torch = r.get("torch") or proc.torch
    elif kind == "origin":
        proc.origins.append(as_member(Origin, r.get("origin", "")))
    elif kind == "census":
        proc.census = r.get("state", proc.census)
    elif kind == "rank" and r.get("rank") is not None:
        proc.rank = r["rank"]
    elif kind == "capture":
        proc.graphs += 1
        proc.managed_graphs += bool(r.get("managed"))
    elif kind == "finding":
        proc.findings += 1
    elif kind == "internal":
        proc.internal_errors.append(f"{r.get('where')}: {r.get('error')}")
    elif kind == "exit":
        proc.exited = True
        proc.replays = r.get("counters", {}).get("replays", 0)
        proc.replays_all_counted = not r.get("stood_aside")
        proc.pool_managed = r.get("pool_managed", 0)
        proc.cross_pool = r.get("cross_pool", 0)
        proc.census = r.get("census", proc.census)
        if r.get("rank") is not None:
            proc.rank = r["rank"]


def findings_from_records(proc: WatchedProcess, records: list[dict[str, Any]]) -> list[WatchFinding]:
    out = []
    for r in records:
        if r.get("kind") != "finding":
            continue
        finding = finding_from_dict(r.get("finding", {}))
        rank = r.get("rank", proc.rank)
        out.append(
            WatchFinding(
                pid=proc.pid,
                host=proc.host,
                rank=rank,
                mechanism=as_member(Mechanism, r.get("mechanism", Mechanism.GUARD)),
                finding=finding,
            )
        )
    return out


def record_files(run_dirs: list[Path]) -> list[Path]:
    return sorted(p for d in run_dirs for p in Path(d).glob("*.jsonl"))


def load_report(run_dirs: list[Path]) -> WatchReport:
    processes, findings = [], []
    for path in record_files(run_dirs):
        records = read_records(path)
        proc = process_from_records(path, records)
        if proc is None:
            continue
        processes.append(proc)
        findings.extend(findings_from_records(proc, records))
    processes.sort(key=lambda p: (p.host, p.started, p.pid))
    return WatchReport(
        processes=processes,
        findings=findings,
        run_dirs=[str(d) for d in run_dirs],
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
