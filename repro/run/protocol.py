"""What the parent (isolate.py) and a rank (worker.py) say to each other, in one place.

The parent writes the trial's TrialSpec to spec.json and starts one rank process per rank
(`repro.rank.worker.main`, forked by the rank server or spawned as `python -m repro.rank.worker`); each rank appends one JSON object per line to rank<R>.jsonl, flushed as soon as it
has it, so a crash loses nothing already produced. Every line carries "event" (an Event), the
rank and a wall-clock "t"; the other fields depend on the event. The rank server
(repro/rank/server.py, which forks the ranks) answers the parent (repro/run/launch.py) in lines
whose "op" is a ServerOp. Neither side imports the other: both import this module (plain data,
no torch).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

from repro.outcome import to_jsonable


class Event(str, Enum):
    START = "start"  # pid, device, world_size, visible_gpus: the rank is up
    RUNTIME = "runtime"  # rank 0, once torch is imported: torch/CUDA/NCCL facts
    PHASE = "phase"  # name, seconds
    BEGIN = "begin"  # step: a death from here on belongs to this step
    FAULT = "fault"  # kind, step: an injected fault (test hook) fires now
    REPLAY = "replay"  # graph: a captured graph is about to replay (once per graph)
    STEP = "step"  # a StepRecord
    FINDING = "finding"  # a guard Finding
    MANIFEST = "manifest"  # a Manifest
    NOTE = "note"  # text
    DETAIL = "detail"  # trial facts (after-free result, mechanism, ...)
    ARTIFACT = "artifact"  # name, path
    UNSUPPORTED = "unsupported"  # reason: this rank cannot run the scenario here
    ERROR = "error"  # type, message, traceback, peak_reserved_bytes: recorded before the rank exits
    DONE = "done"  # timings, peak_reserved_bytes (None off CUDA): the rank finished cleanly


class ServerOp(StrEnum):
    """The "op" of each JSON line the rank server writes to the parent; the other fields by op.
    A StrEnum: it is its value on the wire and equals the plain string read back."""

    READY = "ready"  # pid, preload_s, threads: once, after the preload; ranks can be forked
    UNAVAILABLE = "unavailable"  # reason: once, instead of READY; the parent spawns ranks itself
    STARTED = "started"  # id, pid, pgid: the rank of request id is forked
    FAILED = "failed"  # id, reason: the rank of request id was not forked
    EXIT = "exit"  # pid, code: a rank was reaped (code as Popen.returncode)


# Test hook: the ways a rank can be made to fail as real failures look from the outside.
FAULTS = ("segv", "hang", "ima-message", "exit", "sigkill", "raise")

# Before killing a group at its deadline the parent sends this to every rank; a rank answers
# with the Python stacks of all its threads (faulthandler) in rank<R>.stacks.
STACKS_SIGNAL = signal.SIGUSR1


@dataclass
class TrialSpec:
    """What the parent hands every rank of a trial (written to spec.json)."""

    trial_id: str
    config: dict[str, Any]  # TrialConfig.to_dict()
    device: str  # "cuda" | "cpu"
    world_size: int
    out_dir: str
    fault: dict[str, Any] | None = None  # test hook: {"kind", "rank", "step"}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @staticmethod
    def load(path: Path) -> "TrialSpec":
        return TrialSpec(**json.loads(path.read_text()))


def spec_path(out_dir: str | Path) -> Path:
    return Path(out_dir) / "spec.json"


def records_path(out_dir: str | Path, rank: int) -> Path:
    return Path(out_dir) / f"rank{rank}.jsonl"


def log_path(out_dir: str | Path, rank: int) -> Path:
    return Path(out_dir) / f"rank{rank}.log"


def stacks_path(out_dir: str | Path, rank: int) -> Path:
    return Path(out_dir) / f"rank{rank}.stacks"


def rendezvous_path(out_dir: str | Path) -> Path:
    """Where rank 0 publishes its store port for the other ranks."""
    return Path(out_dir) / "store_port"


class RecordSink:
    """The rank's side: append-only JSON lines, each flushed before the call returns."""

    def __init__(self, path: Path, rank: int):
        self.rank = rank
        self.file = open(path, "a", buffering=1, encoding="utf-8")

    def emit(self, event: Event, **fields: Any) -> None:
        line = {"event": Event(event).value, "rank": self.rank, "t": time.time(), **to_jsonable(fields)}
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()


@dataclass
class RankRecords:
    """The parent's side: every complete record one rank wrote, in order."""

    events: list[dict[str, Any]] = field(default_factory=list)

    def of(self, kind: Event) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]


def parse_lines(text: str) -> list[dict[str, Any]]:
    """Complete JSON lines; a torn last line (SIGKILL mid-write) is dropped."""
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_records(out_dir: str | Path, world_size: int) -> list[RankRecords]:
    out = []
    for r in range(world_size):
        path = records_path(out_dir, r)
        text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
        out.append(RankRecords(parse_lines(text)))
    return out


class StepCounter:
    """Steps one rank has recorded so far, read incrementally (the progress display polls it)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.steps = 0
        self.begun = 0  # steps begun (a step's own phases come after it)

    def poll(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.steps
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits
        self.offset += len(complete)
        records = parse_lines(complete.decode("utf-8", errors="replace"))
        self.steps += sum(1 for e in records if e.get("event") == Event.STEP)
        self.begun += sum(1 for e in records if e.get("event") == Event.BEGIN)
        return self.steps
