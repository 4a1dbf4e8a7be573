"""Which test captured a graph and which test replayed it, from the watch records on disk.

The pytest plugin writes a ``{"kind": "test", "nodeid", "phase"}`` marker into its process's
record file at the start of every phase (setup / call / teardown; nodeid "" between tests), so
every capture and finding record that follows in the same file belongs to that phase. A process
a test starts (directly, through a shell, at any depth) has a record file of its own without
markers; its process record carries REPRO_WATCH_OWNER, the record file of the test process
that started it (the plugin keeps that variable in the session's environment), and its records
belong to the phase that was running there at the record's time. Records are read back
incrementally, complete lines only (a line being written is read next time). No torch, no
pytest: plain records in, findings with their phases out.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from repro.outcome import Mechanism, as_member

MARKER = "test"
OWNER_KEY = "REPRO_WATCH_OWNER"  # repro.watch.settings.ENV_OWNER, in a process record's "env"


class Stage(StrEnum):
    """A test's phase, as pytest names it (TestReport.when)."""

    SETUP = "setup"
    CALL = "call"
    TEARDOWN = "teardown"
    NONE = ""  # outside any test


@dataclass(frozen=True)
class Phase:
    nodeid: str  # "" outside any test (collection, session start and end)
    phase: Stage

    def text(self) -> str:
        return f"{self.nodeid} ({self.phase})" if self.nodeid else "outside any test"

    def as_dict(self) -> dict[str, str]:
        # Plain strings, no enum members: the dict rides on a TestReport, which pytest-forked
        # marshals and xdist sends through execnet, and neither takes a str subclass.
        return {"nodeid": self.nodeid, "phase": str(self.phase)}


OUTSIDE = Phase("", Stage.NONE)


@dataclass
class PhaseFinding:
    """A finding record with the phase that captured its graph and the one that replayed it."""

    id: str  # "<record file>:<line>": the same finding read twice is one
    pid: int
    mechanism: Mechanism
    finding: dict[str, Any]  # repro.outcome.Finding as the hooks wrote it
    captured_in: Phase | None  # None: no capture record for its graph in these records
    replayed_in: Phase

    def as_dict(self) -> dict[str, Any]:
        # Plain strings, as Phase.as_dict: the finding dict is the one read from JSON already.
        return {
            "id": self.id,
            "pid": self.pid,
            "mechanism": str(self.mechanism),
            "finding": self.finding,
            "captured_in": self.captured_in.as_dict() if self.captured_in else None,
            "replayed_in": self.replayed_in.as_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PhaseFinding:
        cap = d.get("captured_in")
        return cls(
            id=d["id"],
            pid=d["pid"],
            mechanism=as_member(Mechanism, d.get("mechanism", Mechanism.GUARD)),
            finding=d.get("finding", {}),
            captured_in=marker_phase(cap) if cap else None,
            replayed_in=marker_phase(d["replayed_in"]),
        )


@dataclass
class RecordFile:
    """One process's record file, read from where the last read stopped."""

    path: Path
    offset: int = 0
    lines: int = 0
    pid: int | None = None
    owner: str | None = None  # stem of the test process's file that started this process
    markers: bool = False  # the plugin ran in this process: it reports its own findings
    current: Phase = OUTSIDE  # the last marker read

    @property
    def stem(self) -> str:
        return self.path.stem

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
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            self.note_process(record)
            out.append((self.lines, record))
        return out

    def head(self) -> None:
        """The process record only (the first line), leaving the file to be read from its start."""
        if self.pid is not None:
            return
        try:
            with open(self.path, "rb") as f:
                line = f.readline()
        except OSError:
            return
        if line.endswith(b"\n"):
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                return
            self.note_process(record)

    def note_process(self, record: dict) -> None:
        """The process record names the file's pid and the test process that owns it."""
        if record.get("kind") == "process":
            self.pid = record.get("pid")
            self.owner = (record.get("env") or {}).get(OWNER_KEY)


def graph_key(label: str) -> str:
    """A finding's graph field may carry " (+N more)"; the capture record has the bare label."""
    cut = label.find(" (+")
    return label if cut < 0 else label[:cut]


def marker_phase(r: dict[str, Any]) -> Phase:
    """The phase a marker record (or Phase.as_dict) names."""
    return Phase(r.get("nodeid", ""), as_member(Stage, r.get("phase", Stage.NONE)))


@dataclass
class Attribution:
    """Findings of one test process and of the processes its tests start, with their phases.

    me: the stem of this process's record file (it changes in a forked child)."""

    run_dir: Path
    me: str
    files: dict[Path, RecordFile] = field(default_factory=dict)
    captures: dict[tuple[str, str], Phase] = field(default_factory=dict)  # (file stem, graph)
    timeline: list[tuple[float, Phase]] = field(default_factory=list)  # this process's markers

    def note_phase(self, at: float, phase: Phase) -> None:
        """The plugin wrote a marker at `at` (time.time()): started processes' records map to it."""
        self.timeline.append((at, phase))

    def phase_at(self, t: float) -> Phase:
        i = bisect.bisect_right([at for at, _ in self.timeline], t) - 1
        return self.timeline[i][1] if i >= 0 else OUTSIDE

    def file(self, path: Path) -> RecordFile:
        rf = self.files.get(path)
        if rf is None:
            rf = self.files[path] = RecordFile(path)
        return rf

    def poll(self) -> list[PhaseFinding]:
        """New findings in this process's file and its started processes' since the last poll."""
        found: list[PhaseFinding] = []
        for path in sorted(self.run_dir.glob("*.jsonl")):
            rf = self.file(path)
            rf.head()
            own = rf.stem == self.me
            if own or (rf.owner == self.me and not rf.markers):
                self.read_into(rf, found, own)
        return found

    def read_into(self, rf: RecordFile, found: list[PhaseFinding], own: bool) -> None:
        mine: list[PhaseFinding] = []
        for line, r in rf.read_new():
            kind = r.get("kind")
            if kind == MARKER:
                rf.markers = True
                rf.current = marker_phase(r)
            elif kind == "capture":
                self.captures[(rf.stem, r.get("graph", ""))] = self.context(rf, r)
            elif kind == "finding":
                mine.append(self.finding(rf, line, r))
        if own or not rf.markers:  # a started process running its own session reports itself
            found.extend(mine)

    def context(self, rf: RecordFile, r: dict[str, Any]) -> Phase:
        return rf.current if rf.markers else self.phase_at(r.get("t", 0.0))

    def finding(self, rf: RecordFile, line: int, r: dict[str, Any]) -> PhaseFinding:
        f = r.get("finding", {})
        return PhaseFinding(
            id=f"{rf.path.name}:{line}",
            pid=rf.pid or 0,
            mechanism=as_member(Mechanism, r.get("mechanism", Mechanism.GUARD)),
            finding=f,
            captured_in=self.capture_phase(rf, graph_key(f.get("graph", ""))),
            replayed_in=self.context(rf, r),
        )

    def capture_phase(self, rf: RecordFile, label: str) -> Phase | None:
        """The capture in this process, else in its owner's (a graph captured before a fork)."""
        by_stem = {f.stem: f for f in self.files.values()}
        stem, hops = rf.stem, 0
        while stem is not None and hops < 64:
            if (stem, label) in self.captures:
                return self.captures[(stem, label)]
            owner = by_stem.get(stem)
            stem, hops = (owner.owner if owner else None), hops + 1
        return None


def all_findings(run_dir: Path, root: str) -> list[PhaseFinding]:
    """Every finding of the session whose main process wrote `root`.jsonl (its own, its
    workers', forked children's and started processes': every file whose owner chain reaches
    it; a directory reused across sessions holds others). A file with markers is attributed
    by its own, a started process by its owner's markers at the record's time."""
    files = {p: RecordFile(p) for p in sorted(run_dir.glob("*.jsonl"))}
    records = {p: rf.read_new() for p, rf in files.items()}
    by_stem = {rf.stem: rf for rf in files.values()}
    files = {p: rf for p, rf in files.items() if reaches(rf, root, by_stem)}
    records = {p: records[p] for p in files}
    timelines: dict[str, list[tuple[float, Phase]]] = {}
    for p, recs in records.items():
        for _, r in recs:
            if r.get("kind") == MARKER:
                files[p].markers = True
                timelines.setdefault(files[p].stem, []).append((r.get("at", r.get("t", 0.0)), marker_phase(r)))
    captures: dict[tuple[str, str], Phase] = {}
    views = {
        p: Attribution(run_dir, me=rf.stem, files=files, captures=captures, timeline=timelines.get(rf.owner or "", []))
        for p, rf in files.items()
    }
    out: list[PhaseFinding] = []
    for wanted in ("capture", "finding"):  # every capture first: a fork's graph is its parent's
        for p, recs in records.items():
            rf, view = files[p], views[p]
            rf.current = OUTSIDE
            for line, r in recs:
                kind = r.get("kind")
                if kind == MARKER:
                    rf.current = marker_phase(r)
                elif kind == wanted == "capture":
                    captures[(rf.stem, r.get("graph", ""))] = view.context(rf, r)
                elif kind == wanted == "finding":
                    out.append(view.finding(rf, line, r))
    return out


def reaches(rf: RecordFile, root: str, by_stem: dict[str, RecordFile]) -> bool:
    stem, hops = rf.stem, 0
    while stem is not None and hops < 64:
        if stem == root:
            return True
        owner = by_stem.get(stem)
        stem, hops = (owner.owner if owner else None), hops + 1
    return False


@dataclass
class RunStats:
    """What the hooks saw in a run directory, so "no findings" is never said of nothing checked."""

    processes: int = 0
    captures: int = 0  # graphs checked (captured by the program itself)
    managed: int = 0  # captured by torch.compile's cudagraph trees: counted only
    internal_errors: list[str] = field(default_factory=list)


def run_stats(run_dir: Path, root: str) -> RunStats:
    files = [RecordFile(p) for p in sorted(run_dir.glob("*.jsonl"))]
    for rf in files:
        rf.head()
    by_stem = {rf.stem: rf for rf in files}
    stats = RunStats()
    for rf in files:
        if not reaches(rf, root, by_stem):
            continue
        for _, r in rf.read_new():
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
