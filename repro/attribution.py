"""Which test captured a graph and which test replayed it, from the watch records on disk.

The pytest plugin writes a ``{"kind": "test", "nodeid", "phase"}`` marker into its process's
record file at the start of every phase (setup / call / teardown; nodeid "" between tests), so
every capture and finding record that follows in the same file belongs to that phase. A
subprocess a test starts has a record file of its own, without markers: its records belong to
the phase that was running in its ancestor (found through the process records' ppid) at the
record's time. Records are read back incrementally, complete lines only (a line being written
is read next time). No torch, no pytest: plain records in, findings with their phases out.
"""
from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MARKER = "test"
PHASES = ("setup", "call", "teardown")


@dataclass(frozen=True)
class Phase:
    nodeid: str                   # "" outside any test (collection, session start and end)
    phase: str                    # setup | call | teardown | ""

    def text(self) -> str:
        return f"{self.nodeid} ({self.phase})" if self.nodeid else "outside any test"

    def as_dict(self) -> dict[str, str]:
        return {"nodeid": self.nodeid, "phase": self.phase}


OUTSIDE = Phase("", "")


@dataclass
class PhaseFinding:
    """A finding record with the phase that captured its graph and the one that replayed it."""
    id: str                       # "<record file>:<line>": the same finding read twice is one
    pid: int
    mechanism: str
    finding: dict[str, Any]       # repro.outcome.Finding as the hooks wrote it
    captured_in: Phase | None     # None: the capture record was not found (another process)
    replayed_in: Phase

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "pid": self.pid, "mechanism": self.mechanism, "finding": self.finding,
                "captured_in": self.captured_in.as_dict() if self.captured_in else None,
                "replayed_in": self.replayed_in.as_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PhaseFinding:
        cap = d.get("captured_in")
        return cls(id=d["id"], pid=d["pid"], mechanism=d.get("mechanism", "guard"),
                   finding=d.get("finding", {}), captured_in=Phase(**cap) if cap else None,
                   replayed_in=Phase(**d["replayed_in"]))


@dataclass
class RecordFile:
    """One process's record file, read from where the last read stopped."""
    path: Path
    offset: int = 0
    lines: int = 0
    pid: int | None = None
    ppid: int | None = None
    markers: bool = False         # the plugin ran in this process: it reports its own findings
    current: Phase = OUTSIDE      # the last marker read

    def read_new(self) -> list[tuple[int, dict[str, Any]]]:
        """(line number, record) of each complete line appended since the last read."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for raw in data[:end].splitlines():
            self.lines += 1
            try:
                out.append((self.lines, json.loads(raw)))
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
        return out


def graph_key(label: str) -> str:
    """A finding's graph field may carry " (+N more)"; the capture record has the bare label."""
    cut = label.find(" (+")
    return label if cut < 0 else label[:cut]


@dataclass
class Attribution:
    """Findings of one test process and the processes it started, each with its two phases."""
    run_dir: Path
    pid: int = field(default_factory=os.getpid)
    files: dict[Path, RecordFile] = field(default_factory=dict)
    captures: dict[tuple[int, str], Phase] = field(default_factory=dict)
    timeline: list[tuple[float, Phase]] = field(default_factory=list)   # this process's markers

    def note_phase(self, at: float, phase: Phase) -> None:
        """The plugin wrote a marker at `at` (time.time()): subprocess records map to it."""
        self.timeline.append((at, phase))

    def phase_at(self, t: float) -> Phase:
        i = bisect.bisect_right([at for at, _ in self.timeline], t) - 1
        return self.timeline[i][1] if i >= 0 else OUTSIDE

    def reset_for_fork(self, pid: int) -> None:
        """In a forked child (pytest-forked): its own record file is new; keep what was read."""
        self.pid = pid

    def file(self, path: Path) -> RecordFile:
        rf = self.files.get(path)
        if rf is None:
            rf = self.files[path] = RecordFile(path)
        return rf

    def descends(self, rf: RecordFile) -> bool:
        """Whether the file's process was started (at any depth) by this process."""
        ppid, hops = rf.ppid, 0
        by_pid = {f.pid: f for f in self.files.values() if f.pid is not None}
        while ppid is not None and hops < 64:
            if ppid == self.pid:
                return True
            parent = by_pid.get(ppid)
            ppid, hops = (parent.ppid if parent else None), hops + 1
        return False

    def poll(self) -> list[PhaseFinding]:
        """New findings in this process's file and its descendants' since the last poll."""
        found: list[PhaseFinding] = []
        paths = sorted(self.run_dir.glob("*.jsonl"))
        for path in paths:
            rf = self.file(path)
            if rf.pid is None:
                self.read_into(rf, found, own=False, head_only=True)
        for path in paths:
            rf = self.files[path]
            own = rf.pid == self.pid
            if own or (self.descends(rf) and not rf.markers):
                self.read_into(rf, found, own=own)
        return found

    def read_into(self, rf: RecordFile, found: list[PhaseFinding], own: bool,
                  head_only: bool = False) -> None:
        if head_only and rf.offset:
            return
        for line, r in rf.read_new():
            kind = r.get("kind")
            if kind == "process":
                rf.pid, rf.ppid = r.get("pid"), r.get("ppid")
                if head_only:
                    rf.offset, rf.lines = 0, 0      # read the whole file again when it is ours
                    return
                own = rf.pid == self.pid
            elif kind == MARKER:
                rf.markers = True
                rf.current = marker_phase(r)
            elif kind == "capture":
                self.captures[(rf.pid, r.get("graph", ""))] = self.context(rf, r)
            elif kind == "finding":
                found.append(self.finding(rf, line, r))

    def context(self, rf: RecordFile, r: dict[str, Any]) -> Phase:
        return rf.current if rf.markers else self.phase_at(r.get("t", 0.0))

    def finding(self, rf: RecordFile, line: int, r: dict[str, Any]) -> PhaseFinding:
        f = r.get("finding", {})
        return PhaseFinding(id=f"{rf.path.name}:{line}", pid=rf.pid or 0,
                           mechanism=r.get("mechanism", "guard"), finding=f,
                           captured_in=self.capture_phase(rf, graph_key(f.get("graph", ""))),
                           replayed_in=self.context(rf, r))

    def capture_phase(self, rf: RecordFile, label: str) -> Phase | None:
        """The capture in this process, else in an ancestor (a graph captured before a fork)."""
        by_pid = {f.pid: f for f in self.files.values() if f.pid is not None}
        pid, hops = rf.pid, 0
        while pid is not None and hops < 64:
            if (pid, label) in self.captures:
                return self.captures[(pid, label)]
            parent = by_pid.get(pid)
            pid, hops = (parent.ppid if parent else None), hops + 1
        return None


def all_findings(run_dir: Path) -> list[PhaseFinding]:
    """Every finding in a run directory, attributed by each file's own markers or, for a
    process without them, by its nearest marked ancestor's markers at the record's time."""
    files = {p: RecordFile(p) for p in sorted(run_dir.glob("*.jsonl"))}
    records = {p: rf.read_new() for p, rf in files.items()}
    by_pid: dict[int, RecordFile] = {}
    timelines: dict[int, list[tuple[float, Phase]]] = {}
    for p, recs in records.items():
        rf = files[p]
        for _, r in recs:
            if r.get("kind") == "process":
                rf.pid, rf.ppid = r.get("pid"), r.get("ppid")
                by_pid[rf.pid] = rf
            elif r.get("kind") == MARKER:
                rf.markers = True
                timelines.setdefault(rf.pid, []).append((r.get("at", r.get("t", 0.0)), marker_phase(r)))
    captures: dict[tuple[int, str], Phase] = {}
    views = {p: Attribution(run_dir, pid=files[p].pid or 0, files=files, captures=captures,
                            timeline=timelines.get(marked_ancestor(files[p], by_pid, timelines), []))
             for p in files}
    out: list[PhaseFinding] = []
    for wanted in ("capture", "finding"):    # every capture first: a fork's graph is its parent's
        for p, recs in records.items():
            rf, view = files[p], views[p]
            rf.current = OUTSIDE
            for line, r in recs:
                kind = r.get("kind")
                if kind == MARKER:
                    rf.current = marker_phase(r)
                elif kind == wanted == "capture":
                    captures[(rf.pid, r.get("graph", ""))] = view.context(rf, r)
                elif kind == wanted == "finding":
                    out.append(view.finding(rf, line, r))
    return out


def marker_phase(r: dict[str, Any]) -> Phase:
    return Phase(r.get("nodeid", ""), r.get("phase", ""))


def marked_ancestor(rf: RecordFile, by_pid: dict[int, RecordFile],
                    timelines: dict[int, list]) -> int | None:
    pid, hops = rf.pid, 0
    while pid is not None and pid not in timelines and hops < 64:
        parent = by_pid.get(pid)
        pid, hops = (parent.ppid if parent else None), hops + 1
    return pid


@dataclass
class RunStats:
    """What the hooks saw in a run directory, so "no findings" is never said of nothing checked."""
    processes: int = 0
    captures: int = 0             # graphs checked (captured by the program itself)
    managed: int = 0              # captured by torch.compile's cudagraph trees: counted only
    internal_errors: list[str] = field(default_factory=list)


def run_stats(run_dir: Path) -> RunStats:
    stats = RunStats()
    for path in sorted(run_dir.glob("*.jsonl")):
        for _, r in RecordFile(path).read_new():
            kind = r.get("kind")
            if kind == "process":
                stats.processes += 1
            elif kind == "capture":
                if r.get("managed"):
                    stats.managed += 1
                else:
                    stats.captures += 1
            elif kind == "internal":
                stats.internal_errors.append(f"pid {r.get('pid')}: {r.get('where')}: {r.get('error')}")
    return stats
